"""Qwen3-MoE (HF model_type "qwen3_moe", e.g. Qwen3-30B-A3B, Qwen3-235B-A22B).

Architecture: GQA attention with per-head RMSNorm on q and k (qk_layernorm), RoPE, no linear biases; MoE MLP with
softmax routing over `num_experts`, top-k (`num_experts_per_tok`), renormalised when `norm_topk_prob`; layers listed in
`mlp_only_layers` (or off the `decoder_sparse_step` grid) use a dense SwiGLU MLP.

Routing equivalence: HF computes softmax over all experts, takes top-k, then renormalises (norm_topk_prob=True). That
equals Megatron's top-k on logits followed by softmax over the k (moe_router_pre_softmax=False). Without
renormalisation HF keeps the full-softmax probabilities: Megatron's moe_router_pre_softmax=True.
"""

from __future__ import annotations

from typing import Any

import torch

from mcore_rl.models.base import HFConfig, ModelFamily, gqa_transformer_config, moe_backend_fields, register
from mcore_rl.models.rope import RopeScaling, read_rope
from mcore_rl.models.rules import H, L, attention_rules, dense_mlp_rules, embedding_rules, expert_rules, qk_norm_rules
from mcore_rl.parallel.layout import ModelShape, ParallelLayout
from mcore_rl.resharding.transforms import Replicated
from mcore_rl.resharding.weight_map import Rule, WeightMap


def moe_layer_pattern(hf: HFConfig) -> list[int]:
    """1 for an MoE layer, 0 for a dense one, per HF's rule (mlp_only_layers, decoder_sparse_step)."""
    num_layers = hf.req("num_hidden_layers")
    experts = hf.req("num_experts", "num_local_experts")
    step = hf.get("decoder_sparse_step", 1)
    dense = set(hf.get("mlp_only_layers", []))
    return [int(i not in dense and experts > 0 and (i + 1) % step == 0) for i in range(num_layers)]


@register
class Qwen3MoeFamily(ModelFamily):
    model_type = "qwen3_moe"
    architecture = "Qwen3MoeForCausalLM"

    def shape(self, hf: HFConfig) -> ModelShape:
        heads = hf.req("num_attention_heads")
        return ModelShape(
            num_layers=hf.req("num_hidden_layers"),
            num_attention_heads=heads,
            num_query_groups=hf.get("num_key_value_heads", heads),
            vocab_size=hf.req("vocab_size"),
            num_experts=hf.req("num_experts", "num_local_experts"),
            ffn_hidden_size=hf.get("intermediate_size", 0) if 0 in moe_layer_pattern(hf) else 0,
            moe_ffn_hidden_size=hf.req("moe_intermediate_size"),
        )

    def transformer_config(
        self, hf: HFConfig, layout: ParallelLayout, runtime: str, dtype: torch.dtype, **overrides: Any
    ) -> Any:
        # HF's attention_bias also biases o_proj; Megatron's add_qkv_bias covers q/k/v only, and add_bias_linear would
        # add biases to every linear layer (experts included). Refused rather than dropping o_proj's bias.
        hf.refuse_unless("attention_bias", False, "Qwen3-MoE's attention_bias also biases o_proj; Megatron cannot")
        hf.refuse_unless("use_sliding_window", False, "sliding-window attention has no Megatron equivalent here")
        moe_fields = dict(
            num_moe_experts=hf.req("num_experts", "num_local_experts"),
            moe_ffn_hidden_size=hf.req("moe_intermediate_size"),
            moe_router_topk=hf.req("num_experts_per_tok"),
            moe_layer_freq=moe_layer_pattern(hf),
            moe_router_score_function="softmax",
            moe_router_pre_softmax=not hf.get("norm_topk_prob", False),
            # Router logits and top-k softmax in fp32 whatever the model dtype, as Megatron-LM's own Qwen3-MoE
            # example runs (its TransformerConfig warns without it from 32 experts; Qwen3-235B has 128). HF and SGLang
            # take the routing softmax in fp32 too. No effect on an fp32 model.
            moe_router_dtype="fp32",
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            **moe_backend_fields(runtime),
        )
        return gqa_transformer_config(
            hf,
            layout,
            runtime,
            dtype,
            qk_layernorm=True,
            add_qkv_bias=False,
            overrides=overrides,
            rope=self.rope(hf),
            moe_fields=moe_fields,
        )

    def rope(self, hf: HFConfig) -> RopeScaling:
        return read_rope(hf)

    def weight_map(self, hf: HFConfig, padded_vocab: int) -> WeightMap:
        rules = embedding_rules(hf, padded_vocab) + attention_rules(hf) + qk_norm_rules() + dense_mlp_rules()
        rules += [Rule(L + "mlp.router.weight", H + "mlp.gate.weight", Replicated())] + expert_rules()
        return WeightMap(rules, ignore_hf=(r".*rotary_emb\.inv_freq$",))
