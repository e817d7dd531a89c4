"""HF checkpoint names <-> the in-memory parameters of a transformers model, per HF `model_type`.

Weight sync sends tensors under their HF *checkpoint* names (the names in a model's safetensors files, and what
SGLang's loaders expect). transformers 5 keeps some families in a different in-memory layout; for the MoE families
here the per-expert 2D weights are fused into one 3D parameter per layer:

```
checkpoint                                              in memory (transformers 5.x)
{p}.experts.{e}.gate_proj.weight  [I, H]   ->  {p}.experts.gate_up_proj  [E, 2I, H]   rows [0, I)  of expert e
{p}.experts.{e}.up_proj.weight    [I, H]   ->  {p}.experts.gate_up_proj  [E, 2I, H]   rows [I, 2I) of expert e
{p}.experts.{e}.down_proj.weight  [H, I]   ->  {p}.experts.down_proj     [E, H, I]    expert e
```

This is the same conversion transformers applies in `from_pretrained` (`conversion_mapping.py`, entry "qwen2_moe",
which "qwen3_moe" aliases: `MergeModulelist(dim=0)` then `Concatenate(dim=1)`); the logits-parity test loads a
real `save_pretrained` file through this table. Every other name (attention, norms, router `mlp.gate.weight`,
embeddings, `lm_head`) is 1:1, so dense families need an empty rule list. Families are looked up by `model_type`,
never by matching substrings of a model name.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class FusedExpertRule:
    """One per-expert checkpoint tensor that lives inside a fused `[num_experts, ...]` parameter.

    Templates use `{prefix}` (the module path up to the MoE block, e.g. `model.layers.3.mlp`) and, in the checkpoint
    template only, `{expert}` (the global expert id). The piece occupies chunk `chunk` of `num_chunks` equal chunks
    along dim 0 of the expert's 2D slice (dim 1 of the fused parameter).
    """

    checkpoint: str
    """Checkpoint name template, e.g. `{prefix}.experts.{expert}.gate_proj.weight`."""
    param: str
    """In-memory parameter name template, e.g. `{prefix}.experts.gate_up_proj`."""
    chunk: int = 0
    """Index of this piece among the pieces concatenated along dim 1 of the fused parameter."""
    num_chunks: int = 1
    """How many pieces are concatenated along dim 1 (2 for gate|up, 1 for down)."""
    checkpoint_regex: re.Pattern[str] = field(init=False, repr=False, compare=False)
    param_regex: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not 0 <= self.chunk < self.num_chunks:
            raise ValueError(f"FusedExpertRule.chunk must be in [0, {self.num_chunks}), got {self.chunk}")
        object.__setattr__(self, "checkpoint_regex", _template_regex(self.checkpoint))
        object.__setattr__(self, "param_regex", _template_regex(self.param))


def _template_regex(template: str) -> re.Pattern[str]:
    """Compile `{prefix}.experts.{expert}.x` into an anchored regex with named groups."""
    pattern = re.escape(template)
    pattern = pattern.replace(re.escape("{prefix}"), r"(?P<prefix>.+)")
    pattern = pattern.replace(re.escape("{expert}"), r"(?P<expert>\d+)")
    return re.compile(f"^{pattern}$")


# transformers' "qwen2_moe" conversion (gate and up concatenated in that order; down stacked). The `experts.{e}`
# pattern does not match Qwen2-MoE's `mlp.shared_expert.*`, which stays 1:1.
_STACKED_GATE_UP_DOWN = (
    FusedExpertRule("{prefix}.experts.{expert}.gate_proj.weight", "{prefix}.experts.gate_up_proj", 0, 2),
    FusedExpertRule("{prefix}.experts.{expert}.up_proj.weight", "{prefix}.experts.gate_up_proj", 1, 2),
    FusedExpertRule("{prefix}.experts.{expert}.down_proj.weight", "{prefix}.experts.down_proj", 0, 1),
)

HF_NAME_RULES: dict[str, tuple[FusedExpertRule, ...]] = {
    # Dense families: checkpoint names equal parameter names.
    "llama": (),
    "mistral": (),
    "qwen2": (),
    "qwen3": (),
    # MoE families with fused in-memory experts (transformers >= 5).
    "qwen2_moe": _STACKED_GATE_UP_DOWN,
    "qwen3_moe": _STACKED_GATE_UP_DOWN,
    # DeepSeek-V3's routed experts are fused the same way; the router's `e_score_correction_bias` is a persistent
    # buffer (loaded like a parameter), and shared experts stay 1:1.
    "deepseek_v3": _STACKED_GATE_UP_DOWN,
}
"""Name-translation rules keyed by HF `model_type`. Adding a dense family is one line with an empty tuple."""


@dataclass(frozen=True)
class HFNameMap:
    """Translates HF checkpoint names to views of a model's parameters and back, for one `model_type`."""

    model_type: str
    rules: tuple[FusedExpertRule, ...]

    @staticmethod
    def is_mtp_layer(hf_name: str, num_hidden_layers: int, num_mtp_layers: int) -> bool:
        """True for a tensor of a multi-token-prediction layer (`model.layers.{i}`, num_hidden_layers <= i <
        num_hidden_layers + num_mtp_layers): transformers builds no such layer, and SGLang's loaders skip them
        unless speculative decoding is on."""
        match = _LAYER_INDEX.match(hf_name)
        return match is not None and num_hidden_layers <= int(match[1]) < num_hidden_layers + num_mtp_layers

    @classmethod
    def for_model_type(cls, model_type: str) -> HFNameMap:
        """The map registered for `model_type`; raises ValueError naming the known types if there is none."""
        if model_type not in HF_NAME_RULES:
            raise ValueError(
                f"no HF name map for model_type {model_type!r}; known: {sorted(HF_NAME_RULES)} "
                "(add an entry to mcore_rl.rollout.hf_names.HF_NAME_RULES)"
            )
        return cls(model_type, HF_NAME_RULES[model_type])

    def _fused_rule(self, hf_name: str) -> tuple[FusedExpertRule, re.Match[str]] | tuple[None, None]:
        for rule in self.rules:
            match = rule.checkpoint_regex.match(hf_name)
            if match is not None:
                return rule, match
        return None, None

    def param_name(self, hf_name: str) -> str:
        """The in-memory parameter that checkpoint tensor `hf_name` is part of (itself for a 1:1 name)."""
        rule, match = self._fused_rule(hf_name)
        return hf_name if rule is None else rule.param.format(prefix=match["prefix"])

    def target_view(self, params: Mapping[str, torch.Tensor], hf_name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The view of a parameter in `params` that the checkpoint tensor `hf_name` (of `shape`) is written into.

        Raises ValueError naming the tensor, its shape and the expected shape when the name is unknown or the
        shapes differ. The view aliases the parameter's storage, so writing it allocates nothing.
        """
        rule, match = self._fused_rule(hf_name)
        if rule is not None:
            param_name = rule.param.format(prefix=match["prefix"])
            fused = params.get(param_name)
            if fused is None:
                raise ValueError(f"unknown tensor {hf_name!r} (shape {list(shape)}): no parameter {param_name!r}")
            expert = int(match["expert"])
            if expert >= fused.shape[0]:
                raise ValueError(
                    f"tensor {hf_name!r} (shape {list(shape)}): expert {expert} out of range, "
                    f"{param_name!r} holds {fused.shape[0]} experts (shape {list(fused.shape)})"
                )
            view = _chunk(fused[expert], rule)
        else:
            fused_rule = next((rule for rule in self.rules if rule.param_regex.match(hf_name)), None)
            if fused_rule is not None:
                # The in-memory fused name is a parameter, but not a checkpoint name: accepting it would let a sync
                # that sends transformers' state_dict() names pass here and fail in SGLang.
                raise ValueError(
                    f"tensor {hf_name!r} (shape {list(shape)}) is transformers' in-memory fused name; send per-expert "
                    f"checkpoint names such as {fused_rule.checkpoint!r}"
                )
            view = params.get(hf_name)
            if view is None:
                raise ValueError(
                    f"unknown tensor {hf_name!r} (shape {list(shape)}): the {self.model_type} model has no such "
                    "parameter (expected HF checkpoint names, e.g. 'model.layers.0.self_attn.q_proj.weight')"
                )
        if tuple(view.shape) != tuple(shape):
            raise ValueError(f"tensor {hf_name!r} has shape {list(shape)}, expected {list(view.shape)}")
        return view

    def checkpoint_items(self, param_name: str, param: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """The (checkpoint name, view) pairs that make up parameter `param_name`: the inverse of `target_view`."""
        fused_rules = [(rule, rule.param_regex.match(param_name)) for rule in self.rules]
        fused_rules = [(rule, match) for rule, match in fused_rules if match is not None]
        if not fused_rules:
            yield param_name, param
            return
        # Expert-major order, then gate before up: the order save_pretrained writes (after sorting by name).
        for expert in range(param.shape[0]):
            for rule, match in sorted(fused_rules, key=lambda item: item[0].chunk):
                yield rule.checkpoint.format(prefix=match["prefix"], expert=expert), _chunk(param[expert], rule)


_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")


def _chunk(expert_weight: torch.Tensor, rule: FusedExpertRule) -> torch.Tensor:
    """Rows `[chunk * k, (chunk + 1) * k)` of one expert's 2D weight, with `k = rows / num_chunks`."""
    rows = expert_weight.shape[0] // rule.num_chunks
    return expert_weight.narrow(0, rule.chunk * rows, rows)
