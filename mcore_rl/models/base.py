"""What every model family provides, the registry keyed by HF `model_type`, and HF-config reading helpers.

A family is one file in mcore_rl/models/ holding all knowledge of one architecture: HF config -> Megatron
`TransformerConfig` (built in exactly one place) and the declarative HF <-> Megatron weight map. The registry is keyed
by the HF `model_type` string, never by substring matching of names.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from mcore_rl.models.spec import te_in_use
from mcore_rl.parallel.layout import ModelShape, ParallelLayout
from mcore_rl.resharding.sync.plan import ReceiveTogether, ShardRule
from mcore_rl.resharding.weight_map import WeightMap

if TYPE_CHECKING:  # models/rope.py reads configs with HFConfig from here
    from mcore_rl.models.rope import RopeScaling


class UnsupportedModel(ValueError):
    """Unknown model_type, or an HF config setting with no Megatron equivalent."""


class HFConfig:
    """Read access to an HF config.json dict with errors that name the field."""

    def __init__(self, raw: Mapping[str, Any] | Any) -> None:
        if hasattr(raw, "to_dict"):
            raw = raw.to_dict()
        self.raw = dict(raw)
        self.model_type = self.raw.get("model_type", "<missing>")

    def req(self, *names: str) -> Any:
        """The first present field among `names` (aliases), or UnsupportedModel naming the field."""
        for name in names:
            if self.raw.get(name) is not None:
                return self.raw[name]
        raise UnsupportedModel(f"{self.model_type} config.json: required field {' / '.join(names)!r} is missing")

    def get(self, name: str, default: Any = None) -> Any:
        value = self.raw.get(name)
        return default if value is None else value

    def refuse_unless(self, name: str, allowed: Any, why: str) -> None:
        """Refuse a setting Megatron cannot reproduce (instead of silently dropping it)."""
        value = self.raw.get(name)
        ok = value in allowed if isinstance(allowed, (list, tuple, set)) else value == allowed
        if value is not None and not ok:
            raise UnsupportedModel(f"{self.model_type} config.json: {name}={value!r} is not supported ({why})")


#: How SGLang's loaders shard each HF tensor across an engine's ranks (first match wins; the rest is replicated):
#: what a shard-aware weight sync sends each engine rank. MLP, MoE and vocabulary rules are common to every family;
#: attention differs (GQA here, MLA in deepseek_v3.py).
MLP_ENGINE_SHARDS: tuple[ShardRule, ...] = (
    ShardRule(r"\.experts\.\d+\.(gate_proj|up_proj)\.", "expert", 0),
    ShardRule(r"\.experts\.\d+\.down_proj\.", "expert", 1),
    ShardRule(r"\.(shared_experts?\.)?(gate_proj|up_proj)\.", "dense", 0),
    ShardRule(r"\.(shared_experts?\.)?down_proj\.", "dense", 1),
    ShardRule(r"(embed_tokens|lm_head|shared_head\.head)\.weight$", "vocab", 0),
)
GQA_ENGINE_SHARDS: tuple[ShardRule, ...] = (
    ShardRule(r"\.self_attn\.q_proj\.", "attn", 0),
    ShardRule(r"\.self_attn\.(k_proj|v_proj)\.", "kv", 0),
    ShardRule(r"\.self_attn\.o_proj\.", "attn", 1),
    *MLP_ENGINE_SHARDS,
)


#: The tensors FP8 releases (DeepSeek-V3, Qwen3 FP8) quantise blockwise (128x128 e4m3 + weight_scale_inv): attention
#: and MLP projections, shared and routed experts included; embeddings, lm_head, norms, the router and MTP's eh_proj
#: stay in the model dtype. Used by checkpoint conversion (--fp8), the FP8 parity gate and weight sync (sync.fp8).
FP8_PROJECTIONS = (
    "q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj",
    "gate_proj", "up_proj", "down_proj",
)  # fmt: skip
FP8_TARGETS = re.compile(r"^model\.layers\.\d+\.(self_attn|mlp)\.(.+\.)?(" + "|".join(FP8_PROJECTIONS) + r")\.weight$")


class ModelFamily:
    """Base class of a family; subclasses set `model_type` and implement the three methods."""

    model_type: str = ""
    #: architectures name written into exported config.json
    architecture: str = ""
    #: engine-side sharding of HF tensors (see GQA_ENGINE_SHARDS)
    engine_shards: tuple[ShardRule, ...] = GQA_ENGINE_SHARDS
    #: HF tensors an engine must receive in one bucket (resharding/sync/plan.py ReceiveTogether); none by default
    engine_receive_together: tuple[ReceiveTogether, ...] = ()
    #: HF tensors that are FP8 (blockwise) in FP8 releases and FP8 weight syncs
    fp8_targets: re.Pattern = FP8_TARGETS

    def shape(self, hf: HFConfig) -> ModelShape:
        """The sizes a parallel layout must divide."""
        raise NotImplementedError

    def transformer_config(
        self, hf: HFConfig, layout: ParallelLayout, runtime: str, dtype: torch.dtype, **overrides: Any
    ) -> Any:
        """The Megatron TransformerConfig (the single place it is built for this family)."""
        raise NotImplementedError

    def weight_map(self, hf: HFConfig, padded_vocab: int) -> WeightMap:
        """The HF <-> Megatron weight map for this config (tied embeddings, dense/MoE layers...)."""
        raise NotImplementedError

    def rope(self, hf: HFConfig) -> RopeScaling:
        """The checkpoint's RoPE as this family reproduces it (models/rope.py `read_rope` with the rope types the
        family supports); UnsupportedModel for the rest. The builder asks it for GPTModel's rotary arguments."""
        raise NotImplementedError

    def resolve_mtp(
        self, config: dict[str, Any], names: set[str], mode: str
    ) -> tuple[dict[str, Any], str | None, tuple[str, ...]]:
        """(config to build from a checkpoint holding tensors `names`, a line to print when it differs from
        config.json, HF name prefixes left unread). Families with multi-token-prediction layers decide here whether
        those layers are on (`mode`: on | off | auto); the rest have none to decide."""
        return config, None, ()


_REGISTRY: dict[str, ModelFamily] = {}


def register(family: type[ModelFamily]) -> type[ModelFamily]:
    """Class decorator: add a family to the registry under its HF model_type."""
    if not family.model_type:
        raise ValueError(f"{family.__name__} has no model_type")
    _REGISTRY[family.model_type] = family()
    return family


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Megatron's padded vocabulary: the next multiple of divisible_by x tp."""
    multiple = divisible_by * tp
    return ((vocab_size + multiple - 1) // multiple) * multiple


def megatron_common_fields(layout: ParallelLayout, dtype: torch.dtype, runtime: str) -> dict[str, Any]:
    """TransformerConfig fields shared by every family: the layout, dtypes and which fusions the runtime has
    (TE's: `te_in_use`, the predicate the layer spec reads too)."""
    te = te_in_use(runtime)
    return dict(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp if layout.virtual_stages > 1 else None,
        # Uneven pipeline stages (None = even): Megatron's layer offsets and block sizes read these two fields.
        num_layers_in_first_pipeline_stage=layout.first_stage_layers,
        num_layers_in_last_pipeline_stage=layout.last_stage_layers,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.expert_tp,
        sequence_parallel=layout.sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        # RL batches change length every step. With alltoall (CUDA) pipeline stages exchange shapes; the allgather
        # dispatcher (CPU) refuses that in 0.16.1, so there every micro-batch of one schedule call is padded to one
        # length instead (the actor does this either way).
        variable_seq_lengths=runtime == "cuda",
        # Fusions need TE (rope, persistent norm) or CUDA extensions built with it (masked softmax); the plain torch
        # paths compute the same math. Without TE, 0.16.1 refuses apply_rope_fusion in TransformerConfig and imports
        # a missing extension for masked_softmax_fusion at the first forward.
        bias_activation_fusion=te,
        bias_dropout_fusion=te,
        masked_softmax_fusion=te,
        persist_layer_norm=te,
        apply_rope_fusion=te,
        gradient_accumulation_fusion=False,
        # The local core attention takes its softmax in the model dtype unless told otherwise; transformers' eager
        # attention, SGLang's and TE's kernels take it in fp32. No effect on fp32 models.
        attention_softmax_in_fp32=True,
    )


def gqa_transformer_config(
    hf: HFConfig,
    layout: ParallelLayout,
    runtime: str,
    dtype: torch.dtype,
    *,
    qk_layernorm: bool,
    add_qkv_bias: bool,
    overrides: dict[str, Any],
    rope: RopeScaling,
    moe_fields: dict[str, Any] | None = None,
) -> Any:
    """The Megatron TransformerConfig of a GQA SwiGLU decoder: Llama / Qwen2 / Qwen3 differ only in the flags, and
    Qwen3-MoE adds its router and expert fields (`moe_fields`). `rope` (the family's `rope(hf)`) sets what the
    config carries of the rotary embedding: whether TE's fused rope can run it, and yarn's attributes."""
    from megatron.core.transformer import TransformerConfig

    hf.refuse_unless("hidden_act", "silu", "Megatron's SwiGLU here uses silu")
    hf.refuse_unless("mlp_bias", False, "Megatron adds MLP biases only together with attention output biases")
    hf.refuse_unless("pretraining_tp", (1, None), "pretraining_tp slices matmuls; it is an HF-only numerics switch")
    heads = hf.req("num_attention_heads")
    kwargs: dict[str, Any] = dict(
        num_layers=hf.req("num_hidden_layers"),
        hidden_size=hf.req("hidden_size"),
        num_attention_heads=heads,
        num_query_groups=hf.get("num_key_value_heads", heads),
        kv_channels=hf.get("head_dim", hf.req("hidden_size") // heads),
        ffn_hidden_size=hf.req("intermediate_size"),
        normalization="RMSNorm",
        layernorm_epsilon=hf.get("rms_norm_eps", 1e-6),
        qk_layernorm=qk_layernorm,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=add_qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=float(hf.get("attention_dropout", 0.0)),
        init_method_std=hf.get("initializer_range", 0.02),
        **megatron_common_fields(layout, dtype, runtime),
        **(moe_fields or {}),
    )
    kwargs["apply_rope_fusion"] = kwargs["apply_rope_fusion"] and rope.fusion_allowed()
    kwargs.update(overrides)
    try:
        config = TransformerConfig(**kwargs)
    except (AssertionError, ValueError) as err:
        raise UnsupportedModel(f"{hf.model_type}: Megatron refused the translated config: {err}") from err
    for name, value in rope.config_attributes().items():
        setattr(config, name, value)
    return config


def moe_backend_fields(runtime: str) -> dict[str, Any]:
    """How MoE layers dispatch tokens and run experts: the alltoall dispatcher on CUDA (it creates a CUDA stream at
    init in 0.16.1, so allgather on CPU); grouped GEMM experts only with TE (the local spec's grouped GEMM is the
    legacy GroupedMLP, which needs the grouped_gemm package: "Grouped GEMM is not available")."""
    return dict(
        moe_token_dispatcher_type="alltoall" if runtime == "cuda" else "allgather",
        moe_grouped_gemm=te_in_use(runtime),
    )
