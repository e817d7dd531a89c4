r"""The token-sampling step of the embedded rollout engine, and the `Sample` record it returns.

```
logits [B, V] -> / temperature (per row) -> log_softmax -> logprob of the chosen token (recorded)
                                          \-> softmax -> top-k -> top-p -> min-p -> inverse CDF (1 uniform) -> token
```

How a token is drawn (`inverse_cdf`): one uniform `u` per row from the row's own `torch.Generator`, and the first
token whose cumulative (filtered) mass exceeds `u` times the row's total mass: exact sampling from the filtered
distribution for one random number per row. The exponential race it replaced (vLLM's `argmax(p / q)`, q ~ Exp(1))
drew one number per vocabulary entry; on CPU those 49152 draws per row and step were a tenth of the real-model
recipe's generation time (docs/rollout.md, "Generation speed"). Same seed, other tokens than before that change.

Which logprob is recorded: the log probability of the sampled token under the temperature-scaled distribution,
`log_softmax(logits / temperature)`, before top-p truncation (for greedy decoding, `temperature == 0`, the
temperature-1 distribution). This is what verl and slime store as the rollout logprob: the trainer recomputes
`log_softmax(logits / temperature)` for the same tokens, so the two are comparable (the difference measures
rollout/training mismatch), while the top-p renormalisation depends on the whole sorted vocabulary and is not
reproduced by trainers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch

FinishReason = Literal["stop", "length", "abort"]
#: SGLang's `_SAMPLING_EPS`: a temperature below it samples greedily
GREEDY_BELOW = 1e-6


class NonFiniteLogits(ValueError):
    """Logits with NaN or +inf, or with every token at -inf: no token can be sampled from them (argmax would pick
    token 0 and call it a sample). The engine fails the requests of that step instead."""


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
    """"stop": an EOS id was generated (and is included); "length": `max_new_tokens` was reached; "abort": the
    engine aborted the request (pause in abort mode, shutdown)."""
    weight_version: int | str
    """The engine's weight version when this sample finished (an int for versions the controller set)."""
    weight_versions: list[tuple[int | str, int, int]] = field(default_factory=list)
    """`(version, start, end)`: response tokens `[start, end)` were sampled with that version (more than one span
    when a weight update landed mid-generation)."""
    loss_mask: list[int] | None = None
    """Per response token, 1 where the policy generated it and 0 where the environment put it (tool responses and
    the chat markup around them, in multi-turn episodes); None = every response token is the policy's."""
    routed_experts: Any = field(default=None, compare=False)
    """With `return_routed_experts`: int32 `[tokens, num_hidden_layers, top_k]` for prompt + response tokens but
    the last (SGLang's layout; -1 in dense layers), else None."""


def top_p_filter(probs: torch.Tensor, top_p: float | torch.Tensor) -> torch.Tensor:
    """Zero every token outside the nucleus: the smallest set of most-likely tokens whose mass reaches `top_p`.

    `probs` is `[B, V]`, `top_p` a float or a `[B, 1]` tensor (one value per row); the result is not renormalised
    (the exponential race in `sample_rows` does not need it). The most likely token is always kept, so `top_p`
    close to 0 gives greedy decoding.
    """
    if not isinstance(top_p, torch.Tensor) and top_p >= 1.0:
        return probs
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)


def sample_rows(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    min_p: torch.Tensor,
    generators: list[torch.Generator],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row of `logits` [B, V], each row with its own sampling settings and generator.

    `temperature`, `top_p`, `min_p` are float [B], `top_k` int [B] (`>= V` or `<= 0` = off). A row with temperature
    < 1e-6 is greedy (argmax, logprob at temperature 1). Otherwise the token is drawn from
    `softmax(logits / temperature)` restricted by top-k, then top-p, then min-p (relative to the most likely token),
    with the row's generator as its only randomness (`inverse_cdf`): a row's draw does not depend on which other
    rows share the batch. Returns `(tokens [B] int64, logprobs [B] float32)` with the logprob defined in the module
    docstring. Raises `NonFiniteLogits` naming the rows whose logits hold NaN or +inf or are all -inf (tokens masked
    to -inf, as min_new_tokens does, are fine).
    """
    logits = logits.float()
    rows, vocab = logits.shape
    # one reduction finds all three cases: a row's max is NaN if any entry is, +inf if any is, -inf if all are
    peak = logits.amax(dim=-1)
    bad = ~torch.isfinite(peak)
    if bool(bad.any()):
        raise NonFiniteLogits(
            f"non-finite logits in rows {bad.nonzero().flatten().tolist()} of {rows} (NaN, +inf, or every token "
            "-inf): the weights or the activations are not finite; no token is sampled from them"
        )
    # below 1e-6 is greedy, as SGLang's _SAMPLING_EPS: logits / 1e-40 overflow to inf and the softmax to NaN
    greedy = temperature < GREEDY_BELOW
    scale = torch.where(greedy, torch.ones_like(temperature), temperature).to(logits)
    if not bool((scale == 1.0).all()):  # at T = 1 (the RL default) skip a [B, V] pass
        logits, peak = logits / scale.unsqueeze(-1), peak / scale  # division by s > 0 keeps the max where it was
    # log_softmax's own steps, kept apart so the sampler reuses the exponentials: weights = exp(x - max) (the most
    # likely token weighs 1), logprob = x - max - log(sum(weights))
    weights = torch.exp(logits - peak.unsqueeze(-1))
    total = weights.sum(dim=-1)
    tokens = torch.zeros(rows, dtype=torch.long, device=logits.device)
    if bool(greedy.any()):
        tokens = torch.where(greedy, logits.argmax(dim=-1), tokens)
    if not bool(greedy.all()):
        probs = weights
        k = torch.where((top_k <= 0) | (top_k >= vocab), torch.full_like(top_k, vocab), top_k)
        if bool((k < vocab).any()):
            kth = probs.sort(dim=-1, descending=True).values.gather(-1, (k - 1).clamp(min=0).unsqueeze(-1))
            probs = probs.masked_fill(probs < kth, 0.0)
        if bool((top_p < 1.0).any()):  # the nucleus: mass of the whole distribution (top-k does not renormalise)
            probs = top_p_filter(probs / total.unsqueeze(-1), top_p.to(probs).unsqueeze(-1))
        if bool((min_p > 0.0).any()):
            floor = min_p.to(probs).unsqueeze(-1) * probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < floor, 0.0)
        tokens = torch.where(greedy, tokens, inverse_cdf(probs, generators))
    chosen = logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - peak - total.log()
    return tokens, chosen


#: tokens per block of `inverse_cdf`'s two-level search
CDF_BLOCK = 256


def inverse_cdf(weights: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """One token per row of `weights` [B, V] (non-negative, not necessarily normalised, every row with some mass),
    drawn with probability proportional to its weight from ONE uniform `u` of the row's generator: the first token
    whose cumulative weight exceeds `u * total`. A token of weight 0 is never drawn (its cumulative weight equals
    its predecessor's, and the comparison is strict). Returns int64 [B] on `weights`' device.

    Two levels, so that no [B, V] prefix sum is needed: sums of blocks of `CDF_BLOCK` tokens (float32 sums of 256
    terms, relative error about 1e-7), their running sum in float64 -> the block holding `u * total` -> a float64
    running sum inside that block. A float32 running sum over the whole vocabulary would drift by up to about 1e-3
    of the mass (49152 terms) and misplace the tail tokens' boundaries; float64 over [B, V] costs a copy and a scan.
    """
    rows, vocab = weights.shape
    if vocab % CDF_BLOCK:  # pad with weight 0: never drawn
        weights = torch.nn.functional.pad(weights, (0, -vocab % CDF_BLOCK))
    blocked = weights.view(rows, -1, CDF_BLOCK)
    block_cdf = blocked.sum(dim=-1).double().cumsum(dim=-1)  # [B, blocks]
    u = torch.cat([torch.rand(1, generator=g, dtype=torch.float64) for g in generators]).to(weights.device)
    target = u * block_cdf[:, -1]
    block = torch.searchsorted(block_cdf, target.unsqueeze(-1), right=True).squeeze(-1)
    # u * total can round up to total (u within an ulp of 1): then the last block with mass, searched to its end
    beyond = block >= block_cdf.shape[-1]
    block = torch.where(beyond, _last_positive(block_cdf.diff(dim=-1, prepend=block_cdf.new_zeros(rows, 1))), block)
    before = torch.where(block > 0, block_cdf.gather(-1, (block - 1).clamp(min=0).unsqueeze(-1)).squeeze(-1), 0.0)
    residual = torch.where(beyond, float("inf"), target - before)
    inside = blocked[torch.arange(rows, device=weights.device), block]  # [B, CDF_BLOCK]
    offset = torch.searchsorted(inside.double().cumsum(dim=-1), residual.unsqueeze(-1), right=True).squeeze(-1)
    # the block's float32 sum and the float64 sum inside it can differ in the last bits: past the end -> the block's
    # last token with weight
    offset = torch.where(offset >= CDF_BLOCK, _last_positive(inside), offset)
    return block * CDF_BLOCK + offset


def _last_positive(values: torch.Tensor) -> torch.Tensor:
    """Index of the last entry > 0 of each row of `values` [B, N]."""
    return values.shape[-1] - 1 - (values.flip(-1) > 0).int().argmax(dim=-1)


def validate_sampling_args(temperature: float, top_p: float, max_new_tokens: int, n: int) -> None:
    """Raise ValueError naming the argument and the accepted range when a sampling argument is out of range."""
    if not 0.0 <= temperature < float("inf"):
        raise ValueError(f"temperature must be a finite number >= 0 (0 means greedy), got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
