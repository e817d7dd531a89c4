"""rollout.engine=hf: our embedded SGLang-compatible server over transformers (rollout/server.py, engine.py), one per
engine inside the engine's own Ray actor (controller/engine_pool.py EmbeddedEngineActor), on CPU or one GPU."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mcore_rl.config.checks import _check
from mcore_rl.rollout.engines.base import EngineKind, EngineShape


class EmbeddedKind(EngineKind):
    """Our embedded server: one rank, always available, staging a weight update and committing it between two decode
    steps (so generation need not pause for a push)."""

    name = "hf"
    dialect = "hf"
    embedded = True
    uses_gpu_extra = False
    #: rollout.latency_model_s_per_token: its engine can sleep through a decode step instead of running the model
    #: (rollout/engine.py HFRolloutEngine.forward), a model of a GPU engine; kinds without this attribute cannot
    models_latency = True

    def shape(self, rollout: Any, runtime: str) -> EngineShape:
        gpus = 1 if runtime == "cuda" else 0
        return EngineShape("rollout", 1, 1, 1, gpus, 1, "", 0.0, True)

    def unavailable_reason(self, cfg: Any, hf_config: Callable[[], dict[str, Any]]) -> str | None:
        return None

    def validate_rollout(self, rollout: Any) -> None:
        # the embedded server refuses a request with more samples than it decodes together
        for key, n in (("rollout.n", rollout.n), ("rollout.val_n", rollout.val_n)):
            _check(
                not isinstance(n, int) or n <= rollout.max_running_requests, key, n,
                f"at most rollout.max_running_requests={rollout.max_running_requests}, the sequences the embedded "
                f"server decodes at once (its --max-running-requests): one prompt's {key.split('.')[1]} samples "
                "run together; raise rollout.max_running_requests (verl: actor_rollout_ref.rollout.max_num_seqs)",
            )  # fmt: skip

    def check_run(self, cfg: Any) -> None:
        return None

    def complete(self, cfg: Any) -> None:
        return None

    def pause_mode(self, requested: str) -> str:
        return "none" if requested == "auto" else requested

    def update_group_backend(self, runtime: str) -> str:
        return "nccl" if runtime == "cuda" else "gloo"

    def init_group_options(self, timeout_s: float) -> dict[str, Any]:
        return {"timeout_s": timeout_s}  # our server also takes the broadcast timeout (SGLang has none)

    def router_class(self) -> type:
        from mcore_rl.rollout.router import Router

        return Router

    def start_engines(self, pool: Any, indices: list[int]) -> list[tuple[str, Any]]:
        return pool.start_embedded_engines(indices)  # the server's Ray actor body lives with the pool

    def nodes_problem(self, rollout: Any) -> str | None:
        return None

    def cuda_transport_problem(self, cfg: Any) -> str | None:
        return None
