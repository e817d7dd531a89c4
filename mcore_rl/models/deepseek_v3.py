"""DeepSeek-V3 / R1 (HF model_type "deepseek_v3"): MLA attention, sigmoid-routed MoE with shared experts, MTP layers.

Config translation (HF config.json -> Megatron `MLATransformerConfig`, built only in `transformer_config` below):

    q_lora_rank / kv_lora_rank           -> q_lora_rank / kv_lora_rank (q_lora_rank null: plain linear_q_proj)
    qk_nope_head_dim / qk_rope_head_dim  -> qk_head_dim / qk_pos_emb_head_dim;  v_head_dim -> v_head_dim
    rope (default) / yarn rope_scaling   -> rope_type "rope" / "yarn" with factor, original_max_position_embeddings,
                                            beta_fast, beta_slow, mscale, mscale_all_dim (see `rope_fields`)
    first_k_dense_replace                -> moe_layer_freq = [0] * k + [1] * (num_layers - k)
    n_shared_experts x moe_intermediate  -> moe_shared_expert_intermediate_size
    sigmoid scores + e_score_correction_bias -> moe_router_score_function="sigmoid", moe_router_enable_expert_bias
                                            (the bias is the router's `expert_bias` *buffer*; the weight map loads it)
    n_group / topk_group                 -> moe_router_num_groups / moe_router_group_topk
    routed_scaling_factor                -> moe_router_topk_scaling_factor
    num_nextn_predict_layers             -> mtp_num_layers (HF stores MTP layer i as model.layers.{L + i}.*)

Exactness, checked by tests/test_families_moe.py against transformers 5.23's DeepseekV3ForCausalLM:
- RoPE: DeepSeek's checkpoints lay rotary dims out in interleaved pairs (rope_interleave=True); Megatron's MLA
  de-interleaves (x[0::2], x[1::2]) before rotate-half, which is the same rotation and output layout as transformers'
  `apply_rotary_pos_emb_interleave`. With rope_interleave=False the rope rows of q_b_proj / kv_a_proj_with_mqa are
  permuted on load (and back on export) so Megatron's de-interleave sees the pairs HF's rotate-half uses.
- YaRN: same inv_freq formula, correction range rounded to integers (HF `truncate`, default true), cos/sin scaled by
  mscale(factor, mscale) / mscale(factor, mscale_all_dim), softmax scale by mscale(factor, mscale_all_dim)^2.
- Group-limited routing: HF scores a group by the sum of its top-2 experts; Megatron by its top (topk / topk_group),
  so configs where topk / topk_group != 2 are refused (DeepSeek-V3: 8 / 4 = 2).
- Megatron always renormalises sigmoid top-k weights: norm_topk_prob=false (with topk > 1) is refused.
- MTP: Megatron feeds the decoder's *final-normed* hidden state to hnorm, as transformers' MTP drafting does.
  The MTP layer shares the main embedding and output head; DeepSeek's checkpoints repeat them as
  model.layers.{L + i}.embed_tokens / shared_head.head, which are exported as copies and not read on import.

Refused (no Megatron equivalent): scoring_func other than sigmoid, topk_method other than noaux_tc, moe_layer_freq
other than 1, attention_bias, non-silu activations, rope types other than default/yarn, yarn truncate=false or an
explicit attention_factor that disagrees with mscale/mscale_all_dim. Training-only fields (aux_loss_alpha, seq_aux,
ep_size) do not change the forward pass and are not translated.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from mcore_rl.models.base import (
    MLP_ENGINE_SHARDS,
    HFConfig,
    ModelFamily,
    UnsupportedModel,
    megatron_common_fields,
    moe_backend_fields,
    register,
)
from mcore_rl.models.rope import RopeScaling, read_rope
from mcore_rl.models.rules import dense_mlp_rules, embedding_rules, expert_rules
from mcore_rl.models.spec import te_in_use
from mcore_rl.parallel.layout import LayoutError, ModelShape, ParallelLayout
from mcore_rl.resharding.sync.plan import ReceiveTogether, ShardRule
from mcore_rl.resharding.transforms import FusedColumns, Replicated, Split, Transform
from mcore_rl.resharding.weight_map import Rule, WeightMap

L = "decoder.layers.{layer}."
H = "model.layers.{layer}."


@dataclass
class LatentDownProj(Split):
    """MLA's q/kv down projections: column-parallel in Megatron's local spec, replicated (TELinear) in TE's.

    The local tensor's row count tells which: the full `rows` means replicated on this rank.
    """

    rows: int = 0

    def axis_for(self, local_shape: torch.Size) -> str | None:
        return None if local_shape[0] == self.rows else "tp"


@dataclass
class RowPermuted(Transform):
    """Permute HF rows before `inner` (and back after it on export): rope dims of non-interleaved checkpoints."""

    inner: Transform = field(default_factory=Replicated)
    perm: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        self.axis = self.inner.axis
        self._perm = torch.tensor(self.perm)
        self._inverse = torch.argsort(self._perm)

    def axis_for(self, local_shape: torch.Size) -> str | None:
        return self.inner.axis_for(local_shape)

    def to_megatron(self, hf, shard, num_shards):
        return self.inner.to_megatron([hf[0][self._perm]], shard, num_shards)

    def to_hf(self, shards):
        return [self.inner.to_hf(shards)[0][self._inverse]]


def rope_permutation(rows_before: int, rope_dim: int, groups: int, rows_after: int = 0) -> tuple[int, ...]:
    """Row order that turns rotate-half rope pairs (i, i + d/2) into interleaved pairs (2i, 2i + 1), per group.

    Each of `groups` blocks is [rows_before non-rope rows, rope_dim rope rows, rows_after rows]; Megatron row 2i of
    the rope part takes HF row i and row 2i + 1 takes HF row d/2 + i.
    """
    half = rope_dim // 2
    rope = [j for i in range(half) for j in (i, half + i)]
    block = rows_before + rope_dim + rows_after
    out: list[int] = []
    for g in range(groups):
        base = g * block
        out += [base + i for i in range(rows_before)]
        out += [base + rows_before + r for r in rope]
        out += [base + rows_before + rope_dim + i for i in range(rows_after)]
    return tuple(out)


#: rope types Megatron's MLA reproduces
MLA_ROPE_TYPES = ("default", "yarn")


def rope_fields(rope: RopeScaling) -> dict[str, Any]:
    """MLATransformerConfig rope fields for the model's RoPE (models/rope.py reads both config.json forms)."""
    where = f"{rope.model_type} config.json"
    if rope.rope_type == "default":
        # mscale_all_dim=0 keeps MLA's softmax scale at 1/sqrt(qk head dim), as HF's default rope does.
        return dict(rope_type="rope", rotary_base=rope.theta, mscale=1.0, mscale_all_dim=0.0)
    if not rope.truncate:
        raise UnsupportedModel(f"{where}: yarn truncate=false is not supported (Megatron rounds)")
    mscale, mscale_all = rope.mscale, rope.mscale_all_dim
    if mscale_all and not mscale:
        raise UnsupportedModel(f"{where}: yarn mscale_all_dim={mscale_all} without mscale has no Megatron equivalent")
    if not (mscale and mscale_all):
        # HF then scales cos/sin by mscale(factor) and leaves the softmax scale alone: Megatron's mscale=1, all=0.
        mscale, mscale_all = 1.0, 0.0
    return dict(
        rope_type="yarn",
        rotary_base=rope.theta,
        rotary_scaling_factor=rope.factor,
        original_max_position_embeddings=rope.original_max_position_embeddings,
        beta_fast=rope.beta_fast,
        beta_slow=rope.beta_slow,
        mscale=float(mscale),
        mscale_all_dim=float(mscale_all),
    )


def num_mtp_layers(hf: HFConfig) -> int:
    return int(hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers", 0)))


MTP_MODES = ("on", "off", "auto")


def resolve_mtp(
    config: dict[str, Any], names: set[str], mode: str
) -> tuple[dict[str, Any], str | None, tuple[str, ...]]:
    """MTP on or off for a checkpoint (see ModelFamily.resolve_mtp).

    transformers' save_pretrained keeps `num_nextn_predict_layers` but drops the MTP layers (model.layers.{L + i}.*):
    `auto` turns MTP off when the checkpoint holds none of them and keeps it on when it holds any, so a checkpoint
    with only part of an MTP layer is still refused by the loaders, which name the missing tensors. `off` ignores
    them; `on` requires them.
    """
    if mode not in MTP_MODES:
        raise ValueError(f"mtp={mode!r} is invalid: expected one of {MTP_MODES}")
    hf = HFConfig(config)
    n = num_mtp_layers(hf)
    if n == 0 or mode == "on":
        return config, None, ()
    first = hf.req("num_hidden_layers")
    prefixes = tuple(f"model.layers.{first + i}." for i in range(n))
    held = sum(name.startswith(prefixes) for name in names)
    if mode == "auto" and held:
        return config, None, ()
    off = {k: v for k, v in config.items() if k != "num_mtp_layers"}
    off["num_nextn_predict_layers"] = 0
    why = (
        f"mtp=off (its {held} tensors are not read)" if mode == "off" else "the checkpoint holds none of their weights"
    )
    return off, f"MTP off: config.json asks for {n} MTP layer(s) (num_nextn_predict_layers={n}), {why}", prefixes


def attention_rules(hf: HFConfig, m: str = L, h: str = H) -> list[Rule]:
    """MLA rules for one layer prefix (decoder layers or an MTP layer's transformer_layer)."""
    heads, nope, rope, v = (
        hf.req(k) for k in ("num_attention_heads", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    )
    q_lora, kv_lora = hf.get("q_lora_rank"), hf.req("kv_lora_rank")
    q_up: Transform = Split(dim=0)
    kv_down: Transform = LatentDownProj(dim=0, rows=kv_lora + rope)
    if not hf.get("rope_interleave", True):
        q_up = RowPermuted(inner=q_up, perm=rope_permutation(nope, rope, heads))
        kv_down = RowPermuted(inner=kv_down, perm=rope_permutation(kv_lora, rope, 1))
    a = m + "self_attention."
    rules = [
        Rule(m + "input_layernorm.weight", h + "input_layernorm.weight", Replicated()),
        Rule(a + "linear_kv_down_proj.weight", h + "self_attn.kv_a_proj_with_mqa.weight", kv_down),
        Rule(a + "kv_layernorm.weight", h + "self_attn.kv_a_layernorm.weight", Replicated()),
        # Transformer Engine's spec fuses the latent norms into the up projections.
        Rule(a + "linear_kv_up_proj.layer_norm_weight", h + "self_attn.kv_a_layernorm.weight", Replicated()),
        Rule(a + "linear_kv_up_proj.weight", h + "self_attn.kv_b_proj.weight", Split(dim=0)),
        Rule(a + "linear_proj.weight", h + "self_attn.o_proj.weight", Split(dim=1)),
    ]
    if q_lora:
        rules += [
            Rule(a + "linear_q_down_proj.weight", h + "self_attn.q_a_proj.weight", LatentDownProj(dim=0, rows=q_lora)),
            Rule(a + "q_layernorm.weight", h + "self_attn.q_a_layernorm.weight", Replicated()),
            Rule(a + "linear_q_up_proj.layer_norm_weight", h + "self_attn.q_a_layernorm.weight", Replicated()),
            Rule(a + "linear_q_up_proj.weight", h + "self_attn.q_b_proj.weight", q_up),
        ]
    else:
        rules.append(Rule(a + "linear_q_proj.weight", h + "self_attn.q_proj.weight", q_up))
    return rules


def mlp_rules(m: str = L, h: str = H) -> list[Rule]:
    """Dense SwiGLU layers (first_k_dense_replace) and MoE layers: router + bias buffer, routed and shared experts."""
    rules = dense_mlp_rules() + expert_rules()
    rules += [
        Rule(L + "mlp.router.weight", H + "mlp.gate.weight", Replicated()),
        Rule(L + "mlp.router.expert_bias", H + "mlp.gate.e_score_correction_bias", Replicated()),
        Rule(
            L + "mlp.shared_experts.linear_fc1.weight",
            (H + "mlp.shared_experts.gate_proj.weight", H + "mlp.shared_experts.up_proj.weight"),
            FusedColumns(num_hf=2),
        ),
        Rule(L + "mlp.shared_experts.linear_fc2.weight", H + "mlp.shared_experts.down_proj.weight", Split(dim=1)),
    ]
    if (m, h) == (L, H):
        return rules
    return [
        dataclasses.replace(r, mcore=r.mcore.replace(L, m), hf=tuple(name.replace(H, h) for name in r.hf))
        for r in rules
    ]


def mtp_rules(hf: HFConfig) -> list[Rule]:
    """MTP layer i (Megatron mtp.layers.{i}.*) <-> HF model.layers.{num_hidden_layers + i}.*."""
    rules = []
    for i in range(num_mtp_layers(hf)):
        m, h = f"mtp.layers.{i}.", f"model.layers.{hf.req('num_hidden_layers') + i}."
        rules += [
            Rule(m + "enorm.weight", h + "enorm.weight", Replicated()),
            Rule(m + "hnorm.weight", h + "hnorm.weight", Replicated()),
            Rule(m + "eh_proj.weight", h + "eh_proj.weight", Split(dim=0)),
            Rule(m + "final_layernorm.weight", h + "shared_head.norm.weight", Replicated()),
        ]
        rules += attention_rules(hf, m + "transformer_layer.", h) + mlp_rules(m + "transformer_layer.", h)
    return rules


def embedding_rules_with_mtp_copies(hf: HFConfig, padded_vocab: int) -> list[Rule]:
    """Embedding / final norm / output head; with MTP, DeepSeek's per-MTP-layer copies become export aliases."""
    first = hf.req("num_hidden_layers")
    mtp = [f"model.layers.{first + i}." for i in range(num_mtp_layers(hf))]
    tied = bool(hf.get("tie_word_embeddings", False))
    out = []
    for rule in embedding_rules(hf, padded_vocab):
        if rule.mcore == "embedding.word_embeddings.weight":
            names = [p + "embed_tokens.weight" for p in mtp] + (
                [p + "shared_head.head.weight" for p in mtp] if tied else []
            )
            rule = dataclasses.replace(rule, aliases=tuple(names))
        elif rule.mcore == "output_layer.weight" and not tied:
            rule = dataclasses.replace(rule, aliases=tuple(p + "shared_head.head.weight" for p in mtp))
        out.append(rule)
    return out


def moe_layer_pattern(hf: HFConfig) -> list[int]:
    """0 for the first `first_k_dense_replace` (dense) layers, 1 for the MoE layers after them."""
    num_layers, dense = hf.req("num_hidden_layers"), hf.get("first_k_dense_replace", 0)
    return [int(i >= dense) for i in range(num_layers)]


def routing_groups(hf: HFConfig) -> tuple[int | None, int | None]:
    """(moe_router_num_groups, moe_router_group_topk), or (None, None) when grouping selects every group."""
    groups, topk_group, topk = hf.get("n_group", 1), hf.get("topk_group", 1), hf.req("num_experts_per_tok")
    experts = hf.req("n_routed_experts", "num_local_experts")
    if groups <= 1 or topk_group >= groups:
        return None, None
    if experts % groups:
        raise UnsupportedModel(
            f"deepseek_v3 config.json: n_routed_experts={experts} is not divisible by n_group={groups}"
        )
    if topk % topk_group or topk // topk_group != 2:
        raise UnsupportedModel(
            f"deepseek_v3 config.json: num_experts_per_tok={topk} / topk_group={topk_group} must be 2: HF scores a "
            "group by its top-2 experts, Megatron by its top (topk / group_topk)"
        )
    return groups, topk_group


#: SGLang's DeepSeek-V3 loader: MLA's down projections (q_a_proj, kv_a_proj_with_mqa) are replicated, the up
#: projections split heads over attention tp; MoE, shared experts and vocabulary as in every family.
DEEPSEEK_ENGINE_SHARDS = (
    ShardRule(r"\.self_attn\.(q_proj|q_b_proj|kv_b_proj)\.", "attn", 0),
    ShardRule(r"\.self_attn\.o_proj\.", "attn", 1),
    *MLP_ENGINE_SHARDS,
)

#: SGLang 0.5.23's DeepSeek loader (models/deepseek_common/deepseek_weight_loader.py, do_load_weights) caches
#: q_a_proj and kv_a_proj_with_mqa of a layer and loads them as one fused_qkv_a_proj_with_mqa only when both came in
#: the same load_weights call; a half that arrives alone is dropped with no error. So a layer's two halves (weights
#: and, in FP8 syncs, their weight_scale_inv) travel in one bucket.
DEEPSEEK_RECEIVE_TOGETHER = (
    ReceiveTogether(r"^(?P<key>model\.layers\.\d+\.self_attn)\.(q_a_proj|kv_a_proj_with_mqa)\."),
)


@register
class DeepseekV3Family(ModelFamily):
    model_type = "deepseek_v3"
    engine_shards = DEEPSEEK_ENGINE_SHARDS
    engine_receive_together = DEEPSEEK_RECEIVE_TOGETHER
    architecture = "DeepseekV3ForCausalLM"

    def resolve_mtp(
        self, config: dict[str, Any], names: set[str], mode: str
    ) -> tuple[dict[str, Any], str | None, tuple[str, ...]]:
        return resolve_mtp(config, names, mode)

    def shape(self, hf: HFConfig) -> ModelShape:
        heads = hf.req("num_attention_heads")
        return ModelShape(
            num_layers=hf.req("num_hidden_layers"),
            num_attention_heads=heads,
            num_query_groups=heads,  # MLA: every head has its own key and value
            vocab_size=hf.req("vocab_size"),
            num_experts=hf.req("n_routed_experts", "num_local_experts"),
            ffn_hidden_size=hf.req("intermediate_size") if 0 in moe_layer_pattern(hf) else 0,
            moe_ffn_hidden_size=hf.req("moe_intermediate_size"),
        )

    def transformer_config(
        self, hf: HFConfig, layout: ParallelLayout, runtime: str, dtype: torch.dtype, **overrides: Any
    ) -> Any:
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        hf.refuse_unless("hidden_act", "silu", "Megatron's SwiGLU here uses silu")
        hf.refuse_unless("attention_bias", False, "MLA in Megatron has no projection biases")
        hf.refuse_unless("scoring_func", "sigmoid", "DeepSeek-V3 routing is sigmoid")
        hf.refuse_unless("topk_method", "noaux_tc", "only aux-loss-free (noaux_tc) routing maps to Megatron")
        hf.refuse_unless("moe_layer_freq", 1, "DeepSeek-V3 places an MoE layer in every layer after the dense ones")
        topk = hf.req("num_experts_per_tok")
        if topk > 1 and not hf.get("norm_topk_prob", False):
            raise UnsupportedModel(
                "deepseek_v3 config.json: norm_topk_prob=false is not supported (Megatron always renormalises "
                "sigmoid top-k weights)"
            )
        groups, group_topk = routing_groups(hf)
        rope = rope_fields(self.rope(hf))
        q_lora, kv_lora, qk_rope = hf.get("q_lora_rank"), hf.req("kv_lora_rank"), hf.req("qk_rope_head_dim")
        shared = hf.get("n_shared_experts", 0) * hf.req("moe_intermediate_size")
        te = te_in_use(runtime)
        # The local spec column-splits the latent down projections across TP (TE replicates them).
        for name, size in (("q_lora_rank", q_lora or 0), ("kv_lora_rank + qk_rope_head_dim", kv_lora + qk_rope)):
            if not te and size % layout.tp:
                raise LayoutError(f"deepseek_v3: {name}={size} is not divisible by tp={layout.tp}")
        if shared % layout.tp:
            raise LayoutError(f"deepseek_v3: shared expert size {shared} is not divisible by tp={layout.tp}")
        mtp = num_mtp_layers(hf)
        kwargs: dict[str, Any] = dict(
            num_layers=hf.req("num_hidden_layers"),
            hidden_size=hf.req("hidden_size"),
            num_attention_heads=hf.req("num_attention_heads"),
            ffn_hidden_size=hf.req("intermediate_size"),
            multi_latent_attention=True,
            q_lora_rank=q_lora,
            kv_lora_rank=kv_lora,
            qk_head_dim=hf.req("qk_nope_head_dim"),
            qk_pos_emb_head_dim=qk_rope,
            v_head_dim=hf.req("v_head_dim"),
            # Only the local core attention reads kv_channels with MLA: its output is heads x v_head_dim wide.
            kv_channels=hf.req("v_head_dim"),
            normalization="RMSNorm",
            layernorm_epsilon=hf.get("rms_norm_eps", 1e-6),
            qk_layernorm=True,  # MLA: q_a_layernorm and kv_a_layernorm on the latents
            gated_linear_unit=True,
            activation_func=F.silu,
            add_bias_linear=False,
            add_qkv_bias=False,
            hidden_dropout=0.0,
            attention_dropout=float(hf.get("attention_dropout", 0.0)),
            init_method_std=hf.get("initializer_range", 0.02),
            num_moe_experts=hf.req("n_routed_experts", "num_local_experts"),
            moe_ffn_hidden_size=hf.req("moe_intermediate_size"),
            moe_shared_expert_intermediate_size=shared or None,
            moe_router_topk=topk,
            moe_layer_freq=moe_layer_pattern(hf),
            moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True,
            moe_router_num_groups=groups,
            moe_router_group_topk=group_topk,
            moe_router_topk_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
            # HF computes router logits, sigmoid and the bias in fp32 whatever the model dtype.
            moe_router_dtype="fp32",
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            # The expert bias (aux-loss-free balancing) is part of the released policy: RL keeps it frozen unless
            # actor.router_bias_update_rate says otherwise (as slime); Megatron's default moves it 1e-3 per step.
            moe_router_bias_update_rate=0.0,
            **moe_backend_fields(runtime),
            mtp_num_layers=mtp or None,
            **megatron_common_fields(layout, dtype, runtime),
            **rope,
        )
        # Megatron's fused MLA rope exists for yarn only.
        kwargs["apply_rope_fusion"] = te and rope["rope_type"] == "yarn"
        kwargs.update(overrides)
        try:
            return MLATransformerConfig(**kwargs)
        except (AssertionError, ValueError, NotImplementedError) as err:
            raise UnsupportedModel(f"deepseek_v3: Megatron refused the translated config: {err}") from err

    def rope(self, hf: HFConfig) -> RopeScaling:
        return read_rope(hf, MLA_ROPE_TYPES)

    def weight_map(self, hf: HFConfig, padded_vocab: int) -> WeightMap:
        rules = embedding_rules_with_mtp_copies(hf, padded_vocab) + attention_rules(hf) + mlp_rules() + mtp_rules(hf)
        return WeightMap(rules, ignore_hf=(r".*rotary_emb\.inv_freq$",))
