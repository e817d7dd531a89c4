"""The PPO critic through Ray: the role-agnostic Megatron worker as a critic group with its own layout (TP=2 with
sequence parallelism, where the actor's default is EP=2), initialised from an HF checkpoint.

Its values equal a hand computation from transformers' final hidden states and the head's weight; GAE on them equals
the hand-computed advantage; one update moves the values towards the returns.

Run: `.venv/bin/pytest tests/test_critic.py`
"""

from __future__ import annotations

import pytest
import ray
import torch
from tiny_models import tiny_qwen3_moe_transformers

from mcore_rl.actor.batch import TrainBatch
from mcore_rl.actor.megatron_actor import MegatronActor
from mcore_rl.algorithms import masked_whiten
from mcore_rl.config import AlgorithmConfig, CriticConfig, LayoutConfig, ModelConfig, OptimConfig
from mcore_rl.controller.actor_group import ActorGroup
from mcore_rl.controller.advantage_stage import AdvantageStage
from mcore_rl.controller.producer import Rollouts

pytestmark = pytest.mark.slow

PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]
RESPONSES = [[20, 21, 22], [23], [24, 25], [26, 27, 28]]
SCORES = torch.tensor([1.0, 0.0, 0.5, 1.0])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(tiny_qwen3_moe_transformers(initializer_range=0.2)).eval()
    path = tmp_path_factory.mktemp("hf")
    model.save_pretrained(path, safe_serialization=True)
    return str(path), model


@pytest.fixture(scope="module")
def critic(checkpoint):
    ray.init(address="local", num_cpus=3, include_dashboard=False, log_to_driver=False)
    layout = LayoutConfig(tp=2, sequence_parallel=True)
    cfg = CriticConfig(
        enable=True, world_size=2, layout=layout, mini_batches=1, optim=OptimConfig(lr=1e-3), cliprange_value=None
    )
    group = ActorGroup(ModelConfig(path=checkpoint[0]), cfg, "cpu", role="critic")
    yield group
    group.shutdown()
    ray.shutdown()


def _batch() -> TrainBatch:
    longest = max(map(len, RESPONSES))
    responses = torch.zeros(len(RESPONSES), longest, dtype=torch.long)
    mask = torch.zeros(len(RESPONSES), longest)
    for i, r in enumerate(RESPONSES):
        responses[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1.0
    return TrainBatch([list(p) for p in PROMPTS], responses, mask, {})


def _head_weights(group: ActorGroup) -> list[torch.Tensor]:
    def read(self):  # noqa: ANN001, ANN202
        return self.chunks[-1].output_layer.weight.detach().clone()

    return ray.get([h.__ray_call__.remote(read) for h in group.handles])


def test_values_and_gae_equal_a_hand_computation(critic, checkpoint):
    _, hf_model = checkpoint
    weights = _head_weights(critic)
    torch.testing.assert_close(weights[0], weights[1], rtol=0, atol=0)  # replicated over TP, never sharded
    head = weights[0][0]
    batch = _batch()
    values = ActorGroup.gather_dp(critic.call(MegatronActor.values, batch))

    expected = torch.zeros_like(values)
    with torch.no_grad():
        for i, (prompt, response) in enumerate(zip(PROMPTS, RESPONSES)):
            hidden = hf_model.model(input_ids=torch.tensor([prompt + response])).last_hidden_state[0]
            for j in range(len(response)):
                # V(prompt + response[:j]) sits where response token j is predicted: position len(prompt) + j - 1.
                expected[i, j] = hidden[len(prompt) + j - 1] @ head
    torch.testing.assert_close(values, expected, rtol=1e-4, atol=1e-5)

    # GAE with gamma = lam = 1 and the reward on the last token: A_t = score - V_t, returns = score.
    batch.tensors.update(old_logprobs=torch.zeros_like(values), rollout_logprobs=torch.zeros_like(values))
    batch.tensors["values"] = values
    rollouts = Rollouts([{}] * 4, [], SCORES, batch, torch.arange(4))
    AdvantageStage(AlgorithmConfig(adv_estimator="gae", gamma=1.0, lam=1.0), {}).compute(rollouts)
    mask = batch.response_mask
    torch.testing.assert_close(batch.tensors["returns"], SCORES.unsqueeze(-1) * mask)
    hand = masked_whiten((SCORES.unsqueeze(-1) - values) * mask, mask)
    torch.testing.assert_close(batch.tensors["advantages"], hand, rtol=1e-5, atol=1e-6)


def test_an_update_moves_the_values_towards_the_returns(critic):
    batch = _batch()
    values = ActorGroup.gather_dp(critic.call(MegatronActor.values, batch))
    mask = batch.response_mask
    returns = (values + 1.0) * mask
    batch.tensors.update(values=values, returns=returns)
    metrics = ActorGroup.gather_dp(critic.call(MegatronActor.update, batch))
    assert all(m["critic/update_ok"] == 1.0 for m in metrics)
    after = ActorGroup.gather_dp(critic.call(MegatronActor.values, batch))
    before_err = float((((values - returns) * mask) ** 2).sum())
    after_err = float((((after - returns) * mask) ** 2).sum())
    assert after_err < 0.9 * before_err
