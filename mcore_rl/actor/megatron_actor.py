"""One rank of a Megatron worker group. The role is a parameter: "actor" (policy with Megatron's DDP and optimizer, and
a frozen colocated reference) or "critic" (the same family's model with a scalar value head, actor/value_head.py, its
own layout, optimizer and LR). Each group is its own torch.distributed world, so the critic's layout is its own.

Every rank of the actor group runs the same calls in step (the controller calls them together through Ray):

    logprobs(batch)   -> forward through Megatron's pipeline schedule, per-token logprobs of the responses
    values(batch)     -> critic: per-token values V(s_t) of the responses
    update(batch)     -> PPO-clip / GRPO loss over mini-batches, backward, finalize grads, optimizer step
    sync_send(...)    -> this rank's part of the weight-sync plan: TP/ETP gather per bucket, HF layout, to the
                         engines (actor/sync_sender.py, resharding/sync/)

Each rank receives the whole batch and keeps its data-parallel shard; results come back from the ranks that hold
them (last pipeline stage, tp/cp rank 0) tagged with their dp rank.
"""

from __future__ import annotations

import logging
import math
import os
import pickle
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from mcore_rl.actor.batch import (
    MicroBatch,
    TrainBatch,
    balanced_shard,
    dynamic_micro_batches,
    micro_batches,
    sequence_length,
)
from mcore_rl.actor.logprobs import ResponseHead, narrowable_output_layer, response_logprobs
from mcore_rl.actor.model_setup import hf_config_dict, load_hf, megatron_overrides
from mcore_rl.actor.packing import packed_micro_batches, packed_seq_params, unpack_rows
from mcore_rl.actor.rank_stats import step_rank_metrics, timed
from mcore_rl.actor.runtime import layout_problem, rank_device, threads_per_rank, to_host
from mcore_rl.actor.schedule import run_schedule
from mcore_rl.actor.step_losses import policy_loss, sum_metrics, value_loss
from mcore_rl.config import ActorConfig, ModelConfig
from mcore_rl.models.base import HFConfig

if TYPE_CHECKING:
    from mcore_rl.actor.sync_sender import PushRequest
from mcore_rl.models.builder import ModelSpec, build_gpt_chunks
from mcore_rl.parallel.cpu_runtime import mode_suspended
from mcore_rl.parallel.groups import init_distributed, initialize_model_parallel

log = logging.getLogger(__name__)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
ROLES = ("actor", "critic")
"""What a worker group can be: the policy (with its frozen reference) or the PPO critic."""


@dataclass
class RankResult:
    """What one rank returns from a batched call: its dp rank, and the payload if it holds the output."""

    rank: int
    dp_rank: int
    holds_output: bool
    payload: Any = None


class MegatronActor:
    """A Megatron actor rank. Construct one per rank (as a Ray actor); all ranks call the same methods in step."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        model_cfg: ModelConfig,
        actor_cfg: ActorConfig,
        runtime: str = "cpu",
        seed: int = 0,
        role: str = "actor",
    ) -> None:
        """`actor_cfg` is the role's config: ActorConfig ("actor") or CriticConfig ("critic")."""
        if role not in ROLES:
            raise ValueError(f"unknown worker role {role!r}; known: {', '.join(ROLES)}")
        torch.set_num_threads(threads_per_rank(runtime, reserved=actor_cfg.num_cpus_per_rank))
        self.rank, self.world_size, self.runtime, self.seed = rank, world_size, runtime, seed
        self.cfg, self.model_cfg, self.role = actor_cfg, model_cfg, role
        self._ref_seconds: float | None = None  # this step's reference pass, for timing_s/ref (actor/rank_stats.py)
        from mcore_rl.metrics.startup import process_start

        # Where this rank's start-up went (the run's startup.json): Ray's worker start and the imports up to here
        self._startup: dict[str, float] = {"worker start + imports": time.time() - process_start()}
        self._startup_mark = time.time()

    def _startup_lap(self, name: str) -> None:
        now = time.time()
        self._startup[name] = now - self._startup_mark
        self._startup_mark = now

    def rendezvous_address(self) -> tuple[str, int]:
        """This rank's rendezvous host (loopback in a one-node run: parallel/groups.rendezvous_host) and a port free
        on it: asked of rank 0, which hosts torch.distributed's store."""
        from mcore_rl.parallel.groups import free_port, rendezvous_host

        host = rendezvous_host()
        return host, free_port(host)

    def initialize(self, address: tuple[str, int]) -> None:
        """Join the process group at rank 0's address (host, port), build the model(s) and the optimizer (all ranks
        together)."""
        master_addr, master_port = address
        runtime, actor_cfg, model_cfg = self.runtime, self.cfg, self.model_cfg
        self._startup_lap("waiting for rank 0's address")
        init_distributed(runtime, self.rank, self.world_size, master_addr, master_port)
        self._startup_lap("process group")
        self.device = rank_device(runtime)
        self.layout = actor_cfg.layout.to_layout()
        from mcore_rl.models.spec import te_in_use

        problem = layout_problem(self.role, self.layout.cp, runtime, te_in_use(runtime))  # pre-flight refuses it too
        if problem:
            raise ValueError(problem)
        # routing replay is the policy's (actor.router_replay_mode); a critic routes by its own logits
        self.routing_mode = getattr(actor_cfg, "router_replay_mode", "disabled")
        config, self._unread = hf_config_dict(model_cfg, announce=self.rank == 0)
        hf = HFConfig(config)
        self.spec = ModelSpec(
            hf,
            self.layout,
            runtime=runtime,
            dtype=DTYPES[model_cfg.dtype],
            make_vocab_size_divisible_by=model_cfg.make_vocab_size_divisible_by,
            # RLConfig.validate fills it in (prompt + response); a ModelConfig built by hand: the model's context
            max_sequence_length=model_cfg.max_sequence_length or int(config.get("max_position_embeddings", 4096)),
            config_overrides=megatron_overrides(actor_cfg, self.routing_mode),
        )
        self.pg = initialize_model_parallel(self.layout, seed=model_cfg.init_seed)
        self.vocab_size = hf.req("vocab_size")
        self.weight_map = self.spec.weight_map()
        # Same default-generator seed on every data-parallel replica: parameters not initialised under one of
        # Megatron's forked RNG streams must still agree across DP (broadcast_params below makes sure of it).
        torch.manual_seed(model_cfg.init_seed + 100 * self.pg.pp.rank())
        self._startup_lap("Megatron's groups and the model spec")
        self.chunks, self.contexts = build_gpt_chunks(self.spec, self.pg)
        self._startup_lap("model build")
        path = (getattr(actor_cfg, "path", None) or model_cfg.path) if self.role == "critic" else model_cfg.path
        if path:
            load_hf(self, path)
            self._startup_lap("checkpoint load")
        if self.role == "critic":
            from mcore_rl.actor.value_head import attach_value_heads

            attach_value_heads(self.chunks, self.pg, seed=model_cfg.init_seed + 7)
        from mcore_rl.actor.optimizer import wrap_ddp_and_optimizer

        self.optim_plan, self.ddp_chunks, self.optimizer, self.lr_scheduler = wrap_ddp_and_optimizer(
            self.chunks, self.cfg.optim, self.model_cfg.dtype, self.runtime, self.pg, f"{self.role}.optim"
        )
        self._startup_lap("DDP and optimizer")
        self.response_head = True  #: the output layer computes logits at response positions only (_response_head)
        self.routing = None  # actor/router_replay.py: R2 / R3 routing replay of the policy's forwards
        if self.routing_mode != "disabled":
            from mcore_rl.actor.router_replay import ActorRouting, RouterReplayDriver

            driver = RouterReplayDriver(self.ddp_chunks, self.pg.tp, self.layout.sequence_parallel)
            self.routing = ActorRouting(self.routing_mode, driver, hf.req("num_hidden_layers"), self.pg.dp)
        self.reference = None  # actor/reference.py: the frozen reference, resident or swapped in from the host
        if self.role == "actor" and actor_cfg.use_ref:
            from mcore_rl.actor.reference import build_reference, resolve_placement

            self.reference = build_reference(
                self, resolve_placement(getattr(actor_cfg, "ref_placement", None), runtime)
            )
            self._startup_lap("reference")

    @property
    def ref_chunks(self) -> list[torch.nn.Module]:
        """The resident reference's own model chunks; none without a reference or with it on the host."""
        return getattr(self.reference, "chunks", [])

    # ----------------------------------------------------------------------------------------------- set-up
    # ------------------------------------------------------------------------------------------ queries
    def call_packed(self, method: str, packed: bytes) -> Any:
        """`method(*args, **kwargs)`, the arguments pickled by the controller (`ActorGroup.call`)."""
        args, kwargs = pickle.loads(packed)
        return getattr(self, method)(*args, **kwargs)

    def ping(self) -> dict[str, Any]:
        """Where this rank sits (for the controller's logs and tests)."""
        return {
            "rank": self.rank,
            "dp_rank": self.pg.dp.rank(),
            "tp_rank": self.pg.tp.rank(),
            "pp_rank": self.pg.pp.rank(),
            "ep_rank": self.pg.ep.rank(),
            "layout": self.layout.describe(),
            "device_name": torch.cuda.get_device_name() if self.runtime == "cuda" else None,  # for MFU
            "startup_s": dict(self._startup),  # where this rank's start-up went, phase by phase
        }

    @property
    def _holds_output(self) -> bool:
        return self.pg.pp.rank() == self.pg.pp.size() - 1 and self.pg.tp.rank() == 0 and self.pg.cp.rank() == 0

    def _result(self, payload: Any) -> RankResult:
        """What goes back to the driver: host tensors only (runtime.to_host), from the ranks that hold the output."""
        held = to_host(payload) if self._holds_output else None
        return RankResult(self.rank, self.pg.dp.rank(), self._holds_output, held)

    # ------------------------------------------------------------------------------------------ forward
    def _run_schedule(self, chunks: list, mbs: list[MicroBatch], seq_len: int, loss_fn, forward_only: bool):
        def forward_step(data_iterator: Iterator[MicroBatch], model: torch.nn.Module):
            mb = next(data_iterator)
            if self.routing is not None and self.routing.action:
                self.routing.before(model, mb)
            # packed (THD) micro-batches: TE's attention keeps the sequences of the row apart (actor/packing.py)
            packed = {"packed_seq_params": packed_seq_params(mb)} if mb.packed_seq else {}
            head = self._response_head(model, mb)
            with head:
                output = model(input_ids=mb.tokens, position_ids=mb.position_ids, attention_mask=None, **packed)
            if self.routing is not None and self.routing.action:
                self.routing.after(model, mb)
            seen = head.micro_batch(mb)  # the logits' rows: the response positions' only, when the head narrowed
            return output, lambda logits: loss_fn(seen, self._tempered(logits))

        return run_schedule(chunks, forward_step, mbs, seq_len, mbs[0].tokens.shape[0], self.pg, forward_only)

    def _response_head(self, model: torch.nn.Module, mb: MicroBatch) -> ResponseHead:
        """The output layer narrowed to the positions that predict response tokens for this forward, where that is
        exact (actor/logprobs.py ResponseHead: the policy's logits, no sequence parallelism, context parallelism,
        MTP or packing); else a no-op. `self.response_head = False` turns it off (tests compare both)."""
        narrow = self.response_head and self.role == "actor" and mb.packed_seq is None and self.pg.cp.size() == 1
        return ResponseHead(narrowable_output_layer(model) if narrow else None, mb.gather_index)

    def _tempered(self, logits: torch.Tensor) -> torch.Tensor:
        """The policy's logits / actor.logit_temperature, so its logprobs, ratios and entropy are those of the
        distribution the engines sampled (and reported logprobs) from. In place, as verl: a second full-vocabulary
        tensor would be the largest activation of the step; the output layer's backward does not read its output."""
        temperature = getattr(self.cfg, "logit_temperature", None)  # the critic's output is values: never scaled
        if self.role != "actor" or temperature is None or temperature == 1.0:
            return logits
        return logits.div_(temperature)

    def _response_logprobs(self, mb: MicroBatch, logits: torch.Tensor) -> torch.Tensor:
        return unpack_rows(mb, response_logprobs(logits, mb.targets, mb.gather_index, self.vocab_size, self.pg.tp))

    @torch.no_grad()
    def logprobs(self, batch: TrainBatch, use_ref: bool = False) -> RankResult:
        """Per-token logprobs [B_dp, R] of this rank's dp shard (policy, or the frozen reference)."""
        shard = self._dp_shard(batch)
        if not use_ref:
            return self._result(self._shard_logprobs(self.ddp_chunks, shard, True, sequence_length(batch)))
        return self._result(self._ref_logprobs(shard, sequence_length(batch)))

    def _ref_logprobs(self, shard: TrainBatch, min_seq_len: int) -> torch.Tensor | None:
        """The frozen reference's logprobs of `shard` (its weights swapped in for the pass when they live on the host:
        actor/reference.py)."""
        if self.reference is None:
            raise RuntimeError("actor.use_ref=false: there is no reference model")
        with self.reference.weights_in(self) as chunks:
            return self._shard_logprobs(chunks, shard, False, min_seq_len)

    @torch.no_grad()
    def policy_and_ref_logprobs(self, batch: TrainBatch) -> RankResult:
        """Policy and reference logprobs of this rank's dp shard, stacked [B_dp, 2, R]: one call (one round trip, one
        transfer of the batch) for both forward passes."""
        shard = self._dp_shard(batch)
        old = self._shard_logprobs(self.ddp_chunks, shard, True, sequence_length(batch))
        ref, self._ref_seconds = timed(lambda: self._ref_logprobs(shard, sequence_length(batch)), self.device)
        return self._result(torch.stack([old, ref], dim=1) if old is not None else None)

    def _dp_shard(self, batch: TrainBatch) -> TrainBatch:
        batch.tensors["sample_index"] = torch.arange(batch.size)  # the sample's identity for R2 routing replay
        return batch.shard(self.pg.dp.rank(), self.pg.dp.size())

    def _shard_logprobs(self, chunks: list, shard: TrainBatch, policy: bool, min_seq_len: int) -> torch.Tensor | None:
        """Logprobs of `shard` through `chunks`; `policy`: the policy's forward (routing replay records/replays it,
        the frozen reference always routes by its own logits)."""
        for chunk in chunks:
            chunk.eval()
        size = self.cfg.logprob_micro_batch_size or self.cfg.micro_batch_size
        with mode_suspended():  # see update()
            if getattr(self.cfg, "packing", False):
                mbs = packed_micro_batches(
                    shard, size, self._pad_multiple, self.cfg.max_tokens_per_microbatch, self.device
                )
                seq_len = max(mb.tokens.shape[1] for mb in mbs)
            else:
                mbs, seq_len = micro_batches(
                    shard, size, self._pad_multiple, self.cfg.max_tokens_per_microbatch,
                    min_seq_len,  # one length on every dp rank (the CPU MoE dispatcher gathers one shape)
                    device=self.device,
                )  # fmt: skip

        def loss_fn(mb: MicroBatch, logits: torch.Tensor):
            logp = self._response_logprobs(mb, logits) * mb.response_mask
            return logits.new_zeros(()), {"logprobs": logp}

        routed = self.routing is not None and policy
        if routed:
            self.routing.begin("logprobs")
        try:
            outputs = self._run_schedule(chunks, mbs, seq_len, loss_fn, forward_only=True)
        finally:
            if routed:
                self.routing.end()
        return torch.cat([o["logprobs"] for o in outputs]) if outputs else None

    @torch.no_grad()
    def values(self, batch: TrainBatch) -> RankResult:
        """Critic: per-token values [B_dp, R] of this rank's dp shard (0 on padding)."""
        from mcore_rl.actor.value_head import response_values

        for chunk in self.ddp_chunks:
            chunk.eval()
        shard = batch.shard(self.pg.dp.rank(), self.pg.dp.size())
        mbs, seq_len = micro_batches(
            shard, self.cfg.micro_batch_size, self._pad_multiple, self.cfg.max_tokens_per_microbatch,
            sequence_length(batch), device=self.device,  # one length on every dp rank
        )  # fmt: skip

        def loss_fn(mb: MicroBatch, output: torch.Tensor):
            values = unpack_rows(mb, response_values(output, mb.gather_index))
            return output.new_zeros(()), {"values": values * mb.response_mask}

        outputs = self._run_schedule(self.ddp_chunks, mbs, seq_len, loss_fn, forward_only=True)
        return self._result(torch.cat([o["values"] for o in outputs]) if outputs else None)

    @torch.no_grad()
    def forward_logits(self, tokens: torch.Tensor) -> RankResult:
        """Full-vocabulary logits [B_dp, T, vocab] of this rank's dp shard of `tokens` (actor/diagnostics.py)."""
        from mcore_rl.actor.diagnostics import forward_logits

        return self._result(forward_logits(self, tokens))

    @torch.no_grad()
    def router_choices(self, batch: TrainBatch, replay: bool = True) -> RankResult:
        """The experts the policy's routers choose per token, int32 [B_dp, T, layers, k] (actor/diagnostics.py)."""
        from mcore_rl.actor.diagnostics import router_choices

        return self._result(router_choices(self, batch, replay))

    @property
    def _pad_multiple(self) -> int:
        return self.layout.tp if self.layout.sequence_parallel else 1

    # ------------------------------------------------------------------------------------------- update
    def update(self, batch: TrainBatch) -> RankResult:
        """PPO-clip update over `actor.mini_batches` mini-batches x `actor.ppo_epochs`; returns mean metrics."""
        return self._result(self._update(batch))

    def logprobs_and_update(self, batch: TrainBatch, use_ref: bool = False) -> RankResult:
        """`logprobs` (and the reference's with `use_ref`), then `update`, in one call: one round trip and one transfer
        of the batch instead of two, for steps whose advantages do not read old logprobs (the controller decides).

        The pass is the one `logprobs` runs (same shard, micro-batches and weights, before the first optimizer step),
        so the update sees the same old logprobs to the bit. Each rank passes its own dp shard; the update's
        mini-batches cut the batch differently, so the shards are all-gathered over dp (one collective, B x R floats)
        on the ranks that run the loss. Payload: {"metrics", "old_logprobs" and "ref_logprobs" of this rank's shard,
        "logprob_seconds"}."""
        start = time.perf_counter()
        shard = self._dp_shard(batch)
        skip = self._old_pass_redundant
        with torch.no_grad():
            old = None if skip else self._shard_logprobs(self.ddp_chunks, shard, True, sequence_length(batch))
            ref = None
            if use_ref:
                ref, self._ref_seconds = timed(lambda: self._ref_logprobs(shard, sequence_length(batch)), self.device)
        for key, value in (("old_logprobs", old), ("ref_logprobs", ref)):
            if value is not None:  # the last pipeline stage, where the loss runs
                whole = value.new_empty((value.shape[0] * self.pg.dp.size(), *value.shape[1:]))
                torch.distributed.all_gather_into_tensor(whole, value.contiguous(), group=self.pg.dp)
                batch.tensors[key] = whole
        seconds = time.perf_counter() - start
        self.update_old_logprobs = [] if skip else None  # filled by the update's loss (actor/step_losses.py)
        try:
            metrics = self._update(batch)
            if skip and self.update_old_logprobs:  # the last pipeline stage: this rank's shard, in its order
                old = self._shard_order(self.update_old_logprobs, batch.size)
        finally:
            self.update_old_logprobs = None
        return self._result({"metrics": metrics, "old_logprobs": old, "ref_logprobs": ref, "logprob_seconds": seconds})

    def _shard_order(self, parts: list[tuple[torch.Tensor, torch.Tensor]], size: int) -> torch.Tensor:
        """The update's old logprobs (sample index, rows) per micro-batch -> this rank's contiguous dp shard in batch
        order, as the logprob pass returns it. Dynamic batching sorts samples by length and balances the shards by
        tokens, so a rank's micro-batches hold other ranks' samples: the rows are all-gathered over dp first."""
        index = torch.cat([i for i, _ in parts]).to(self.device)
        rows = torch.cat([r for _, r in parts])
        dp = self.pg.dp.size()
        if dp > 1 and getattr(self.cfg, "dynamic_batching", False):  # every rank holds size / dp samples
            all_index = index.new_empty(index.shape[0] * dp)
            torch.distributed.all_gather_into_tensor(all_index, index.contiguous(), group=self.pg.dp)
            all_rows = rows.new_empty((rows.shape[0] * dp, *rows.shape[1:]))
            torch.distributed.all_gather_into_tensor(all_rows, rows.contiguous(), group=self.pg.dp)
            index, rows = all_index, all_rows
        whole = rows.new_zeros((size, *rows.shape[1:]))
        whole[index] = rows
        per = size // dp
        start = self.pg.dp.rank() * per
        return whole[start : start + per]

    @property
    def _old_pass_redundant(self) -> bool:
        """Whether the old-logprob pass can be skipped: with one mini-batch and one epoch the update's own forward
        runs on the weights the pass would, over the same dp shard in the same order, so its detached logprobs are
        the old ones and the PPO ratio is 1 by construction (TRL skips the pass too). The controller calls
        logprobs_and_update only when no KL penalty or rollout correction reads old logprobs before the update. Not
        with routing replay (R2 replays the pass's routing) or packing (rows differ). With dynamic batching the
        update's micro-batches sort the samples by length; their logprobs go back to batch order (_shard_order)."""
        cfg = self.cfg
        return (
            self.role == "actor" and getattr(cfg, "skip_redundant_logprob_pass", False)
            and cfg.mini_batches == 1 and cfg.ppo_epochs == 1 and self.routing is None
            and not getattr(cfg, "packing", False)
        )  # fmt: skip

    def _update(self, batch: TrainBatch) -> dict[str, float]:
        for chunk in self.ddp_chunks:
            chunk.train()
        dp_rank, dp_size = self.pg.dp.rank(), self.pg.dp.size()
        totals: dict[str, float] = {}
        steps = 0
        batch.tensors["sample_index"] = torch.arange(batch.size)
        if self.routing is not None:
            self.routing.begin("update")
        for _ in range(self.cfg.ppo_epochs):
            for mini in batch.chunks(self.cfg.mini_batches):
                # Loss normaliser over the whole mini-batch (every dp rank), so micro-batch losses add up to the
                # mini-batch loss. x dp: Megatron's DDP averages gradients over dp, we want their sum.
                tokens = float(mini.response_mask.sum())
                denominator = tokens if self.cfg.loss_agg_mode == "token-mean" else float(mini.size)
                # Building micro-batches is ~5 small torch ops per sample, all on the CPU: the CPU runtime's
                # device-rewriting mode would add a Python call to each (measured: 7.6 ms vs 1.4 ms for 64 samples).
                with mode_suspended():
                    mbs, seq_len = self._update_micro_batches(mini, dp_rank, dp_size)
                scale = dp_size * len(mbs)

                def loss_fn(mb: MicroBatch, logits: torch.Tensor, denominator=denominator, scale=scale):
                    if self.role == "critic":
                        return value_loss(self, mb, logits, denominator, scale)
                    return policy_loss(self, mb, logits, denominator, scale)

                for chunk in self.ddp_chunks:
                    chunk.zero_grad_buffer()
                self.optimizer.zero_grad()
                outputs = self._run_schedule(self.ddp_chunks, mbs, seq_len, loss_fn, forward_only=False)
                lr = float(self.optimizer.param_groups[0]["lr"])
                ok, grad_norm, _ = self.optimizer_step()
                self.lr_scheduler.step(1)  # the lr of the next optimizer step
                metrics = sum_metrics(outputs)
                metrics[f"{self.role}/grad_norm"] = float(grad_norm) if grad_norm is not None else math.nan
                metrics[f"{self.role}/update_ok"] = float(bool(ok))
                metrics[f"{self.role}/lr"] = lr
                for key, value in metrics.items():
                    totals[key] = totals.get(key, 0.0) + value
                steps += 1
        if self.routing is not None:
            self.routing.end()
        self.params_current()
        metrics = {k: v / steps for k, v in totals.items()}
        if self.role == "actor":  # verl's timing_s/ref and perf/max_memory_*, max over ranks (a collective)
            metrics.update(step_rank_metrics(self.device, self._ref_seconds))
            self._ref_seconds = None
        return metrics

    def _update_micro_batches(self, mini: TrainBatch, dp_rank: int, dp_size: int) -> tuple[list[MicroBatch], int]:
        """The update's micro-batches of this rank's shard of `mini`. actor.dynamic_batching: shards balanced by tokens
        (not with R2 routing replay, which replays per rank what that rank recorded) and micro-batches by real length
        (actor/batch.py); else contiguous shards, every micro-batch padded to the mini-batch's longest sample."""
        cfg = self.cfg
        if getattr(cfg, "packing", False):
            shard = mini.shard(dp_rank, dp_size)
            mbs = packed_micro_batches(shard, cfg.micro_batch_size, self._pad_multiple, cfg.max_tokens_per_microbatch,
                                       self.device)  # fmt: skip
            return mbs, max(mb.tokens.shape[1] for mb in mbs)
        if getattr(cfg, "dynamic_batching", False):
            balanced = self.routing is None or self.routing_mode != "R2"
            shard = balanced_shard(mini, dp_rank, dp_size) if balanced else mini.shard(dp_rank, dp_size)
            mbs = dynamic_micro_batches(
                shard, cfg.micro_batch_size, self._pad_multiple, cfg.max_tokens_per_microbatch, self.device
            )
            return mbs, max(mb.tokens.shape[1] for mb in mbs)
        return micro_batches(
            mini.shard(dp_rank, dp_size), cfg.micro_batch_size, self._pad_multiple, cfg.max_tokens_per_microbatch,
            sequence_length(mini), device=self.device,  # one length on every dp rank
        )  # fmt: skip

    def optimizer_step(self) -> tuple[bool, float | None, int | None]:
        """Megatron's optimizer step (clip, step, copy back) outside the CPU runtime's per-op mode (see
        `mode_suspended`): (update ok, grad norm, zeros in grads)."""
        with mode_suspended():
            return self.optimizer.step()

    def dpo_update(self, batch: TrainBatch, beta: float, loss_type: str) -> RankResult:
        """DPO update on interleaved chosen/rejected pairs carrying "ref_logprobs" (actor/dpo_step.py)."""
        from mcore_rl.actor.dpo_step import dpo_update

        metrics = dpo_update(self, batch, beta, loss_type)
        self.params_current()
        return self._result(metrics)

    def params_current(self) -> None:
        """Finish the overlapped parameter all-gather of the last optimizer step (actor/optimizer.py:
        finish_param_gather), so that what reads the weights after an update reads this step's (collective)."""
        from mcore_rl.actor.optimizer import finish_param_gather

        finish_param_gather(self.ddp_chunks, self.optim_plan)

    def weights_finite(self) -> bool:
        """Whether every parameter this rank holds is finite (asked after a failed push: NaN/inf weights mean the
        update diverged, whichever rank's error the push reported first)."""
        return all(bool(torch.isfinite(p).all()) for chunk in self.ddp_chunks for p in chunk.parameters())

    # ------------------------------------------------------------------------------------------- checkpoints
    def save_checkpoint(self, directory: str, with_reference: bool = False) -> dict[str, Any]:
        """Write this rank's model, optimizer, [reference] and RNG states into `directory` (collective; see
        mcore_rl/checkpoint/rank_io.py). The controller publishes the directory once every rank has returned."""
        from mcore_rl.checkpoint.rank_io import save_rank

        return save_rank(self, directory, with_reference)

    def load_checkpoint(self, directory: str) -> dict[str, Any]:
        """Restore a training checkpoint saved under any layout (collective); RNG states only under the same one."""
        from mcore_rl.checkpoint.rank_io import load_rank

        return load_rank(self, directory)

    # ------------------------------------------------------------------------------------------- weight sync
    def _sender(self):  # noqa: ANN202
        from mcore_rl.actor.sync_sender import SyncSender

        if getattr(self, "_sync", None) is None:
            self._sync = SyncSender(self)
        return self._sync

    def sync_plan(
        self, engines: dict[str, int], bucket_bytes: int, mode: str, fp8: bool = False, one_leader: bool = False
    ) -> str:
        """Compute the weight-sync plan (collective); returns its digest (see actor/sync_sender.py)."""
        return self._sender().plan(engines, bucket_bytes, mode, fp8, one_leader)

    def sync_summary(self) -> dict[str, Any]:
        return self._sender().summary()

    def sync_addresses(self) -> dict[str, tuple[str, int]]:
        """Rendezvous addresses of the broadcast groups this rank leads."""
        return self._sender().addresses()

    def sync_join(
        self, name: str, host: str, port: int, world_size: int, backend: str, timeout_s: float, engine: str = "hf"
    ) -> None:
        """Host the broadcast group `name` (blocks until the engines have joined); `engine`'s kind makes it."""
        self._sender().join(name, host, port, world_size, backend, timeout_s, engine)

    def sync_drop_groups(self) -> None:
        self._sender().drop_groups()

    def sync_send(self, request: PushRequest) -> dict[str, Any]:
        """Send this rank's part of the plan (collective within each stream's gather group): actor/sync_sender.py."""
        return self._sender().send(request)

    def offload(self) -> dict[str, int]:
        """Colocated placement: training state to host memory while the engines generate (actor/offload.py)."""
        from mcore_rl.actor.offload import offload

        return offload(self)

    def onload(self) -> dict[str, int]:
        """Colocated placement: training state back onto the device before training (actor/offload.py)."""
        from mcore_rl.actor.offload import onload

        return onload(self)

    def pid(self) -> int:
        return os.getpid()
