"""Weight-map rule builders and shapes shared by the model families: GQA attention (optional q/k biases and per-head
q/k norms), SwiGLU MLP, routed experts under EP x ETP, embedding and output layer, and the dense GQA shape.

A family file composes these; no family imports another, so each family's own knowledge stays in its one file and
the families sit side by side in the registry (models/registry.py).
"""

from __future__ import annotations

from mcore_rl.models.base import HFConfig, UnsupportedModel
from mcore_rl.parallel.layout import ModelShape
from mcore_rl.resharding.transforms import QKV, FusedColumns, Replicated, Split, VocabSplit
from mcore_rl.resharding.weight_map import Rule, WeightMap

L = "decoder.layers.{layer}."
H = "model.layers.{layer}."


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


#: HF names that are derived state, never weights (older checkpoints saved the rotary cache)
IGNORE_HF = (r".*rotary_emb\.inv_freq$",)


def refuse_sliding_window(hf: HFConfig) -> None:
    """Qwen2/Qwen3 configs may enable sliding-window attention on some layers; Megatron's local spec has no window."""
    hf.refuse_unless("use_sliding_window", False, "sliding-window attention has no Megatron equivalent here")
    kinds = set(hf.get("layer_types", ["full_attention"]))
    if kinds - {"full_attention"}:
        raise UnsupportedModel(
            f"{hf.model_type} config.json: layer_types contains {sorted(kinds - {'full_attention'})}; only "
            "full_attention layers are supported"
        )


def dense_shape(hf: HFConfig) -> ModelShape:
    """Sizes a layout must divide, for a dense GQA model."""
    heads = hf.req("num_attention_heads")
    return ModelShape(
        num_layers=hf.req("num_hidden_layers"),
        num_attention_heads=heads,
        num_query_groups=hf.get("num_key_value_heads", heads),
        vocab_size=hf.req("vocab_size"),
        ffn_hidden_size=hf.req("intermediate_size"),
    )


def dense_weight_map(hf: HFConfig, padded_vocab: int, *, qkv_bias: bool = False, qk_norm: bool = False) -> WeightMap:
    """Embedding/output + GQA attention (optional q/k/v biases and per-head q/k norms) + SwiGLU MLP rules."""
    # attention_rules adds the bias rule when the config says attention_bias; Qwen2 has q/k/v biases without it.
    attention_hf = HFConfig({**hf.raw, "attention_bias": qkv_bias})
    rules = embedding_rules(hf, padded_vocab) + attention_rules(attention_hf) + dense_mlp_rules()
    if qk_norm:
        rules += qk_norm_rules()
    return WeightMap(rules, ignore_hf=IGNORE_HF)
