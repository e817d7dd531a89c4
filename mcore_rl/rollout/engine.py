"""The embedded rollout engine: a transformers causal LM, continuous-batching generation and HF-named weight loading.

This is the in-process engine for CPU runs, tests and small models (the production engine is SGLang); it has the
same contract the controller relies on: `generate` returns tokens, rollout logprobs and the weight version, and
`update_weights_from_tensors` takes tensors under HF checkpoint names as weight sync produces them.

```
prompts x n -> scheduler.ContinuousBatcher (prefill once per prompt, decode steps, per-sequence RNG) -> Samples
named tensors (HF checkpoint names) -> hf_names.HFNameMap -> view of a parameter -> copy_ in place
```

The HTTP server (`server.py`) runs the same batcher on a thread and speaks SGLang's API over this engine.

Example: `HFRolloutEngine(Qwen3MoeConfig(...)).generate([[1, 2, 3]], n=4, temperature=1.0, max_new_tokens=16)`.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterable, Iterator, Mapping
from types import SimpleNamespace
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from mcore_rl.rollout.hf_names import HFNameMap
from mcore_rl.rollout.sampling import Sample, validate_sampling_args
from mcore_rl.rollout.scheduler import ContinuousBatcher, GenParams, Sequence


def _resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    resolved = getattr(torch, str(dtype), None)
    if not isinstance(resolved, torch.dtype) or not resolved.is_floating_point:
        raise ValueError(f"dtype must be a floating torch dtype or its name (e.g. 'bfloat16'), got {dtype!r}")
    return resolved


def _resolve_device(device: str | torch.device) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(device)!r} was requested but CUDA is not available on this machine")
    return device


def build_causal_lm(
    model: str | os.PathLike[str] | PretrainedConfig | Mapping[str, Any],
    dtype: torch.dtype,
    device: torch.device,
    attn_implementation: str | None = None,
    init_seed: int = 0,
) -> PreTrainedModel:
    """A transformers causal LM from a checkpoint directory (weights loaded) or a config (weights random).

    A config mapping must name its `model_type` (as in `config.json`). Random initialisation uses `init_seed` on a
    forked RNG, so building an engine does not move the caller's global RNG.
    """
    kwargs: dict[str, Any] = {"dtype": dtype, "trust_remote_code": False}  # never a checkpoint's own code
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    if isinstance(model, (str, os.PathLike)):
        return AutoModelForCausalLM.from_pretrained(os.fspath(model), **kwargs).to(device)
    if isinstance(model, Mapping):
        if "model_type" not in model:
            raise ValueError(f"model config mapping needs a 'model_type' key, got keys {sorted(model)}")
        fields = dict(model)
        model = AutoConfig.for_model(fields.pop("model_type"), **fields)
    if not isinstance(model, PretrainedConfig):
        raise ValueError(f"model must be a directory, a PretrainedConfig or a config dict, got {type(model).__name__}")
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(init_seed)
        return AutoModelForCausalLM.from_config(model, **kwargs)


class HFRolloutEngine:
    """A transformers causal LM that samples batches of responses and loads weights by HF checkpoint name.

    Calls are not thread-safe and must be serialised (the Ray actor in `ray_engine.py` does so: one call at a
    time), which is what makes `update_weights_from_tensors` a version fence: no generation is in flight while
    weights change, and every `Sample` carries the version it was generated with.
    """

    def __init__(
        self,
        model: str | os.PathLike[str] | PretrainedConfig | Mapping[str, Any],
        *,
        dtype: torch.dtype | str = torch.float32,
        device: str | torch.device = "cpu",
        attn_implementation: str | None = None,
        init_seed: int = 0,
        latency_model_s_per_token: float | None = None,
    ) -> None:
        """Build from a checkpoint directory (`from_pretrained`), a `PretrainedConfig` or a config dict (random
        weights, seeded by `init_seed`). `dtype` (default float32) and `device` (default CPU) place the model.
        `latency_model_s_per_token`: model a GPU engine instead of running the model (see `forward`)."""
        if latency_model_s_per_token is not None and not latency_model_s_per_token > 0:
            raise ValueError(f"latency_model_s_per_token must be > 0 or None, got {latency_model_s_per_token}")
        #: seconds one forward (a prefill or a decode step of the whole running batch) sleeps in the latency model;
        #: None = the real model runs
        self.latency_model_s_per_token = latency_model_s_per_token
        self.device = _resolve_device(device)
        self.model = build_causal_lm(model, _resolve_dtype(dtype), self.device, attn_implementation, init_seed)
        self.model.eval().requires_grad_(False)
        self.config: PretrainedConfig = self.model.config
        self.name_map = HFNameMap.for_model_type(self.config.model_type)
        # remove_duplicate=False keeps tied aliases (lm_head.weight -> embed_tokens.weight) addressable by name.
        self._params: dict[str, torch.Tensor] = dict(self.model.named_parameters(remove_duplicate=False))
        # Persistent buffers are checkpoint tensors too (DeepSeek-V3's router e_score_correction_bias).
        saved = set(self.model.state_dict())
        self._buffers = {name: b for name, b in self.model.named_buffers() if name in saved}
        self._params.update(self._buffers)
        #: one name per parameter object, the first `named_parameters` gives (tied aliases share their tensor)
        self._param_keys: dict[int, str] = {}
        for name, tensor in self._params.items():
            self._param_keys.setdefault(id(tensor), name)
        #: version of the loaded weights: 0 at construction; set by weight updates (SGLang's are strings)
        self.weight_version: int | str = 0
        self.context_length: int = int(getattr(self.config, "max_position_embeddings", 0) or 4096)
        self._install_routing_hooks()

    @property
    def vocab_size(self) -> int:
        """Rows of the output layer; valid token ids are `[0, vocab_size)`."""
        return self.model.get_output_embeddings().weight.shape[0]

    def forward(self, **inputs: Any) -> Any:
        """The scheduler's prefill or decode forward (`model(**inputs)`: logits and the KV cache).

        In the latency model (`latency_model_s_per_token`, rollout.latency_model_s_per_token) the model does not run:
        the call sleeps that many seconds, as one batched GPU step costs the CPU trainer wall time but no CPU, and
        returns zero logits (every token equally likely: the row's seeded generator draws it uniformly, logprob
        -log V; greedy picks token 0) and an empty KV cache. Everything around the forward (stop tokens, finish
        reasons, weight versions, pause, weight loading) runs as in the real model. Routed experts are not recorded.
        """
        if self.latency_model_s_per_token is None:
            return self.model(**inputs)
        time.sleep(self.latency_model_s_per_token)  # blocks this thread only; the GIL is released
        ids = inputs["input_ids"]
        width = ids.shape[1] if inputs.get("logits_to_keep", 1) == 0 else 1
        cache = inputs.get("past_key_values")
        cache = SimpleNamespace(layers=[]) if cache is None else cache  # no layers: nothing to cache or trim
        logits = torch.zeros(ids.shape[0], width, self.vocab_size, device=self.device)
        return SimpleNamespace(logits=logits, past_key_values=cache)

    def _check_token_ids(self, sequences: list[list[int]], what: str) -> None:
        if not sequences:
            raise ValueError(f"{what} is empty")
        for index, ids in enumerate(sequences):
            if not ids:
                raise ValueError(f"{what}[{index}] is empty")
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"{what}[{index}] has token ids {bad[:5]} outside [0, {self.vocab_size})")

    def generate(
        self,
        prompt_token_ids: list[list[int]],
        n: int = 1,
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_new_tokens: int = 128,
        eos_token_ids: Iterable[int] = (),
        seed: int | None = None,
    ) -> list[Sample]:
        """Sample `n` responses per prompt in-process; returns `len(prompt_token_ids) * n` samples, prompt-major.

        Runs the same continuous batcher the HTTP server runs (`scheduler.py`), on this thread. `temperature == 0`
        decodes greedily. A sequence stops at the first token in `eos_token_ids` (included in its response,
        `finish_reason="stop"`) or after `max_new_tokens` tokens (`"length"`). Sample `j` of prompt `i` is seeded
        with `seed + i * n + j`, so the same `seed` gives the same samples on the same device and dtype; `seed=None`
        draws fresh seeds.
        """
        validate_sampling_args(temperature, top_p, max_new_tokens, n)
        self._check_token_ids(prompt_token_ids, "prompt_token_ids")
        seqs = [
            Sequence(
                f"{i}_{j}",
                list(prompt),
                GenParams(
                    max_new_tokens=max_new_tokens,
                    temperature=temperature,
                    top_p=top_p,
                    seed=None if seed is None else seed + i * n + j,
                ),
            )
            for i, prompt in enumerate(prompt_token_ids)
            for j in range(n)
        ]
        batcher = ContinuousBatcher(self, max_running=len(seqs), eos_token_ids=eos_token_ids)
        return [seq.to_sample() for seq in batcher.run_until_done(seqs)]

    @contextlib.contextmanager
    def capture_routed_experts(self, enabled: bool = True) -> Iterator[torch.Tensor | None]:
        """Record the top-k experts every MoE layer routes each token to during the forwards inside the block.

        Yields a tensor that is filled after the forward: int32 `[batch, seq, num_hidden_layers, top_k]` with -1
        in dense layers (SGLang's `routed_experts` layout), or None when disabled or the model has no MoE layer.
        """
        if not enabled or not self._moe_gates or self.latency_model_s_per_token is not None:
            yield None
            return
        captured: dict[int, torch.Tensor] = {}
        self._capture = captured
        holder = torch.empty(0, dtype=torch.int32)
        try:
            yield holder
        finally:
            self._capture = None
        if captured:
            top_k = next(iter(captured.values())).shape[-1]
            tokens = next(iter(captured.values())).shape[0]
            full = torch.full((tokens, self.config.num_hidden_layers, top_k), -1, dtype=torch.int32)
            for layer, indices in captured.items():
                full[:, layer] = indices.to(torch.int32).cpu()
            holder.set_(full.view(self._capture_shape[0], self._capture_shape[1], *full.shape[1:]))

    def _install_routing_hooks(self) -> None:
        """Forward hooks on each MoE layer's router (`mlp.gate`, returning `(logits, weights, top-k indices)` in
        transformers 5 for Qwen2/3-MoE and DeepSeek-V3)."""
        self._moe_gates: list[int] = []
        self._capture: dict[int, torch.Tensor] | None = None
        self._capture_shape = (0, 0)
        layers = getattr(getattr(self.model, "model", None), "layers", [])
        for index, layer in enumerate(layers):
            gate = getattr(getattr(layer, "mlp", None), "gate", None)
            if gate is None or isinstance(gate, torch.nn.Linear):
                continue
            gate.register_forward_hook(self._routing_hook(index))
            self._moe_gates.append(index)
        if self._moe_gates:
            self.model.register_forward_pre_hook(self._remember_shape, with_kwargs=True)

    def _remember_shape(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None:
            self._capture_shape = tuple(ids.shape[:2])

    def _routing_hook(self, layer: int):  # noqa: ANN202
        def hook(module: torch.nn.Module, args: tuple, output: Any) -> None:
            if self._capture is not None and isinstance(output, tuple) and len(output) == 3:
                self._capture[layer] = output[2].detach().reshape(-1, output[2].shape[-1])

        return hook

    @torch.inference_mode()
    def logprobs(
        self, sequences: list[list[int]], prompt_lens: list[int], temperature: float = 1.0
    ) -> list[torch.Tensor]:
        """Teacher-forced `log_softmax(logits / temperature)` of each response token (float32, CPU).

        `sequences[i]` is prompt + response and its first `prompt_lens[i]` tokens are the prompt; the result for it
        has `len(sequences[i]) - prompt_lens[i]` entries. Rows are right-padded, so positions are plain offsets.
        """
        self._check_token_ids(sequences, "sequences")
        if len(prompt_lens) != len(sequences):
            raise ValueError(f"prompt_lens has {len(prompt_lens)} entries for {len(sequences)} sequences")
        for index, (seq, prompt_len) in enumerate(zip(sequences, prompt_lens)):
            if not 1 <= prompt_len <= len(seq):
                raise ValueError(f"prompt_lens[{index}] = {prompt_len} must be in [1, {len(seq)}]")
        if not temperature > 0.0:
            raise ValueError(f"temperature must be > 0 for logprobs, got {temperature}")
        batch, width = len(sequences), max(len(s) for s in sequences)
        input_ids = torch.zeros(batch, width, dtype=torch.long, device=self.device)
        attention_mask = torch.zeros(batch, width, dtype=torch.long, device=self.device)
        for row, seq in enumerate(sequences):
            input_ids[row, : len(seq)] = torch.tensor(seq, device=self.device)
            attention_mask[row, : len(seq)] = 1
        logits = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
        result = []
        for row, (seq, prompt_len) in enumerate(zip(sequences, prompt_lens)):
            # Logits at position t predict token t + 1.
            step_logits = logits[row, prompt_len - 1 : len(seq) - 1].float() / temperature
            targets = input_ids[row, prompt_len : len(seq)]
            chosen = torch.log_softmax(step_logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
            result.append(chosen.cpu())
        return result

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy tensors given under HF checkpoint names into the model's parameters, in place.

        Tensors may come in any order and spread over several calls; each is cast to the parameter's dtype and
        device as it is copied, so memory grows by at most one tensor, never by a model copy. Raises ValueError
        naming the tensor, its shape and the expected shape for an unknown name or a shape mismatch; tensors
        before the bad one stay loaded (the weight version does not advance, see `update_weights_from_tensors`).
        """
        for name, tensor in named_tensors:
            view = self.target_view(name, tensor)
            if view is not None:
                view.copy_(tensor)

    def target_view(self, name: str, tensor: torch.Tensor) -> torch.Tensor | None:
        """The parameter view that checkpoint tensor `name` is loaded into; None for MTP layers, which this engine
        (like SGLang without speculative decoding) skips. ValueError naming the tensor for an unknown name or shape."""
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"tensor {name!r} is a {type(tensor).__name__}, expected a torch.Tensor")
        mtp_layers = getattr(self.config, "num_nextn_predict_layers", 0) or 0
        if mtp_layers and HFNameMap.is_mtp_layer(name, self.config.num_hidden_layers, mtp_layers):
            return None
        return self.name_map.target_view(self._params, name, tuple(tensor.shape))

    def param_key(self, name: str) -> str:
        """The name of the parameter (or persistent buffer) that checkpoint tensor `name` is written into, one name
        per tensor object (tied aliases answer alike): `parameter(param_key(name))` holds `target_view(name, ...)`.
        Call after `target_view` has accepted the name."""
        return self._param_keys[id(self._params[self.name_map.param_name(name)])]

    def parameter(self, key: str) -> torch.Tensor:
        """The parameter or persistent buffer named `key` (a `param_key`)."""
        return self._params[key]

    def update_weights_from_tensors(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], weight_version: int | None = None
    ) -> int:
        """Load `named_tensors` (see `load_weights`), then advance the weight version; returns the new version.

        `weight_version` sets the version explicitly (it must increase); `None` adds 1. This engine keeps no KV or
        prefix cache between calls (the cache lives inside one `generate` call), so there is nothing to flush, and
        since calls are serialised no generation can observe half-loaded weights.
        """
        current = self.weight_version if isinstance(self.weight_version, int) else 0
        if weight_version is not None and weight_version <= current:
            raise ValueError(f"weight_version must increase: got {weight_version}, engine is at {current}")
        self.load_weights(named_tensors)
        self.weight_version = current + 1 if weight_version is None else weight_version
        return self.weight_version

    def state_dict_hf(self) -> dict[str, torch.Tensor]:
        """All weights under HF checkpoint names (experts split per expert): the inverse of `load_weights`.

        Values are views of the live parameters (no copy); clone them to keep a snapshot. Tied weights appear once,
        under the name `save_pretrained` keeps (the embedding).
        """
        result: dict[str, torch.Tensor] = {}
        for param_name, param in [*self.model.named_parameters(), *self._buffers.items()]:
            result.update(self.name_map.checkpoint_items(param_name, param.detach()))
        return result
