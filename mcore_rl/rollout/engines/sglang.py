"""rollout.engine=sglang: real SGLang servers on GPUs (`python -m sglang.launch_server`: rollout/sglang_launcher.py),
each over rollout.sglang.tp GPUs of rollout.sglang.nnodes nodes, behind sglang-router."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mcore_rl.config.checks import ConfigError, _check
from mcore_rl.rollout.engines.base import EngineKind, EngineShape


class SGLangKind(EngineKind):
    """Real SGLang 0.5.x: one control request at a time per engine, a radix cache flushed after every update."""

    name = "sglang"
    dialect = "sglang"
    embedded = False
    uses_gpu_extra = True

    def shape(self, rollout: Any, runtime: str) -> EngineShape:
        s = rollout.sglang
        dp = s.dp if s.enable_dp_attention else 1
        return EngineShape("rollout.sglang", s.tp, dp, s.ep, s.tp, s.nnodes, "rollout.sglang.mem_fraction_static",
                           s.mem_fraction_static, s.enable_memory_saver)  # fmt: skip

    def unavailable_reason(self, cfg: Any, hf_config: Callable[[], dict[str, Any]]) -> str | None:
        from mcore_rl.rollout.sglang_launcher import sglang_unavailable_reason

        reason = sglang_unavailable_reason()
        return None if reason is None else f"rollout.engine=sglang cannot run here: {reason}"

    def validate_rollout(self, rollout: Any) -> None:
        return None

    def check_run(self, cfg: Any) -> None:
        if (
            cfg.sync.transport == "tensor"
            and cfg.rollout.sglang.nnodes > 1
            and cfg.trainer.placement != "colocated"  # colocated: each engine rank's payload comes from its GPU's rank
        ):
            raise ConfigError(
                "sync.transport='tensor' is invalid with rollout.sglang.nnodes > 1 and trainer.placement=split: the "
                "tensor transport shares memory (or CUDA IPC handles) within one node; expected sync.transport="
                "distributed or disk, or trainer.placement=colocated"
            )

    def complete(self, cfg: Any) -> None:
        return None

    def pause_mode(self, requested: str) -> str:
        if requested == "auto":
            return "abort"
        _check(
            requested in ("abort", "retract"), "sync.pause_mode", requested,
            "abort, retract or auto with rollout.engine=sglang (its radix cache is flushed after every update, "
            "which SGLang does only with no request running)",
        )  # fmt: skip
        return requested

    def update_group_backend(self, runtime: str) -> str:
        return "nccl" if runtime == "cuda" else "gloo"

    def init_group_options(self, timeout_s: float) -> dict[str, Any]:
        return {}  # SGLang's init has no timeout of its own

    def router_class(self) -> type:
        from mcore_rl.rollout.router import Router

        return Router

    def start_engines(self, pool: Any, indices: list[int]) -> list[tuple[str, Any]]:
        return pool.start_sglang_engines(indices)  # Ray actors per engine node, on the placement's bundles

    def nodes_problem(self, rollout: Any) -> str | None:
        sgl = rollout.sglang
        if sgl.tp % sgl.nnodes:
            return (
                f"rollout.sglang.tp={sgl.tp} is invalid with rollout.sglang.nnodes={sgl.nnodes}: expected a multiple "
                "of nnodes (each node of an engine holds tp / nnodes of its GPUs)"
            )
        return None

    def node_gpus_problem(self, rollout: Any, runtime: str, node_gpus: int, gpus_per_node: int) -> str:
        sgl = rollout.sglang
        return (
            f"rollout.sglang.tp={sgl.tp} over rollout.sglang.nnodes={sgl.nnodes} puts {node_gpus} GPUs of an engine "
            f"on one node, which has {gpus_per_node}; expected rollout.sglang.nnodes >= {-(-sgl.tp // gpus_per_node)}"
        )

    def cuda_transport_problem(self, cfg: Any) -> str | None:
        return None
