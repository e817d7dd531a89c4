"""R2 routing replay on the actor ranks. Its own module: it sizes its own Ray, which must not meet the module fixture
of the loop tests in tests/test_router_replay.py (a second ray.init fails while that one is up)."""

from __future__ import annotations

import pytest
import ray
import torch
from test_router_replay import HF

from mcore_rl.config import ActorConfig, LayoutConfig, ModelConfig


@pytest.mark.long
@pytest.mark.slow
def test_r2_update_replays_the_routing_recorded_by_the_old_logprob_pass():
    from mcore_rl.actor.batch import TrainBatch
    from mcore_rl.actor.megatron_actor import MegatronActor
    from mcore_rl.controller.actor_group import ActorGroup

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    actor = ActorGroup(
        ModelConfig(hf_config=dict(HF)),
        ActorConfig(
            world_size=2, layout=LayoutConfig(ep=2), router_replay_mode="R2", use_ref=False, num_cpus_per_rank=1
        ),
        "cpu",
    )
    try:
        gen = torch.Generator().manual_seed(0)
        batch = TrainBatch(
            prompts=torch.randint(4, 90, (8, 5), generator=gen).tolist(),
            responses=torch.randint(4, 90, (8, 3), generator=gen),
            response_mask=torch.ones(8, 3),
        )
        before = ActorGroup.gather_dp(actor.call(MegatronActor.router_choices, batch, replay=False))
        actor.call(MegatronActor.logprobs, batch)  # the step's first forward: records

        def reroute(self) -> None:  # what an update does to routing, made large: every router row reversed
            with torch.no_grad():
                for chunk in self.chunks:
                    for name, p in chunk.named_parameters():
                        if name.endswith("mlp.router.weight"):
                            p.copy_(p.flip(0))

        ray.get([h.__ray_call__.remote(reroute) for h in actor.handles])
        after = ActorGroup.gather_dp(actor.call(MegatronActor.router_choices, batch, replay=False))
        # routes as the update's forwards do
        replayed = ActorGroup.gather_dp(actor.call(MegatronActor.router_choices, batch))
        valid = slice(0, 5 + 3 - 1)  # positions whose outputs are read
        assert not torch.equal(after[:, valid], before[:, valid])  # the new weights route differently ...
        assert torch.equal(replayed[:, valid], before[:, valid])  # ... but R2 replays the recorded routing
    finally:
        actor.shutdown()
        ray.shutdown()
