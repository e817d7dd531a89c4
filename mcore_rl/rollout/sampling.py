r"""The token-sampling step of the embedded rollout engine, and the `Sample` record it returns.

```
logits [B, V] -> / temperature -> log_softmax -> logprob of the chosen token (recorded)
                                \-> softmax -> nucleus (top_p) filter -> exponential race -> token
```

Which logprob is recorded: the log probability of the sampled token under the temperature-scaled distribution,
`log_softmax(logits / temperature)`, before top-p truncation (for greedy decoding, `temperature == 0`, the
temperature-1 distribution). This is what verl and slime store as the rollout logprob: the trainer recomputes
`log_softmax(logits / temperature)` for the same tokens, so the two are comparable (the difference measures
rollout/training mismatch), while the top-p renormalisation depends on the whole sorted vocabulary and is not
reproduced by trainers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

FinishReason = Literal["stop", "length"]


@dataclass
class Sample:
    """One generated response for one prompt."""

    prompt_ids: list[int]
    """The prompt's token ids, unpadded."""
    response_ids: list[int]
    """Generated token ids; ends with the EOS id when `finish_reason == "stop"`."""
    response_logprobs: list[float]
    """Per response token: `log_softmax(logits / temperature)` of the sampled token (temperature 1 when greedy)."""
    finish_reason: FinishReason
    """"stop": an EOS id was generated (and is included); "length": `max_new_tokens` was reached."""
    weight_version: int
    """The engine's weight version when this sample was generated."""


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero every token outside the nucleus: the smallest set of most-likely tokens whose mass reaches `top_p`.

    `probs` is `[B, V]`; the result is not renormalised (the exponential race in `sample_next_tokens` does not
    need it). The most likely token is always kept, so `top_p` close to 0 gives greedy decoding.
    """
    if top_p >= 1.0:
        return probs
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)


def sample_next_tokens(
    logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row of `logits` [B, V]; return `(tokens [B] int64, logprobs [B] float32)`.

    `temperature == 0` is greedy (argmax, logprob at temperature 1). Otherwise tokens are drawn from
    `softmax(logits / temperature)` restricted to the top-p nucleus, with `generator` as the only randomness.
    """
    logits = logits.float()
    if temperature == 0.0:
        tokens = logits.argmax(dim=-1)
        logprobs = torch.log_softmax(logits, dim=-1)
    else:
        logprobs = torch.log_softmax(logits / temperature, dim=-1)
        probs = top_p_filter(logprobs.exp(), top_p)
        # Exponential race (as in vLLM): argmax(p / q) with q ~ Exp(1) draws index i with probability p_i. Unlike
        # torch.multinomial it needs no host sync on GPU. The clamp keeps a (rare) q == 0 from turning a filtered
        # token's 0 / 0 into NaN, which argmax would pick.
        noise = torch.empty_like(probs).exponential_(1.0, generator=generator).clamp_(min=torch.finfo(probs.dtype).tiny)
        tokens = (probs / noise).argmax(dim=-1)
    chosen = logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return tokens, chosen


def validate_sampling_args(temperature: float, top_p: float, max_new_tokens: int, n: int) -> None:
    """Raise ValueError naming the argument and the accepted range when a sampling argument is out of range."""
    if not temperature >= 0.0:
        raise ValueError(f"temperature must be >= 0 (0 means greedy), got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
