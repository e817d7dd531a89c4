"""Megatron layer specs for the two runtimes.

- cuda: Transformer Engine's spec when TE imports (fused norms inside linear layers, grouped GEMM experts);
  otherwise Megatron's local spec, as on CPU.
- cpu:  Megatron's local spec with `SequenceParallelRMSNorm` in place of the torch norm. The local spec's
  `WrappedTorchNorm` refuses sequence parallelism, which Megatron requires for MoE with TP > 1 (megatron-core 0.16.1),
  so without this swap MoE+TP cannot run on CPU.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any

import torch


class SequenceParallelRMSNorm(torch.nn.Module):
    """RMSNorm computed in fp32 (as HF's Qwen/Llama norms are), usable under sequence parallelism.

    Under sequence parallelism each TP rank normalises a different slice of the sequence, so the weight's gradient is
    partial per rank: marking the weight `sequence_parallel` makes Megatron's finalize_model_grads all-reduce it
    across the TP group.
    """

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-6, **_: Any) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = bool(config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


def transformer_engine_available() -> bool:
    """Whether Transformer Engine's torch extension can be imported (GPU extra)."""
    return importlib.util.find_spec("transformer_engine") is not None


def te_in_use(runtime: str) -> bool:
    """Whether this run uses Transformer Engine: on CUDA when TE is importable. The one predicate that decides the
    layer spec and every TE-only setting of the config builders (fusions, grouped GEMM experts, MLA's replicated
    latent projections); without TE a CUDA run builds Megatron's local spec, as on CPU."""
    return runtime == "cuda" and transformer_engine_available()


def _swap_norms(spec: Any, old: tuple[type, ...], new: type, seen: set[int] | None = None) -> Any:
    """Replace norm classes anywhere inside a (nested) ModuleSpec / submodules dataclass, in place."""
    seen = set() if seen is None else seen
    if id(spec) in seen:
        return spec
    seen.add(id(spec))
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        for f in dataclasses.fields(spec):
            value = getattr(spec, f.name)
            if isinstance(value, type) and value in old:
                setattr(spec, f.name, new)
            elif isinstance(value, list):
                setattr(spec, f.name, [_swap_norms(v, old, new, seen) for v in value])
            else:
                _swap_norms(value, old, new, seen)
    return spec


def decoder_block_spec(config: Any, runtime: str, vp_stage: int | None = None, pp_rank: int | None = None) -> Any:
    """The decoder block spec for this stage (dense and MoE layers as config.moe_layer_freq says)."""
    import copy

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    te = te_in_use(runtime)
    spec = get_gpt_decoder_block_spec(
        config, use_transformer_engine=te, normalization=config.normalization, vp_stage=vp_stage, pp_rank=pp_rank
    )
    if te:
        return spec
    # Specs are shared module-level objects in Megatron: copy before editing.
    spec = copy.deepcopy(spec)
    if getattr(config, "multi_latent_attention", False):
        import megatron.core.transformer.multi_latent_attention as mla
        from megatron.core.transformer.dot_product_attention import DotProductAttention

        _swap_norms(spec, (DotProductAttention,), local_mla_core_attention())
        if not transformer_engine_available():
            # 0.16.1 binds TELinear to a MagicMock when TE is absent yet sets HAVE_TE, and MLA's __init__ then calls
            # isinstance(linear_proj, <MagicMock>), which raises. Without TE no module can be a TELinear.
            mla.HAVE_TE = False
    return _swap_norms(spec, (WrappedTorchNorm, torch.nn.RMSNorm), SequenceParallelRMSNorm)


def local_mla_core_attention() -> type:
    """Megatron's local DotProductAttention, accepting the k/v head sizes MLA passes (megatron-core 0.16.1).

    MLA builds its core attention with k_channels / v_channels, which only TE's attention accepts; the local class's
    math (baddbmm with the given softmax scale, softmax, bmm) already handles q/k and v head sizes that differ, and
    its output reshape uses kv_channels, which the DeepSeek family sets to v_head_dim.
    """
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class LocalMLACoreAttention(DotProductAttention):
        def __init__(self, *args: Any, k_channels: int | None = None, v_channels: int | None = None, **kw: Any):
            super().__init__(*args, **kw)

    return LocalMLACoreAttention


def mtp_block_spec(
    config: Any, block_spec: Any, runtime: str, vp_stage: int | None = None, pp_rank: int | None = None
) -> Any:
    """The multi-token-prediction block spec of this stage: None without MTP layers or off the last stage.

    Megatron builds each MTP layer around the decoder's last layer spec plus its own norms (enorm, hnorm, final),
    which get the same norm swap as the decoder on CPU.
    """
    if not getattr(config, "mtp_num_layers", None):
        return None
    import copy

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    te = te_in_use(runtime)
    spec = get_gpt_mtp_block_spec(config, block_spec, use_transformer_engine=te, vp_stage=vp_stage, pp_rank=pp_rank)
    if spec is None or te:
        return spec
    return _swap_norms(copy.deepcopy(spec), (WrappedTorchNorm, torch.nn.RMSNorm), SequenceParallelRMSNorm)
