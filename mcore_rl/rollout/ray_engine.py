"""The rollout engine as a Ray actor: a thin shell around `HFRolloutEngine` for the controller's worker groups.

Ray runs an actor's calls one at a time (default `max_concurrency=1`), which serialises generation and weight
updates: that is the version fence `HFRolloutEngine.update_weights_from_tensors` relies on. Named tensors travel as a
list of `(name, tensor)` pairs (a generator cannot be pickled); weight sync sends one bucket per call.

```
handle = create_rollout_engine_actor(config, num_cpus=1)
samples = ray.get(handle.generate.remote([[1, 2, 3]], n=4, temperature=1.0, max_new_tokens=16, seed=0))
ray.get(handle.update_weights_from_tensors.remote(list(named_tensors)))
```
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import ray
import torch
from transformers import PretrainedConfig

from mcore_rl.rollout.engine import HFRolloutEngine
from mcore_rl.rollout.sampling import Sample


class RolloutEngineWorker:
    """Actor body owning one `HFRolloutEngine`; each method forwards to the engine method of the same name."""

    def __init__(self, model: str | os.PathLike[str] | PretrainedConfig | Mapping[str, Any], **engine_kwargs: Any):
        """Build the engine inside the actor process; `engine_kwargs` go to `HFRolloutEngine`."""
        self.engine = HFRolloutEngine(model, **engine_kwargs)

    def ping(self) -> dict[str, Any]:
        """Liveness check: the actor's pid, device and current weight version."""
        return {"pid": os.getpid(), "device": str(self.engine.device), "weight_version": self.engine.weight_version}

    def generate(
        self,
        prompt_token_ids: list[list[int]],
        n: int = 1,
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_new_tokens: int = 128,
        eos_token_ids: list[int] | tuple[int, ...] = (),
        seed: int | None = None,
    ) -> list[Sample]:
        """See `HFRolloutEngine.generate`."""
        return self.engine.generate(prompt_token_ids, n, temperature, top_p, max_new_tokens, eos_token_ids, seed)

    def logprobs(
        self, sequences: list[list[int]], prompt_lens: list[int], temperature: float = 1.0
    ) -> list[torch.Tensor]:
        """See `HFRolloutEngine.logprobs`."""
        return self.engine.logprobs(sequences, prompt_lens, temperature)

    def load_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        """See `HFRolloutEngine.load_weights`."""
        self.engine.load_weights(named_tensors)

    def update_weights_from_tensors(
        self, named_tensors: list[tuple[str, torch.Tensor]], weight_version: int | None = None
    ) -> int:
        """See `HFRolloutEngine.update_weights_from_tensors`; returns the new weight version."""
        return self.engine.update_weights_from_tensors(named_tensors, weight_version)

    def weight_version(self) -> int:
        """The engine's current weight version (a method: Ray actors expose no properties)."""
        return self.engine.weight_version


RolloutEngineActor = ray.remote(RolloutEngineWorker)
"""`RolloutEngineWorker` as a Ray actor class; prefer `create_rollout_engine_actor` to set resources."""


def create_rollout_engine_actor(
    model: str | os.PathLike[str] | PretrainedConfig | Mapping[str, Any],
    *,
    num_cpus: float = 1,
    num_gpus: float = 0,
    **engine_kwargs: Any,
) -> ray.actor.ActorHandle:
    """Start one rollout engine actor holding `num_cpus` CPUs and `num_gpus` GPUs (pass `device="cuda"` with GPUs)."""
    return RolloutEngineActor.options(num_cpus=num_cpus, num_gpus=num_gpus).remote(model, **engine_kwargs)
