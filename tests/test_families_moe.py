"""Logits parity and bit-exact export for the MoE families: DeepSeek-V3 (MLA, MTP) and Qwen3-MoE (CPU, gloo ranks).

    .venv/bin/pytest -q tests/test_families_moe.py

DeepSeek-V3 runs the whole cross product {TP1, TP2} x {PP1, PP2} x {EP1, EP2} plus expert-TP != TP, on 4 ranks,
with group-limited sigmoid routing, a random e_score_correction_bias (Megatron's expert_bias buffer), shared experts,
a dense first layer and one MTP layer whose logits are compared too. A second DeepSeek config covers YaRN rope,
rope_interleave=false (rope rows permuted by the weight map), no q LoRA, tied embeddings and 2 shared experts.
Qwen3-MoE (its forward/backward is in test_qwen3_moe_parity.py) adds the layouts that test does not cover.

Bound: fp32 logits within 1e-5 absolute of transformers' (measured <= 2e-7). Router weights are drawn with std 1 so
top-k margins dwarf fp32 rounding and no routing decision can flip between the two implementations.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _parity import DEEPSEEK_TINY, _randomise_routing, check_layouts, tiny_deepseek_v3
from tiny_models import tiny_qwen3_moe_transformers

from mcore_rl.models.base import HFConfig, UnsupportedModel
from mcore_rl.models.registry import get_family
from mcore_rl.parallel.layout import ParallelLayout
from mcore_rl.resharding.weight_map import WeightMapError

ATOL = 1e-5
SEQ, BATCH, VOCAB = 12, 2, 100


def _layout(tp: int = 1, pp: int = 1, ep: int = 1, etp: int | None = None) -> ParallelLayout:
    return ParallelLayout(tp=tp, pp=pp, ep=ep, etp=etp, sequence_parallel=tp > 1)


CROSS_PRODUCT = [
    _layout(tp, pp, ep, etp=1 if tp * pp * ep > 4 else None) for tp in (1, 2) for pp in (1, 2) for ep in (1, 2)
] + [_layout(tp=2, ep=2, etp=1)]


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def _check(name: str, hf_dir: Path, layouts: list[ParallelLayout], ref: dict) -> None:
    check_layouts(name, hf_dir, layouts, ref, _ids(), world=4, atol=ATOL)


@pytest.mark.slow  # multi-rank (gloo): the fast tier (-m 'not slow') leaves it out
def test_deepseek_v3_parity_every_layout(tmp_path: Path) -> None:
    ref = tiny_deepseek_v3(tmp_path, _ids())
    assert len(ref["mtp_logits"]) == 1
    _check("deepseek_v3", tmp_path, CROSS_PRODUCT, ref)


@pytest.mark.slow  # multi-rank (gloo): the fast tier (-m 'not slow') leaves it out
def test_deepseek_v3_yarn_noninterleaved_rope_no_q_lora(tmp_path: Path) -> None:
    yarn = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16, beta_fast=32, beta_slow=1)
    ref = tiny_deepseek_v3(
        tmp_path,
        _ids(),
        rope_parameters=dict(yarn, mscale=1.0, mscale_all_dim=1.0, rope_theta=10000.0),
        rope_interleave=False,
        q_lora_rank=None,
        num_nextn_predict_layers=0,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=0,
        n_shared_experts=2,
        tie_word_embeddings=True,
    )
    _check("deepseek_v3 yarn", tmp_path, [_layout(), _layout(tp=2, ep=2), _layout(pp=2, ep=2)], ref)


@pytest.mark.slow  # multi-rank (gloo): the fast tier (-m 'not slow') leaves it out
def test_qwen3_moe_parity_and_round_trip(tmp_path: Path) -> None:
    from transformers import Qwen3MoeForCausalLM

    config = tiny_qwen3_moe_transformers(vocab_size=VOCAB, max_position_embeddings=64)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config).float().eval()
    _randomise_routing(model)
    model.save_pretrained(tmp_path)
    with torch.no_grad():
        ref = {"logits": model(_ids()).logits, "mtp_logits": []}
    layouts = [_layout(tp=2, pp=2, ep=2, etp=1), _layout(pp=2, ep=2), _layout(tp=2, ep=2, etp=1)]
    _check("qwen3_moe", tmp_path, layouts, ref)


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(norm_topk_prob=False), "norm_topk_prob"),
        (dict(num_experts_per_tok=2), "topk_group"),
        (dict(scoring_func="softmax"), "scoring_func"),
        (dict(topk_method="greedy"), "topk_method"),
        (dict(rope_scaling={"type": "linear", "factor": 2.0}), "rope_type"),
        (
            dict(
                rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "truncate": False}
            ),
            "truncate",
        ),
        (
            dict(
                rope_scaling={
                    "type": "yarn",
                    "factor": 4.0,
                    "original_max_position_embeddings": 16,
                    "mscale_all_dim": 1.0,
                }
            ),
            "mscale_all_dim",
        ),
        (dict(attention_bias=True), "attention_bias"),
    ],
)
def test_deepseek_v3_refuses_settings_without_megatron_equivalent(change: dict, match: str) -> None:
    raw = dict(DEEPSEEK_TINY, model_type="deepseek_v3", **change)
    with pytest.raises(UnsupportedModel, match=match):
        get_family("deepseek_v3").transformer_config(HFConfig(raw), ParallelLayout(), "cpu", torch.float32)


def test_deepseek_v3_release_config_translates() -> None:
    """The config.json of the DeepSeek-V3 release maps onto Megatron field by field (no model is built)."""
    raw = dict(
        model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
        moe_intermediate_size=2048, num_hidden_layers=61, first_k_dense_replace=3, num_attention_heads=128,
        num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8, n_group=8, topk_group=4,
        routed_scaling_factor=2.5, norm_topk_prob=True, scoring_func="sigmoid", topk_method="noaux_tc",
        moe_layer_freq=1, num_nextn_predict_layers=1, ep_size=1, aux_loss_alpha=0.001, seq_aux=True,
        hidden_act="silu", attention_bias=False, rms_norm_eps=1e-6, rope_theta=10000, max_position_embeddings=163840,
        rope_scaling=dict(type="yarn", factor=40, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1,
                          mscale=1.0, mscale_all_dim=1.0),
        torch_dtype="bfloat16", tie_word_embeddings=False,
    )  # fmt: skip
    family, hf = get_family("deepseek_v3"), HFConfig(raw)
    layout = ParallelLayout(tp=8, pp=1, ep=64, etp=1, sequence_parallel=True)
    layout.validate(512, family.shape(hf))
    c = family.transformer_config(hf, layout, "cpu", torch.bfloat16)
    assert c.moe_layer_freq == [0, 0, 0] + [1] * 58 and c.mtp_num_layers == 1
    mla = (c.q_lora_rank, c.kv_lora_rank, c.qk_head_dim, c.qk_pos_emb_head_dim, c.v_head_dim)
    assert mla == (1536, 512, 128, 64, 128)
    assert (c.rope_type, c.rotary_scaling_factor, c.mscale, c.mscale_all_dim) == ("yarn", 40.0, 1.0, 1.0)
    assert (c.moe_router_num_groups, c.moe_router_group_topk, c.moe_router_topk_scaling_factor) == (8, 4, 2.5)
    assert c.moe_router_enable_expert_bias and c.moe_router_score_function == "sigmoid"
    assert c.moe_shared_expert_intermediate_size == 2048 and c.num_moe_experts == 256
    weight_map = family.weight_map(hf, padded_vocab=129280)
    for name in (
        "model.layers.61.shared_head.head.weight",
        "model.layers.61.mlp.experts.255.down_proj.weight",
        "model.layers.3.mlp.gate.e_score_correction_bias",
        "model.layers.0.self_attn.kv_a_proj_with_mqa.weight",
    ):
        assert weight_map.is_known_hf(name, 61, 256), name
    assert not weight_map.is_known_hf("model.layers.62.enorm.weight", 61, 256)


def test_qwen3_moe_refuses_attention_bias_it_cannot_represent():
    from tiny_models import tiny_qwen3_moe

    from mcore_rl.models.base import HFConfig, UnsupportedModel
    from mcore_rl.models.registry import get_family

    with pytest.raises(UnsupportedModel, match="attention_bias=True is not supported"):
        get_family("qwen3_moe").transformer_config(
            HFConfig(tiny_qwen3_moe(attention_bias=True)), ParallelLayout(), "cpu", torch.float32
        )


def test_weight_map_lookup_by_name_shape_keeps_first_match() -> None:
    """WeightMap indexes its rules by name shape (numbers as '#'); the rule found and the answer of is_known_hf are
    those of a scan over every rule in order, for every name of a DeepSeek-V3 (MTP layer with literal-index rules)
    and names out of range or unknown."""
    import re

    config = dict(DEEPSEEK_TINY, model_type="deepseek_v3", num_hidden_layers=3, first_k_dense_replace=1)
    hf = HFConfig(config)
    family = get_family("deepseek_v3")
    weight_map = family.weight_map(hf, 128)
    shape = family.shape(hf)

    def scan_hf(name: str) -> bool:
        if any(p.match(name) for p in weight_map._ignored):
            return True
        for pattern, _ in weight_map._compiled_hf:
            m = pattern.match(name)
            if not m:
                continue
            idx = m.groupdict()
            if int(idx.get("layer", -1)) >= shape.num_layers or int(idx.get("expert", -1)) >= shape.num_experts:
                continue
            return True
        return False

    def scan_mcore(name: str):
        return next((rule for pattern, rule in weight_map._compiled if pattern.match(name)), None)

    hf_names = []
    for pattern, _ in weight_map._compiled_hf:  # one name per rule template, at several indices
        for layer, expert in ((0, 0), (2, 7), (3, 1), (4, 0), (shape.num_layers + 5, 0), (1, 99)):
            text = pattern.pattern[1:-1].replace(r"(?P<layer>\d+)", str(layer)).replace(r"(?P<expert>\d+)", str(expert))
            hf_names.append(re.sub(r"\\(.)", r"\1", text))
    hf_names += ["model.layers.1.mlp.experts.0.unknown.weight", "lm_head.bias", "model.embed_tokens.weight"]
    assert any(scan_hf(n) for n in hf_names) and not all(scan_hf(n) for n in hf_names)
    for name in hf_names:
        assert weight_map.is_known_hf(name, shape.num_layers, shape.num_experts) == scan_hf(name), name
    mcore_names = [p.pattern[1:-1].replace(r"(?P<layer>\d+)", "1").replace(r"(?P<expert>\d+)", "3")
                   for p, _ in weight_map._compiled]  # fmt: skip
    mcore_names = [re.sub(r"\\(.)", r"\1", n) for n in mcore_names] + ["decoder.layers.0.unknown.weight"]
    for name in mcore_names:
        expected = scan_mcore(name)
        if expected is None:
            with pytest.raises(WeightMapError, match="no rule"):
                weight_map.match(name)
        else:
            assert weight_map.match(name)[0] is expected, name


def test_weight_map_rules_overlapping_in_one_name_shape_keep_their_order() -> None:
    """Two rules of the same name shape that both match a name (a literal index before a generic one): the earlier
    rule wins, as in a scan of the rules in order."""
    from mcore_rl.resharding.transforms import Replicated
    from mcore_rl.resharding.weight_map import Rule, WeightMap

    literal = Rule("mtp.layers.0.norm.weight", "model.layers.61.norm.weight", Replicated())
    generic = Rule("mtp.layers.{layer}.norm.weight", "model.layers.{layer}.norm.weight", Replicated())
    for rules in ([literal, generic], [generic, literal]):
        weight_map = WeightMap(list(rules))
        assert weight_map.match("mtp.layers.0.norm.weight")[0] is rules[0]
        assert weight_map.match("mtp.layers.4.norm.weight")[0] is generic
