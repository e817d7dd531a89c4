"""The actor's logprobs are those of the distribution the engine sampled from, at any rollout temperature.

The engines sample at rollout.temperature and return the logprob of each sampled token under softmax(logits / T)
(the embedded engine and SGLang by default; vLLM returns raw, T=1 logprobs unless told otherwise: docs/real_model.md).
The PPO ratio, the rollout-correction weights and rollout/logprob_abs_diff compare the actor's logprobs with the
engine's, so the actor divides its logits by the same T, as verl and slime do. A tiny Llama (the real-model recipe's
family) saved with transformers is loaded by both the embedded engine and a one-rank Megatron actor.
"""

from __future__ import annotations

import pytest
import torch


def _tiny_llama_dir(path) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True, initializer_range=0.2,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(path)
    return str(path)


def _engine_samples(model_dir: str, temperature: float):
    from mcore_rl.controller.samples import samples_to_batch
    from mcore_rl.rollout.engine import HFRolloutEngine

    engine = HFRolloutEngine(model_dir)
    prompts = [[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12]]
    samples = engine.generate(prompts, n=4, temperature=temperature, max_new_tokens=6, seed=0)
    batch, _ = samples_to_batch(samples, 4)
    return batch


def _actor_logprobs(rank: int, world: int, model_dir: str, temperature: float, batch):
    from mcore_rl.actor.megatron_actor import MegatronActor
    from mcore_rl.config import ActorConfig, ModelConfig

    actor = MegatronActor(
        rank, world, ModelConfig(path=model_dir), ActorConfig(world_size=1, logit_temperature=temperature)
    )
    actor.initialize(("127.0.0.1", 0))
    return actor.logprobs(batch).payload


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_actor_logprobs_equal_the_engines_at_the_rollout_temperature(tmp_path, temperature):
    from mcore_rl.parallel.harness import run_on_ranks

    model_dir = _tiny_llama_dir(tmp_path / "llama")
    batch = _engine_samples(model_dir, temperature)
    (actor,) = run_on_ranks(_actor_logprobs, 1, (model_dir, temperature, batch))
    engine = batch.tensors["rollout_logprobs"]
    mask = batch.response_mask.bool()
    diff = (actor - engine).abs()[mask]
    # fp32 on both sides, different kernels (Megatron's local spec vs transformers' eager attention): ~1e-6
    assert diff.max() < 1e-4, f"T={temperature}: actor vs engine logprobs differ by up to {diff.max():.3g}"
    # the check can fail: at T=0.7 the T=1 logprobs are far from the engine's
    assert (engine[mask] < -1e-3).any()


def test_the_first_step_check_refuses_a_mean_difference_above_the_tolerance_naming_the_causes() -> None:
    """check_engine_agrees, the first step's check: the mean absolute difference per response token (padding left
    out) against actor.first_step_logprob_tolerance; above it a ConfigError (exit 2) naming the figure, the likely
    causes and the run's setup; no tolerance or no engine logprobs: no check."""
    from types import SimpleNamespace

    from mcore_rl.config.checks import ConfigError
    from mcore_rl.controller.advantage_stage import check_engine_agrees

    def rollouts(actor: list[list[float]], engine: list[list[float]], mask: list[list[int]], with_engine=True):
        tensors = {"old_logprobs": torch.tensor(actor)}
        if with_engine:
            tensors["rollout_logprobs"] = torch.tensor(engine)
        return SimpleNamespace(batch=SimpleNamespace(tensors=tensors, response_mask=torch.tensor(mask)))

    # the padded position differs by 9 and is left out: the mean over the 3 response tokens is 0.1
    close = rollouts([[-1.0, -2.0], [-1.0, 0.0]], [[-1.1, -2.1], [-1.1, 9.0]], [[1, 1], [1, 0]])
    check_engine_agrees(close, 0.1 + 1e-6, "setup")
    with pytest.raises(ConfigError) as err:
        check_engine_agrees(close, 0.05, "tokenizer=X, actor T=0.5, engine T=1.0")
    message = str(err.value)
    assert message.startswith("step 1: the engine's and the actor's logprobs of the same sampled tokens differ by 0.1")
    for part in ("first_step_logprob_tolerance=0.05", "tokenizer", "actor.logit_temperature", "a weight the push"):
        assert part in message, part
    assert message.endswith("This run: tokenizer=X, actor T=0.5, engine T=1.0")
    check_engine_agrees(close, None, "setup")  # no tolerance: no check
    check_engine_agrees(rollouts([[-1.0]], [], [[1]], with_engine=False), 0.0, "setup")  # no engine logprobs


# The long tier: the check itself is the CI tier's test above, and the actor's temperature the parametrised
# agreement test; this shows the whole default job stopping at step 1 with exit 2 (one run, about 45 s in CI).
@pytest.mark.long
@pytest.mark.slow
def test_a_first_step_whose_engine_samples_another_distribution_stops_the_run(tmp_path):
    """The default job with the actor's temperature set apart from the engine's (0.5 vs 1.0), as a run whose actor
    ignored the rollout temperature was: the first step's logprob check stops it, exit 2, one message naming the
    figure and the likely causes, before any push."""
    import subprocess
    import sys

    from _ray_cluster import ray_address_override, train_env

    run_dir = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "mcore_rl.train", "trainer.steps=2", f"trainer.run_dir={run_dir}", "data.batch_size=4",
        "rollout.n=4", "actor.logit_temperature=0.5", ray_address_override(),
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=train_env())
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert "step 1: the engine's and the actor's logprobs" in out.stderr
    for cause in ("tokenizer", "actor.logit_temperature=0.5", "rollout.temperature=1.0", "a weight the push"):
        assert cause in out.stderr, cause
    assert not (run_dir / "metrics.jsonl").exists() or not (run_dir / "metrics.jsonl").read_text().strip()
