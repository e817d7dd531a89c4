"""One run's machinery, started in order and stopped in reverse, for every loop (the RL loop in train.py, the DPO
loop in controller/dpo_loop.py):

    with RunSession(cfg, tokenizer_dir) as s:  # Ray, placement, actor ranks (+ critic), engines, sync, checkpointer
        state = s.resume(loader)                 # trainer.resume restored; the engines get the actor's weights
        s.push(step, state)                      # after an update: the engines serve version + 1
        log = s.logger(state)                    # metrics.jsonl and trainer.loggers, from the restored step on
        s.close_first(producer.close)            # what the loop started on top: stopped before the engines
        ...the loop...

Start-up order: the actor ranks start building while the engines start (unless they share a device: the placement
says so); the weight sync is planned once both are up. An exception from inside names what died (a rank, the router,
a process Ray's memory monitor killed) instead of Ray's traceback, and on every exit the loop's own closers, the
ranks, the critic, the engines and router, and the placement groups stop, so nothing outlives the run.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from mcore_rl.config import RLConfig
from mcore_rl.metrics.startup import StartupClock


class RunSession:
    """See the module docstring. Attributes are set by `__enter__`: placement, actor, critic (None without
    critic.enable), engines, sync, ckpt."""

    def __init__(self, cfg: RLConfig, tokenizer_dir: str, clock: StartupClock | None = None) -> None:
        """`clock`: the run's start-up clock (metrics/startup.py), which the session's phases lap."""
        self.cfg, self.tokenizer_dir = cfg, tokenizer_dir
        self.clock = clock if clock is not None else StartupClock()
        self.placement: Any = None
        self.actor: Any = None
        self.critic: Any = None
        self.engines: Any = None
        self.sync: Any = None
        self.ckpt: Any = None
        self._closers: list[Callable[[], None]] = []
        self._push_fence: Callable[[], Any] | None = None
        self._started = 0.0

    def __enter__(self) -> RunSession:
        from mcore_rl._quiet import quiet_process
        from mcore_rl.checkpoint.manager import Checkpointer, hf_config_of
        from mcore_rl.controller.actor_group import ActorGroup
        from mcore_rl.controller.critic_group import CriticGroup
        from mcore_rl.controller.engine_pool import EnginePool
        from mcore_rl.controller.placement import init_ray, make_placement
        from mcore_rl.controller.weight_sync import WeightSync

        cfg, clock = self.cfg, self.clock
        self._started = time.time()  # Ray OOM kills before it are another run's
        quiet_process()
        init_ray(cfg)  # trainer.ray_address, or a local Ray sized by what the run's actors reserve
        clock.lap("Ray")
        self.placement = make_placement(cfg)  # split pools, or colocated taking turns (controller/placement.py)
        clock.lap("placement")
        try:
            self.actor = ActorGroup(
                cfg.model, cfg.actor, cfg.trainer.runtime, seed=cfg.trainer.seed, options=self.placement.actor_options
            )  # the ranks start (build, load) while the engines start below, unless they share a device
            if not self.placement.overlap_startup:
                self.actor.ready()
                clock.lap("actor ranks")
            if cfg.critic.enable:
                self.critic = CriticGroup(cfg, options=self.placement.critic_options)
            self.engines = EnginePool(
                cfg.rollout,
                model=cfg.model.path or dict(cfg.model.hf_config),  # the HF checkpoint dir, or the actor's HF config
                tokenizer=self.tokenizer_dir,
                dtype=cfg.model.dtype,
                runtime=cfg.trainer.runtime,
                log_dir=os.path.join(cfg.trainer.run_dir, "rollout"),
                engine_options=self.placement.engine_options,
                return_routed_experts=cfg.actor.router_replay_mode == "R3",  # SGLang answers routed_experts only then
                fp8=cfg.sync.fp8,  # SGLang engines with FP8 parameters for the blockwise e4m3 weights the push sends
                keep_update_buffers=cfg.sync.keep_buffers,  # embedded engines: staging kept between syncs, or freed
            )
            clock.lap("engines and router")
            first = self.engines.engines[0].handle
            if hasattr(first, "startup_s"):  # an embedded engine says where its start-up went
                import ray

                clock.detail("rollout engine 0", ray.get(first.startup_s.remote()))
            self.actor.ready()
            clock.lap("actor ranks (beyond the engines)" if self.placement.overlap_startup else "actor ranks")
            clock.detail("actor rank 0", self.actor.ranks[0].get("startup_s", {}))
            self.sync = WeightSync(
                self.actor, self.engines, cfg.sync, cfg.rollout, cfg.trainer.runtime, cfg.trainer.run_dir,
                hf_config_of(cfg),
            )  # fmt: skip
            clock.lap("weight-sync plan")
            self.ckpt = Checkpointer(cfg)  # trainer.resume: ranks, data position and metric history restored
        except BaseException as err:
            self.__exit__(type(err), err, err.__traceback__)
            raise
        return self

    def resume(self, loader: Any) -> Any:
        """The loop's state: trainer.resume's checkpoint restored into the ranks, the loader and a LoopState (a new
        one without); then the engines get the actor's weights at its version."""
        from mcore_rl.controller.state import LoopState

        state = self.ckpt.resume(self.actor, loader, LoopState(), self.critic)
        self.clock.lap("checkpointer and resume")
        self.placement.sync_weights(self.sync, state.weight_version)
        self.clock.lap("first weight push")
        return state

    def push(self, step: int, state: Any) -> dict[str, float]:
        """The actor's weights to every engine as version `state.weight_version + 1` (after the update of `step`);
        a replaced engine is waited for first. Returns the placement's hand-over metrics. Engines that refuse the
        weights as non-finite mean the update diverged: TrainingDiverged naming the step (exit 1), not a sync error.
        """
        from mcore_rl.actor.megatron_actor import MegatronActor
        from mcore_rl.controller.weight_sync import SyncError
        from mcore_rl.errors import TrainingDiverged

        state.weight_version += 1
        self.engines.wait_for_restarts()
        try:
            with (self._push_fence or contextlib.nullcontext)():
                return self.placement.sync_weights(self.sync, state.weight_version)
        except SyncError as err:
            # The engines refuse NaN/inf weights, but a push reports the first rank's error, which may be another
            # stream's "not sent: an earlier bucket failed": the ranks are asked.
            if "non-finite values" not in str(err) and all(self.actor.call(MegatronActor.weights_finite)):
                raise
            last = ([line.strip() for line in str(err).splitlines() if line.strip()] or [repr(err)])[-1][-300:]
            raise TrainingDiverged(
                f"training diverged at step {step}: the update left the actor's weights non-finite and the engines "
                f"refused them (the push's last error: {last}); expected finite weights: lower actor.optim.lr or "
                f"set actor.optim.clip_grad"
            ) from None

    def logger(self, state: Any) -> Any:
        """The run's MetricsLogger from the restored step on: metrics.jsonl, trainer.loggers, the reward history."""
        from mcore_rl.metrics.logger import MetricsLogger

        t = self.cfg.trainer
        return MetricsLogger(
            os.path.join(t.run_dir, "metrics.jsonl"),
            history=state.rewards,
            loggers=t.loggers,
            total_steps=t.steps,
            first_step=state.step + 1,
            wandb={
                "project": t.project_name,
                "name": t.experiment_name,
                "mode": t.wandb_mode,
                "config": asdict(self.cfg),
            },
            max_nonfinite_steps=t.max_nonfinite_steps,  # a NaN loss stops the run (exit 1)
        )

    def fence_pushes(self, fence: Callable[[], Any]) -> None:
        """Hold the context manager `fence()` over every push after the first (the async producer's push_fence with
        partial rollouts off: no request spans two versions)."""
        self._push_fence = fence

    def close_first(self, close: Callable[[], None]) -> None:
        """Call `close` on exit before anything of the session stops (the loop's producer and its threads)."""
        self._closers.append(close)

    def __exit__(self, kind: Any, err: BaseException | None, tb: Any) -> bool:
        try:
            if isinstance(err, Exception):
                name_what_died(err, self.actor, self.critic, self.engines, self._started)
        finally:  # also on errors: no engine, router or rank outlives the run
            try:
                for close in reversed(self._closers):
                    close()
            finally:
                if self.actor is not None:
                    self.actor.shutdown()
                if self.critic is not None:
                    self.critic.shutdown()
                if self.engines is not None:
                    self.engines.shutdown()
                self.placement.shutdown()
        return False


def name_what_died(err: Exception, actor: Any, critic: Any, engines: Any, since: float) -> None:
    """Raise ProcessDied naming what died, if anything did (`err` chained as its cause): a process Ray's memory
    monitor killed since `since` (an engine, a rank: the cause is only in raylet.out), the router, or actor ranks."""
    from mcore_rl.controller.ray_oom import oom_message, ray_oom_kills
    from mcore_rl.errors import ProcessDied

    kills = ray_oom_kills(since)
    if kills and not isinstance(err, ProcessDied):
        raise ProcessDied(oom_message(kills)) from err
    died = []
    router_died = getattr(getattr(engines, "router", None), "died", None)
    if router_died is not None and router_died():
        died.append(router_died())
    for group in (actor, getattr(critic, "group", None)):
        if group is not None:
            died += group.dead_ranks()
    if died and not isinstance(err, ProcessDied):
        raise ProcessDied("; ".join(died)) from err
