"""Tests for the embedded rollout engine (`mcore_rl.rollout`): sampling, logprobs, EOS handling, HF-named weight
loading against real `save_pretrained` files, weight versions, and the Ray actor. CPU, tiny random models.

Run: `.venv/bin/pytest tests/test_rollout_engine.py`
"""

from __future__ import annotations

import random

import pytest
import torch
from safetensors import safe_open
from tiny_models import tiny_qwen3_moe_transformers
from transformers import AutoModelForCausalLM, GPT2Config, PretrainedConfig, Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig

from mcore_rl.rollout.engine import HFRolloutEngine
from mcore_rl.rollout.sampling import top_p_filter

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9], [10]]


def qwen3_moe_config() -> Qwen3MoeConfig:
    # initializer_range 0.5 (not 0.02) makes the tiny model's next-token distributions peaked, so greedy argmax has
    # clear margins and comparisons with transformers' generate are not decided by float noise.
    return tiny_qwen3_moe_transformers(vocab_size=64, norm_topk_prob=False, initializer_range=0.5)


def qwen2_moe_config() -> Qwen2MoeConfig:
    return Qwen2MoeConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=128,
        initializer_range=0.5,
    )


def qwen3_dense_config() -> Qwen3Config:
    # Tied embeddings, as in the small real Qwen3 checkpoints: lm_head.weight aliases embed_tokens.weight.
    return Qwen3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        initializer_range=0.5,
    )


CONFIGS = {"qwen3_moe": qwen3_moe_config, "qwen3_dense": qwen3_dense_config}


def reference_model(config: PretrainedConfig, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).eval()


@torch.no_grad()
def logits_of(model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([token_ids])).logits[0]


@pytest.mark.parametrize("family", sorted(CONFIGS))
@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 0.9), (0.0, 1.0)])
def test_sampled_logprobs_match_teacher_forced(family: str, temperature: float, top_p: float) -> None:
    engine = HFRolloutEngine(CONFIGS[family]())
    samples = engine.generate(PROMPTS, n=3, temperature=temperature, top_p=top_p, max_new_tokens=12, seed=0)
    assert len(samples) == len(PROMPTS) * 3
    # Greedy rollouts record temperature-1 logprobs, so they are compared at temperature 1.
    forced = engine.logprobs(
        [s.prompt_ids + s.response_ids for s in samples], [len(s.prompt_ids) for s in samples], temperature or 1.0
    )
    for sample, expected in zip(samples, forced):
        assert len(sample.response_logprobs) == len(sample.response_ids) == expected.numel()
        # fp32: the running batch pads rows to other widths than the teacher-forced pass (another summation order)
        torch.testing.assert_close(torch.tensor(sample.response_logprobs), expected, atol=5e-5, rtol=0)


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_greedy_matches_transformers_generate(family: str) -> None:
    engine = HFRolloutEngine(CONFIGS[family]())
    samples = engine.generate(PROMPTS, n=1, temperature=0.0, max_new_tokens=10)
    for prompt, sample in zip(PROMPTS, samples):
        # transformers' own greedy decoding of the unpadded prompt; our engine ran it left-padded in a batch.
        expected = engine.model.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=10, eos_token_id=None, pad_token_id=0
        )[0, len(prompt) :].tolist()
        assert sample.response_ids == expected
        assert sample.finish_reason == "length"


def test_stops_at_eos_includes_it_and_reports_finish_reason() -> None:
    engine = HFRolloutEngine(qwen3_moe_config())
    free = engine.generate(PROMPTS, temperature=0.0, max_new_tokens=8)
    # An EOS id that greedy decoding of some prompt first emits mid-response (step >= 1), so the cut is visible.
    row, step = next(
        (row, step)
        for row, sample in enumerate(free)
        for step, token in enumerate(sample.response_ids)
        if step >= 1 and token not in sample.response_ids[:step]
    )
    eos = free[row].response_ids[step]
    stopped = engine.generate(PROMPTS, temperature=0.0, max_new_tokens=8, eos_token_ids=[eos])
    assert stopped[row].response_ids == free[row].response_ids[: step + 1]
    assert stopped[row].finish_reason == "stop"
    for before, after in zip(free, stopped):
        if eos in before.response_ids:
            cut = before.response_ids.index(eos) + 1
            assert (after.response_ids, after.finish_reason) == (before.response_ids[:cut], "stop")
        else:
            assert (after.response_ids, after.finish_reason) == (before.response_ids, "length")


def test_sampled_responses_respect_eos_and_max_new_tokens() -> None:
    engine = HFRolloutEngine(qwen3_moe_config())
    eos_ids = [3, 17, 40]
    samples = engine.generate(PROMPTS, n=8, temperature=1.0, max_new_tokens=6, eos_token_ids=eos_ids, seed=3)
    reasons = {s.finish_reason for s in samples}
    assert reasons == {"stop", "length"}, "seed should give both outcomes; pick another seed if the model changed"
    for sample in samples:
        assert 1 <= len(sample.response_ids) <= 6
        assert not set(sample.response_ids[:-1]) & set(eos_ids), "generation continued past an EOS"
        if sample.finish_reason == "stop":
            assert sample.response_ids[-1] in eos_ids
        else:
            assert len(sample.response_ids) == 6 and sample.response_ids[-1] not in eos_ids


def test_same_seed_gives_same_samples() -> None:
    engine = HFRolloutEngine(qwen3_moe_config())
    first, again, other = (engine.generate(PROMPTS, n=4, max_new_tokens=8, seed=s) for s in (7, 7, 8))
    assert first == again
    assert [s.response_ids for s in first] != [s.response_ids for s in other]


def test_tiny_top_p_is_greedy_and_nucleus_is_minimal() -> None:
    engine = HFRolloutEngine(qwen3_moe_config())
    greedy = engine.generate(PROMPTS, temperature=0.0, max_new_tokens=8)
    nucleus = engine.generate(PROMPTS, temperature=1.0, top_p=1e-6, max_new_tokens=8, seed=0)
    assert [s.response_ids for s in nucleus] == [s.response_ids for s in greedy]
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3]])
    assert top_p_filter(probs, 0.8).nonzero()[:, 1].tolist() == [1, 3]
    assert top_p_filter(probs, 0.81).nonzero()[:, 1].tolist() == [1, 2, 3]


def test_a_temperature_below_sglangs_epsilon_is_greedy_and_infinity_is_refused() -> None:
    """1e-40 once scaled the logits to inf and sampled from NaN (SGLang samples greedily below 1e-6)."""
    engine = HFRolloutEngine(qwen3_moe_config())
    greedy = engine.generate(PROMPTS, temperature=0.0, max_new_tokens=8)
    tiny = engine.generate(PROMPTS, temperature=1e-40, max_new_tokens=8, seed=0)
    assert [s.response_ids for s in tiny] == [s.response_ids for s in greedy]
    assert all(lp == lp and lp <= 0 for s in tiny for lp in s.response_logprobs), "NaN logprobs"
    with pytest.raises(ValueError, match="temperature must be a finite number"):
        engine.generate(PROMPTS, temperature=float("inf"), max_new_tokens=2)


def read_safetensors(path: str) -> dict[str, torch.Tensor]:
    with safe_open(path, framework="pt") as handle:
        return {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118 (safe_open is not a dict)


@pytest.mark.parametrize("make_config", [qwen3_moe_config, qwen2_moe_config, qwen3_dense_config])
def test_load_weights_from_save_pretrained_matches_transformers_logits(make_config, tmp_path) -> None:
    config = make_config()
    reference = reference_model(config, seed=1)
    reference.save_pretrained(tmp_path)
    checkpoint = read_safetensors(str(tmp_path / "model.safetensors"))
    if config.model_type.endswith("_moe"):
        assert "model.layers.1.mlp.experts.3.up_proj.weight" in checkpoint, "expected per-expert checkpoint names"
    tokens = [5, 9, 2, 33, 61, 7, 7, 1]
    engine = HFRolloutEngine(config, init_seed=2)
    assert (logits_of(engine.model, tokens) - logits_of(reference, tokens)).abs().max() > 1e-2

    engine.load_weights(checkpoint.items())
    assert (logits_of(engine.model, tokens) - logits_of(reference, tokens)).abs().max() < 1e-6
    # state_dict_hf is the inverse: exactly the names and values save_pretrained wrote.
    exported = engine.state_dict_hf()
    assert sorted(exported) == sorted(checkpoint)
    assert all(torch.equal(exported[name], checkpoint[name]) for name in checkpoint)
    # Loading the directory with from_pretrained agrees as well.
    from_dir = HFRolloutEngine(tmp_path)
    assert (logits_of(from_dir.model, tokens) - logits_of(reference, tokens)).abs().max() < 1e-6


def test_load_weights_in_shuffled_chunks_gives_same_weights(tmp_path) -> None:
    reference = reference_model(qwen3_moe_config(), seed=1)
    reference.save_pretrained(tmp_path)
    items = list(read_safetensors(str(tmp_path / "model.safetensors")).items())
    random.Random(0).shuffle(items)
    engine = HFRolloutEngine(qwen3_moe_config(), init_seed=2)
    for start in range(0, len(items), 10):
        engine.load_weights(iter(items[start : start + 10]))
    exported = engine.state_dict_hf()
    assert all(torch.equal(exported[name], tensor) for name, tensor in items)
    tokens = [3, 1, 4, 1, 5, 9, 2, 6]
    assert torch.equal(logits_of(engine.model, tokens), logits_of(reference, tokens))


@pytest.mark.parametrize(
    ("name", "shape", "message"),
    [
        (
            "model.layers.0.mlp.experts.gate_up_proj",
            (4, 32, 32),
            r"'model\.layers\.0\.mlp\.experts\.gate_up_proj' .*fused",
        ),
        ("model.layers.7.self_attn.q_proj.weight", (32, 32), r"unknown tensor 'model\.layers\.7\.self_attn"),
        (
            "model.layers.0.self_attn.k_proj.weight",
            (32, 32),
            r"'model\.layers\.0\.self_attn\.k_proj\.weight' has shape \[32, 32\], expected \[16, 32\]",
        ),
        (
            "model.layers.1.mlp.experts.2.down_proj.weight",
            (16, 32),
            r"experts\.2\.down_proj\.weight' has shape \[16, 32\], expected \[32, 16\]",
        ),
        (
            "model.layers.1.mlp.experts.4.gate_proj.weight",
            (16, 32),
            r"experts\.4\.gate_proj\.weight' \(shape \[16, 32\]\): expert 4 out of range",
        ),
    ],
)
def test_load_weights_rejects_bad_names_and_shapes(name: str, shape: tuple[int, ...], message: str) -> None:
    engine = HFRolloutEngine(qwen3_moe_config())
    with pytest.raises(ValueError, match=message):
        engine.load_weights([(name, torch.zeros(shape))])


def test_unknown_model_type_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"no HF name map for model_type 'gpt2'"):
        HFRolloutEngine(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64))


def test_update_weights_from_tensors_increments_weight_version() -> None:
    engine = HFRolloutEngine(qwen3_moe_config())
    source = HFRolloutEngine(qwen3_moe_config(), init_seed=5)
    assert engine.weight_version == 0
    assert engine.generate(PROMPTS[:1], max_new_tokens=2, seed=0)[0].weight_version == 0
    assert engine.update_weights_from_tensors(source.state_dict_hf().items()) == 1
    assert engine.update_weights_from_tensors([]) == 2
    assert engine.update_weights_from_tensors([], weight_version=7) == 7
    assert engine.weight_version == 7
    assert engine.generate(PROMPTS[:1], max_new_tokens=2, seed=0)[0].weight_version == 7
    with pytest.raises(ValueError, match="weight_version must increase"):
        engine.update_weights_from_tensors([], weight_version=7)
    # A failed load leaves the version where it was.
    with pytest.raises(ValueError, match="unknown tensor"):
        engine.update_weights_from_tensors([("nope.weight", torch.zeros(1))])
    assert engine.weight_version == 7


def test_deepseek_v3_engine_skips_mtp_layers_and_loads_the_router_bias() -> None:
    from _parity import DEEPSEEK_TINY

    config = dict(DEEPSEEK_TINY, model_type="deepseek_v3")
    engine, source = HFRolloutEngine(config, init_seed=0), HFRolloutEngine(config, init_seed=1)
    named = dict(source.state_dict_hf())
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert bias in named, "the router bias is a checkpoint tensor (a persistent buffer in transformers)"
    named[bias] = torch.randn_like(named[bias])
    mtp = {"model.layers.2.eh_proj.weight": torch.zeros(32, 64), "model.layers.2.enorm.weight": torch.zeros(32)}
    engine.update_weights_from_tensors([*named.items(), *mtp.items()])  # MTP layer 2 = num_hidden_layers: skipped
    for name, tensor in named.items():
        assert torch.equal(engine.state_dict_hf()[name], tensor), name
    with pytest.raises(ValueError, match="unknown tensor 'model.layers.3.eh_proj.weight'"):
        engine.load_weights([("model.layers.3.eh_proj.weight", torch.zeros(32, 64))])  # beyond the MTP layers
    from mcore_rl.rollout.scheduler import ContinuousBatcher, GenParams, Sequence

    seq = Sequence("r", [1, 2, 3], GenParams(max_new_tokens=3, temperature=0), return_routed_experts=True)
    ContinuousBatcher(engine).run_until_done([seq])
    routed = seq.routed_experts()  # [prompt + response - 1 tokens, layers, top-k]; the dense layer 0 is -1
    assert tuple(routed.shape) == (3 + 3 - 1, 2, DEEPSEEK_TINY["num_experts_per_tok"])
    assert (routed[:, 0] == -1).all() and ((routed[:, 1] >= 0) & (routed[:, 1] < 8)).all()
