"""What the actor's optimizer is, decided once: the settings the Megatron ranks build and the bytes the dry run counts.

    plan = optimizer_plan(actor_cfg.optim, model_cfg.dtype, runtime)
    ranks:   plan, ddp_chunks, optimizer, scheduler = wrap_ddp_and_optimizer(chunks, optim, dtype, runtime, pg)
             (DistributedDataParallel(.., plan.ddp_config()) ; get_megatron_optimizer(plan.optimizer_config(optim), ..)
             ; lr_scheduler(optimizer, optim)) ... finish_param_gather(ddp_chunks, plan) after each update
    dry run: plan.rank_bytes(params, dp)  (launch/submit.py --dry-run through mcore_rl/models/estimate.py)

Both sides read the same `OptimizerPlan`, so what `--dry-run` prints is what the ranks allocate (a test builds a CPU
actor and counts its parameters, gradient buffers and optimizer state against these figures).

Byte accounting per parameter, as megatron-core 0.16.1 allocates it:
- weights: the model dtype (2 bytes bf16, 4 fp32); a frozen reference copy costs the same again.
- gradients: DDP's contiguous main-grad buffer, fp32 (`grad_reduce_in_fp32`): 4 bytes.
- optimizer: Adam's exp_avg + exp_avg_sq in fp32 (8 bytes), plus an fp32 master copy (4 bytes) when the weights are
  bf16 (Megatron's Float16Optimizer / distributed optimizer keep fp32 masters; fp32 weights are stepped in place).
  The distributed optimizer shards all of it over the parameter's data-parallel group (dense: dp x cp, experts:
  expert dp). `offload_fraction` of it lives on the host (Megatron's HybridDeviceOptimizer), the rest on the GPU.

Overlap (`overlap_grad_reduce`, `overlap_param_gather`: Megatron DDP's settings, as slime and verl's Megatron backend
run them on GPUs): gradient buckets are reduced while the backward goes on (the schedule's `no_sync_func` holds the
reduce back until the last micro-batch), and the distributed optimizer's parameter all-gather after a step runs bucket
by bucket in the forward pre-hooks of the next mini-batch. The last step's gather has no next forward inside the
update: `finish_param_gather` completes it before the update returns, so the weight sync, logprob passes, the
reference swap, checkpoints and offload always read current parameters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mcore_rl.config import ConfigError, OptimConfig

PARAM_BYTES = {"float32": 4, "bfloat16": 2}
GRAD_BYTES = 4  # grad_reduce_in_fp32: main grads and their all-reduce / reduce-scatter in fp32
ADAM_STATE_BYTES = 8  # exp_avg + exp_avg_sq, fp32


@dataclass(frozen=True)
class RankBytes:
    """Bytes one rank allocates for `params` parameters of one data-parallel group."""

    weights: float
    grads: float
    optimizer_device: float  #: Adam state + fp32 masters kept on the accelerator
    optimizer_host: float  #: the offloaded share (host memory)


@dataclass(frozen=True)
class OptimizerPlan:
    """The optimizer and DDP settings of the actor (see the module docstring)."""

    distributed: bool  #: Megatron's distributed optimizer (state sharded over data-parallel ranks)
    offload_fraction: float  #: share of the optimizer state and step on the host
    dtype: str  #: model parameter dtype: float32 | bfloat16
    overlap_grad_reduce: bool = False  #: reduce gradient buckets during the backward (Megatron DDP)
    overlap_param_gather: bool = False  #: gather parameters after a step during the next forward (Megatron DDP)

    @property
    def param_bytes(self) -> int:
        return PARAM_BYTES[self.dtype]

    @property
    def master_bytes(self) -> int:
        """fp32 master copy per parameter: only for 16-bit weights."""
        return 4 if self.param_bytes < 4 else 0

    def rank_bytes(self, params: float, dp: int) -> RankBytes:
        """Bytes of `params` parameters held by this rank whose optimizer is data-parallel over `dp` ranks."""
        state = (ADAM_STATE_BYTES + self.master_bytes) * params / (dp if self.distributed else 1)
        return RankBytes(
            weights=self.param_bytes * params,
            grads=GRAD_BYTES * params,
            optimizer_device=state * (1 - self.offload_fraction),
            optimizer_host=state * self.offload_fraction,
        )

    def describe(self) -> str:
        return (
            f"optimizer: Adam, {'distributed' if self.distributed else 'replicated'} over dp, "
            f"{self.dtype} weights{' + fp32 masters' if self.master_bytes else ''}, fp32 grads"
            + (f", {self.offload_fraction:.0%} of its state on the host" if self.offload_fraction else "")
            + (", grad reduce overlapped" if self.overlap_grad_reduce else "")
            + (", param gather overlapped" if self.overlap_param_gather else "")
        )

    def ddp_config(self) -> Any:
        """Megatron's DistributedDataParallelConfig for these settings."""
        from megatron.core.distributed import DistributedDataParallelConfig

        return DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=self.overlap_grad_reduce,
            overlap_param_gather=self.overlap_param_gather,
            use_distributed_optimizer=self.distributed,
        )

    def optimizer_config(self, optim: OptimConfig) -> Any:
        """Megatron's OptimizerConfig for these settings and `optim`'s Adam hyper-parameters."""
        import torch
        from megatron.core.optimizer import OptimizerConfig

        offload = {}
        if self.offload_fraction:
            from megatron.core.utils import get_te_version

            if get_te_version() is None:  # 0.16.1's precision-aware optimizer (needed by offload) asks TE's version
                raise ConfigError(
                    f"actor.optim.offload_fraction={self.offload_fraction!r} needs Transformer Engine (Megatron's "
                    "precision-aware optimizer), which is not importable here; expected 0"
                )
            # HybridDeviceOptimizer holds the fp32 masters itself: Megatron requires the precision-aware path.
            # overlap_cpu_optimizer_d2h_h2d: the grads' D2H and the updated params' H2D copies run on side streams,
            # parameter group by group, overlapping the CPU Adam step (as slime runs it); off, each step waits for
            # every copy in turn.
            offload = dict(
                optimizer_cpu_offload=True,
                optimizer_offload_fraction=self.offload_fraction,
                use_precision_aware_optimizer=True,
                overlap_cpu_optimizer_d2h_h2d=True,
            )
        return OptimizerConfig(
            optimizer="adam",
            lr=optim.lr,
            min_lr=optim.min_lr,
            weight_decay=optim.weight_decay,
            adam_beta1=optim.adam_beta1,
            adam_beta2=optim.adam_beta2,
            adam_eps=optim.adam_eps,
            clip_grad=optim.clip_grad,
            bf16=self.dtype == "bfloat16",
            params_dtype=getattr(torch, self.dtype),
            use_distributed_optimizer=self.distributed,
            overlap_param_gather=self.overlap_param_gather,  # meant to equal DDP's (0.16.1 reads it for MXFP8 only)
            **offload,
        )


def optimizer_plan(optim: OptimConfig, dtype: str, runtime: str, prefix: str = "actor.optim") -> OptimizerPlan:
    """The plan for a run. Nulls (see OptimConfig): `distributed` and `overlap_grad_reduce` are on for CUDA and off
    for CPU; `overlap_param_gather` is on exactly when the distributed optimizer and the overlapped reduce are."""
    distributed = optim.distributed if optim.distributed is not None else runtime == "cuda"
    if optim.offload_fraction and not distributed:
        raise ConfigError(
            f"{prefix}.offload_fraction={optim.offload_fraction!r} needs {prefix}.distributed=true "
            "(Megatron offloads the distributed optimizer's shards)"
        )
    reduce = optim.overlap_grad_reduce if optim.overlap_grad_reduce is not None else runtime == "cuda"
    gather = optim.overlap_param_gather
    if gather is None:
        gather = distributed and reduce
    elif gather and not (distributed and reduce):
        raise ConfigError(
            f"{prefix}.overlap_param_gather=true needs {prefix}.distributed and {prefix}.overlap_grad_reduce on "
            f"(on trainer.runtime={runtime} they resolve to distributed={distributed}, overlap_grad_reduce={reduce}): "
            "it overlaps the distributed optimizer's all-gather, which Megatron re-arms in the overlapped reduce"
        )
    return OptimizerPlan(
        distributed=distributed,
        offload_fraction=optim.offload_fraction,
        dtype=dtype,
        overlap_grad_reduce=reduce,
        overlap_param_gather=gather,
    )


def wrap_ddp_and_optimizer(
    chunks: list[Any], optim: OptimConfig, dtype: str, runtime: str, pg: Any, prefix: str = "actor.optim"
) -> tuple[OptimizerPlan, list[Any], Any, Any]:
    """(plan, DDP-wrapped chunks, Megatron optimizer, lr scheduler) of a worker's model chunks, as the plan says.

    With overlap_grad_reduce the schedules run every micro-batch but the last under DDP's `no_sync` and start the
    reduce of each chunk after its last backward (`no_sync_func`, `grad_sync_func`, as Megatron's training loop sets
    them); `finalize_model_grads` waits for the reduces."""
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.optimizer import get_megatron_optimizer

    plan = optimizer_plan(optim, dtype, runtime, prefix)
    config = chunks[0].config
    ddp_chunks = [DistributedDataParallel(config, plan.ddp_config(), module=c, pg_collection=pg) for c in chunks]
    for ddp in ddp_chunks:
        ddp.broadcast_params()
    config.finalize_model_grads_func = finalize_model_grads
    if plan.overlap_grad_reduce:
        no_sync = [ddp.no_sync for ddp in ddp_chunks]
        grad_sync = [ddp.start_grad_sync for ddp in ddp_chunks]
        config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
        config.grad_sync_func = grad_sync[0] if len(grad_sync) == 1 else grad_sync
    optimizer = get_megatron_optimizer(
        plan.optimizer_config(optim), ddp_chunks, use_gloo_process_groups=False, pg_collection=pg
    )
    finish_param_gather(ddp_chunks, plan)  # the parameters are current from the start (see finish_param_gather)
    return plan, ddp_chunks, optimizer, lr_scheduler(optimizer, optim)


def finish_param_gather(ddp_chunks: list[Any], plan: OptimizerPlan) -> None:
    """With overlap_param_gather, all-gather what the last optimizer step left to a next forward (collective over the
    distributed optimizer's group; nothing otherwise).

    Megatron (0.16.1) gathers a step's parameters in the forward pre-hooks of the next training forward, bucket by
    bucket, re-armed by the gradient reduce (`finish_grad_sync` clears `param_gather_dispatched`); until then the
    parameters outside this rank's shard are those of the step before. A forced synchronous gather marks every bucket
    as gathered, so forward-only passes after it gather nothing and the next update's first forward does not
    re-gather either."""
    if plan.overlap_param_gather:
        for ddp in ddp_chunks:
            ddp.start_param_sync(force_sync=True)


def lr_scheduler(optimizer: Any, optim: OptimConfig) -> Any:
    """Megatron's OptimizerParamScheduler over `optimizer`: linear warmup from 0, then `lr_decay_style` to min_lr.

    Stepped once after every optimizer step, and once here: optimizer step i (from 1) runs at the schedule's value
    for step i, so warmup's first step already moves the weights (lr / warmup) and step `warmup` runs at the peak.
    Weight decay stays constant.
    """
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    # RLConfig.validate sets lr_decay_steps to the run's optimizer steps; an ActorConfig built alone (tests, tools)
    # may leave it null: the schedule then ends with the warmup.
    decay_steps = optim.lr_decay_steps or optim.lr_warmup_steps + 1
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=optim.lr,
        min_lr=optim.min_lr,
        lr_warmup_steps=optim.warmup_steps(decay_steps),
        lr_decay_steps=decay_steps,
        lr_decay_style=optim.lr_decay_style,
        start_wd=optim.weight_decay,
        end_wd=optim.weight_decay,
        wd_incr_steps=decay_steps,
        wd_incr_style="constant",
    )
    scheduler.step(1)
    return scheduler
