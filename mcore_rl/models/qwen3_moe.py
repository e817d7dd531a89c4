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
from mcore_rl.parallel.layout import ModelShape, ParallelLayout
from mcore_rl.resharding.transforms import QKV, FusedColumns, Replicated, Split, VocabSplit
from mcore_rl.resharding.weight_map import Rule, WeightMap

L = "decoder.layers.{layer}."
H = "model.layers.{layer}."


def moe_layer_pattern(hf: HFConfig) -> list[int]:
    """1 for an MoE layer, 0 for a dense one, per HF's rule (mlp_only_layers, decoder_sparse_step)."""
    num_layers = hf.req("num_hidden_layers")
    experts = hf.req("num_experts", "num_local_experts")
    step = hf.get("decoder_sparse_step", 1)
    dense = set(hf.get("mlp_only_layers", []))
    return [int(i not in dense and experts > 0 and (i + 1) % step == 0) for i in range(num_layers)]


def attention_rules(hf: HFConfig, te_fused_norm: bool = True) -> list[Rule]:
    """Rules shared by Qwen-style GQA attention with optional qk norm (also used by dense Qwen3)."""
    heads = hf.req("num_attention_heads")
    groups = hf.get("num_key_value_heads", heads)
    head_dim = hf.get("head_dim", hf.req("hidden_size") // heads)
    qkv = QKV(num_heads=heads, num_query_groups=groups, head_dim=head_dim)
    names = tuple(H + f"self_attn.{p}_proj.weight" for p in "qkv")
    rules = [
        Rule(L + "self_attention.linear_qkv.weight", names, qkv),
        Rule(L + "self_attention.linear_proj.weight", H + "self_attn.o_proj.weight", Split(dim=1)),
        Rule(L + "input_layernorm.weight", H + "input_layernorm.weight", Replicated()),
        # Transformer Engine's spec fuses the input norm into linear_qkv.
        Rule(L + "self_attention.linear_qkv.layer_norm_weight", H + "input_layernorm.weight", Replicated()),
    ]
    if hf.get("attention_bias", False):
        bias_names = tuple(H + f"self_attn.{p}_proj.bias" for p in "qkv")
        rules.append(Rule(L + "self_attention.linear_qkv.bias", bias_names, qkv))
    return rules


def qk_norm_rules() -> list[Rule]:
    return [
        Rule(L + "self_attention.q_layernorm.weight", H + "self_attn.q_norm.weight", Replicated()),
        Rule(L + "self_attention.k_layernorm.weight", H + "self_attn.k_norm.weight", Replicated()),
    ]


def dense_mlp_rules() -> list[Rule]:
    """SwiGLU MLP: Megatron's linear_fc1 holds [gate; up] per TP shard."""
    gate_up = (H + "mlp.gate_proj.weight", H + "mlp.up_proj.weight")
    return [
        Rule(L + "mlp.linear_fc1.weight", gate_up, FusedColumns(num_hf=2)),
        Rule(L + "mlp.linear_fc2.weight", H + "mlp.down_proj.weight", Split(dim=1)),
        Rule(L + "pre_mlp_layernorm.weight", H + "post_attention_layernorm.weight", Replicated()),
        Rule(L + "mlp.linear_fc1.layer_norm_weight", H + "post_attention_layernorm.weight", Replicated()),
    ]


def expert_rules(hf_expert: str = H + "mlp.experts.{expert}.") -> list[Rule]:
    """Routed experts under EP x ETP, for both the local spec (SequentialMLP) and TE's grouped GEMM."""
    gate_up = (hf_expert + "gate_proj.weight", hf_expert + "up_proj.weight")
    fc1, fc2 = FusedColumns(num_hf=2, axis="etp"), Split(dim=1, axis="etp")
    return [
        Rule(L + "mlp.experts.local_experts.{expert}.linear_fc1.weight", gate_up, fc1),
        Rule(L + "mlp.experts.local_experts.{expert}.linear_fc2.weight", hf_expert + "down_proj.weight", fc2),
        Rule(L + "mlp.experts.linear_fc1.weight{expert}", gate_up, fc1),
        Rule(L + "mlp.experts.linear_fc2.weight{expert}", hf_expert + "down_proj.weight", fc2),
    ]


def embedding_rules(hf: HFConfig, padded_vocab: int) -> list[Rule]:
    vocab = VocabSplit(vocab_size=hf.req("vocab_size"), padded_vocab=padded_vocab)
    tied = bool(hf.get("tie_word_embeddings", False))
    return [
        Rule("embedding.word_embeddings.weight", "model.embed_tokens.weight", vocab),
        Rule("decoder.final_layernorm.weight", "model.norm.weight", Replicated()),
        # Tied: the last stage's output layer is loaded from the embedding and not exported a second time.
        Rule("output_layer.weight", "model.embed_tokens.weight" if tied else "lm_head.weight", vocab, export=not tied),
    ]


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
            moe_fields=moe_fields,
        )

    def weight_map(self, hf: HFConfig, padded_vocab: int) -> WeightMap:
        rules = embedding_rules(hf, padded_vocab) + attention_rules(hf) + qk_norm_rules() + dense_mlp_rules()
        rules += [Rule(L + "mlp.router.weight", H + "mlp.gate.weight", Replicated())] + expert_rules()
        return WeightMap(rules, ignore_hf=(r".*rotary_emb\.inv_freq$",))
