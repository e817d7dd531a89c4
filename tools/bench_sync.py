"""Benchmark weight sync (resharding/sync/) end to end on CPU: Megatron ranks -> the embedded engine, per transport.

    python tools/bench_sync.py                      # >= 1 GB DeepSeek-V3-shaped model, both layouts, 3 transports
    python tools/bench_sync.py --layouts pp2ep2 --transports tensor --bucket-mb 32 --repeats 5
    python tools/bench_sync.py --quick              # tiny model: a smoke run of every step (figures meaningless)
    python tools/bench_sync.py --transports distributed,sglang_code --layouts tp2ep2 --size-gb 0.25 --repeats 3
    python tools/bench_sync.py --vllm --layouts '' --size-gb 0.5   # the push into a real vLLM engine vs the raw
                                                    # broadcast, same bytes (tools/_bench_sync_vllm.py; make vllm-setup)
    python tools/bench_sync.py --connect 2x2,4x4 --layouts ''   # WeightSync.connect's time, streams x engines, into
                                                    # engines that queue as SGLang's (tools/_bench_connect.py)

Four spawned gloo ranks (`mcore_rl.parallel.harness.run_on_ranks`) hold a randomly initialised MegatronActor of a
synthetic DeepSeek-V3 (fp32; hidden 1024, MLA with q/kv LoRA ranks, layer 0 dense, then MoE layers of 48 experts,
as many as --size-gb needs), laid out as TP2 x EP2 (expert TP 2, sequence parallel) or PP2 x EP2. The embedded
engine (`mcore_rl.rollout.server`, one rank, fp32) serves in this process. Per layout the ranks play the controller,
as tests/test_sync_pipeline.py does:

    plan    actor.sync_plan(one engine of one rank, --bucket-mb, mode)
    sync    per transport x mode, --repeats attempts, each right after a raw transfer of the same bytes (below) so
            that both see the same machine (it is shared; its fresh pages cost far more at some moments than at
            others). Before each attempt every weight is negated (exactly), so each sync must move new values.
            Timed on rank 0, the whole fence:
              begin_weight_update -> every rank's sync_send -> [update_weights_from_disk] -> end_weight_update
            Checked per attempt: the engine committed as many tensors as the plan sends, and a handful per stream
            (first, last, smallest TP/ETP-gathered) read back with /get_weights_by_name equal the rank's export.
            shard_aware runs for the distributed transport only: a one-rank engine keeps every byte of every tensor,
            so its receivers, and the bytes moved, are those of full.
            sglang_code is the distributed transport into SGLang 0.5.23's own receiving code instead of the
            embedded engine (tests/_sglang_receiver.py in a child process: init_custom_process_group, one broadcast
            into FlattenedTensorBucket.empty per bucket, each tensor copied into the one it replaces); checked per
            attempt: it holds as many tensors as the plan sends, and the same handful equal the export. It runs
            when `make setup` has built SGLang's code, and its raw figure is the distributed one.
    raw     the bare medium on the plan's bytes, between buffers faulted in before the clock starts:
              distributed  one gloo broadcast from one rank process to another (new_update_group)
              tensor       one copy into a shared-memory tensor + the engine's staging copy out of it: the two
                           copies the protocol needs (the payload carries only the segment's name)
              disk         write one safetensors file + read it back (safe_open maps it; the copy out is the read)
            The sync reuses its buffers (ranks: two buckets + a gather buffer; engine: staging and receive
            buffers) from one sync to the next, so only a layout's first sync faults them in; the profile shows
            fresh pages and what stays resident.
    v1      the path before resharding/sync/: every rank exports full HF tensors (export_hf_weights, cloned, as
            MegatronActor.export_hf did), they travel to the driver pickled (torch.save bytes through a spawn queue,
            as the harness returns results and Ray returned them), the driver pushes the whole model in one
            /update_weights_from_tensor call (load_format null: each tensor moves into shared memory in place, one
            copy fewer than a flattened bucket) and ends the session. The clock pauses while the ranks exit (on Ray
            they would idle). Every engine tensor is compared with the export before the push (this checks the
            layout's last pipeline sync completely) and after it.

Printed per (transport, mode), from its median attempt: bytes moved, fence seconds, GB/s, vs_raw (median raw
seconds / sync seconds), vs_v1 (v1 seconds / sync seconds), the largest SyncStats.peak_extra_bytes of any rank and
attempt against bucket_bytes and 2 x bucket + the largest tensor, OK/FAIL; then a profile: the fence's phases, the
slowest leader's gather/pack/wait (SyncStats), and CPU seconds, system seconds and fresh pages (minor faults x page)
of the ranks and of the engine (begin to commit; with its thread-seconds receiving broadcasts and staging copies).
GB = 1e9 bytes, MB = 2**20 bytes. The last line is the configuration with the highest GB/s:

    sync: mode=<m> transport=<t> gb=<x> seconds=<s> vs_raw=<r> vs_v1=<v> peak_extra_mb=<p> bucket_mb=<b> largest_mb=<l>

Targets: vs_raw >= 0.7, vs_v1 >= 3, peak_extra_mb <= 2 x bucket_mb + largest_mb. Memory at the defaults: each rank
holds its share of the model twice (parameters, fp32 gradient buffers) plus, on ranks 0 and 1, the raw buffers;
this process holds the engine, its staging (one model) and, during v1, the export. About 14 GB in all at --size-gb 1.
The exit status is 1 when any check failed.
"""

from __future__ import annotations

import argparse
import io
import math
import os
import re
import resource
import shutil
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist
from _bench_sync_report import _median, report  # tools/ is the script's own directory

from mcore_rl.resharding.sync.transports import encode_payload, http_post

TESTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")

GB = 1e9
MB = 1 << 20
ENGINES = {"num_engines": 1}  # one engine of one rank (the embedded server)
CHECK_ELEMENTS = 1 << 19  # /get_weights_by_name reads at most this many elements of a checked tensor (JSON)
TIMEOUT_S = 600.0
PAGE = os.sysconf("SC_PAGE_SIZE")

DEEPSEEK = dict(
    model_type="deepseek_v3", vocab_size=8192, hidden_size=1024, intermediate_size=4096, moe_intermediate_size=512,
    first_k_dense_replace=1, num_attention_heads=16, num_key_value_heads=16, q_lora_rank=512, kv_lora_rank=256,
    qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, n_routed_experts=48, n_shared_experts=1,
    num_experts_per_tok=8, n_group=4, topk_group=4, routed_scaling_factor=2.5, norm_topk_prob=True,
    num_nextn_predict_layers=0, max_position_embeddings=256, rope_theta=10000.0, tie_word_embeddings=False,
)  # fmt: skip
QUICK = dict(
    DEEPSEEK, vocab_size=256, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
    qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=8, max_position_embeddings=64,
)  # fmt: skip
LAYOUTS = {
    "tp2ep2": dict(tp=2, ep=2, sequence_parallel=True),  # MoE with tp > 1 needs sequence parallelism
    "pp2ep2": dict(pp=2, ep=2),
}
WORLD = 4


# ---------------------------------------------------------------------------------------------------- the model
def param_count(hf: dict[str, Any]) -> int:
    """Parameters of the HF model of `hf` (built on the meta device)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(hf)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def model_config(size_gb: float, quick: bool) -> dict[str, Any]:
    """The synthetic DeepSeek-V3: layer 0 dense, then as many MoE layers as fp32 parameters of >= size_gb need."""
    if quick:
        return dict(QUICK)
    two = param_count(dict(DEEPSEEK, num_hidden_layers=2))
    per_moe_layer = param_count(dict(DEEPSEEK, num_hidden_layers=3)) - two
    fixed = two - per_moe_layer  # embeddings, the dense layer, the final norm
    moe_layers = max(1, math.ceil((size_gb * GB / 4 - fixed) / per_moe_layer))
    return dict(DEEPSEEK, num_hidden_layers=1 + moe_layers)


def layout_of(name: str, hf: dict[str, Any]) -> dict[str, Any]:
    layout = dict(LAYOUTS[name])
    layers = hf["num_hidden_layers"]
    if layout.get("pp", 1) == 2 and layers % 2:
        layout["first_stage_layers"] = (layers + 1) // 2  # the first stage's layer 0 is dense (small)
    return layout


# ---------------------------------------------------------------------------------------------------- rank side
def _actor(rank: int, world: int, hf: dict, layout: dict):  # noqa: ANN202 (MegatronActor, imported late)
    from mcore_rl.actor.megatron_actor import MegatronActor
    from mcore_rl.config import ActorConfig, LayoutConfig, ModelConfig

    actor = MegatronActor(
        rank,
        world,
        ModelConfig(hf_config=hf),
        ActorConfig(world_size=world, layout=LayoutConfig(**layout), use_ref=False),
    )
    actor.initialize(("127.0.0.1", 0))  # the harness already started torch.distributed
    return actor


def _usage_since(before: resource.struct_rusage) -> dict[str, float]:
    """CPU seconds (user + system), system seconds and bytes of fresh pages faulted in by this process since."""
    now = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "cpu_s": now.ru_utime + now.ru_stime - before.ru_utime - before.ru_stime,
        "sys_s": now.ru_stime - before.ru_stime,
        "fault_bytes": (now.ru_minflt - before.ru_minflt) * PAGE,
    }


def _export(actor) -> Any:  # noqa: ANN001
    from mcore_rl.resharding.weight_map import export_hf_weights

    return export_hf_weights(actor.chunks, actor.contexts, actor.weight_map, actor.pg.tp, actor.pg.expt_tp)


@torch.no_grad()
def _negate(actor) -> None:  # noqa: ANN001
    """Flip the sign of every floating tensor the actor holds (exact), so the next sync must move new values."""
    seen: set[int] = set()
    for chunk in actor.chunks:
        for tensor in chunk.state_dict(keep_vars=True).values():
            if isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and tensor.data_ptr() not in seen:
                seen.add(tensor.data_ptr())
                tensor.neg_()


def _check_names(plan) -> set[str]:  # noqa: ANN001
    """A handful of HF names per stream: its first and last tensor and its smallest TP/ETP-gathered one."""
    names = set()
    for stream in plan.streams:
        entries = [e for b in plan.buckets_of(stream.index) for e in b.entries]
        names |= {entries[0].name, entries[-1].name}
        gathered = [e for e in entries if plan.sources[e.source].axis is not None]
        if gathered:
            names.add(min(gathered, key=lambda e: e.nbytes).name)
    return names


def _verify(url: str, reference: dict[str, torch.Tensor], sign: int) -> list[str]:
    """Problems with the engine's copy of this rank's reference tensors (expected: sign x reference)."""
    problems = []
    for name, ref in reference.items():
        per_row = ref[0].numel() if ref.dim() > 1 else 1
        rows = min(ref.shape[0], max(1, CHECK_ELEMENTS // per_row))
        got = http_post(url + "/get_weights_by_name", {"name": name, "truncate_size": rows}, None, TIMEOUT_S)
        expected = (ref[:rows] * sign).float()
        if not torch.equal(torch.tensor(got, dtype=torch.float32), expected):
            problems.append(f"{name}: engine differs from the actor's export")
    return problems


def _verify_sglang(url: str, reference: dict[str, torch.Tensor], sign: int, work_dir: str, rank: int) -> tuple:
    """The SGLang-code receiver's copies of `reference`'s tensors against sign x the export, and (rank 0) how many
    tensors it holds. Ranks take turns: each dumps its own names."""
    from safetensors.torch import load_file

    problems, count = [], -1
    for turn in range(dist.get_world_size()):
        if turn == rank:
            path = os.path.join(work_dir, f"sglang-received-{rank}.safetensors")
            answer = http_post(url + "/dump_received", {"path": path, "names": sorted(reference)}, None, TIMEOUT_S)
            got, count = load_file(path), answer["count"]
            os.remove(path)
            for name, tensor in reference.items():
                if name not in got or not torch.equal(got[name], tensor if sign > 0 else -tensor):
                    problems.append(f"{name}: the SGLang-code receiver differs")
        dist.barrier()
    return problems, count


class RawTransfer:
    """The bare media on the plan's `nbytes` (see the module docstring), between buffers faulted in once, before any
    clock starts: fresh pages cost this VM more than any copy (and at some moments far more than at others); a sync
    that allocates per bucket pays that on top, and its profile shows it. Collective: every rank calls `seconds`;
    rank 0 gets the figures."""

    def __init__(self, rank: int, nbytes: int, transports: list[str], work_dir: str) -> None:
        from mcore_rl.parallel.groups import free_port
        from mcore_rl.parallel.update_group import new_update_group

        self.rank, self.path = rank, os.path.join(work_dir, "raw.safetensors")
        self.data = self.shared = self.group = None
        if rank == 0:
            self.data = torch.full((nbytes,), 7, dtype=torch.uint8)
            if "tensor" in transports:
                self.shared = torch.zeros(nbytes, dtype=torch.uint8).share_memory_()
        if {"distributed", "sglang_code"} & set(transports):
            port = [free_port() if rank == 0 else 0]
            dist.broadcast_object_list(port, src=0)
            if rank == 1:
                self.data = torch.zeros(nbytes, dtype=torch.uint8)
            if rank < 2:
                self.group = new_update_group("gloo", "127.0.0.1", port[0], rank, 2, "bench-raw", TIMEOUT_S)

    def seconds(self, transport: str) -> dict[str, float]:
        out = getattr(self, "_" + ("distributed" if transport == "sglang_code" else transport))()
        dist.barrier()
        return out

    def _distributed(self) -> dict[str, float]:
        from mcore_rl.parallel.update_group import broadcast

        seconds = None
        if self.group is not None:
            if self.rank == 1:
                self.data.zero_()
            broadcast(self.group, torch.zeros(1))  # both ends are in: the timed broadcast starts together
            t0 = time.perf_counter()
            broadcast(self.group, self.data)
            seconds = time.perf_counter() - t0
            if self.rank == 1 and not bool(self.data[:: max(1, self.data.numel() // 4096)].eq(7).all()):
                raise RuntimeError("the raw broadcast delivered wrong bytes")
        both: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(both, seconds)
        return {"seconds": max(both[:2])}  # the receiver finishes last

    def _tensor(self) -> dict[str, float]:
        if self.rank != 0:
            return {}
        t0 = time.perf_counter()
        self.shared.copy_(self.data)
        t1 = time.perf_counter()
        self.data.copy_(self.shared)  # the engine's stage(): a copy out of the segment it mapped
        return {"seconds": time.perf_counter() - t0, "copy_in_s": t1 - t0}

    def _disk(self) -> dict[str, float]:
        from safetensors import safe_open

        from mcore_rl.resharding.hf_io import write_safetensors

        if self.rank != 0:
            return {}
        t0 = time.perf_counter()
        write_safetensors(self.path, {"raw": self.data})
        t1 = time.perf_counter()
        with safe_open(self.path, framework="pt") as handle:
            self.data.copy_(handle.get_tensor("raw"))  # get_tensor maps the file: the copy is the read
        seconds = time.perf_counter() - t0
        os.remove(self.path)
        return {"seconds": seconds, "write_s": t1 - t0}


def _join_groups(actor, url: str) -> None:  # noqa: ANN001
    """Connect the engine to the broadcast group of every stream this rank leads (once per layout, not timed)."""
    with ThreadPoolExecutor(1) as pool:
        for name, (host, port) in actor.sync_addresses().items():
            body = {"master_address": host, "master_port": port, "rank_offset": 1, "world_size": 2,
                    "group_name": name, "backend": "gloo", "timeout_s": TIMEOUT_S}  # fmt: skip
            call = pool.submit(http_post, url + "/init_weights_update_group", body, None, TIMEOUT_S)
            actor.sync_join(name, host, port, 2, "gloo", TIMEOUT_S)
            call.result()
    dist.barrier()


def _fence(actor, rank: int, url: str, transport: str, version: int, disk_dir: str) -> dict[str, Any]:  # noqa: ANN001
    """One timed sync: begin -> every rank's sync_send -> [update_weights_from_disk] -> end (rank 0 drives)."""
    dist.barrier()
    t0 = time.perf_counter()
    if rank == 0:
        http_post(url + "/begin_weight_update", {}, None, TIMEOUT_S)
    dist.barrier()
    t1 = time.perf_counter()
    before = resource.getrusage(resource.RUSAGE_SELF)
    from mcore_rl.actor.sync_sender import PushRequest

    stats = actor.sync_send(PushRequest(version, transport, [url], disk_dir=disk_dir, timeout_s=TIMEOUT_S))
    stats.update(_usage_since(before))
    dist.barrier()
    t2 = time.perf_counter()
    record: dict[str, Any] = {"stats": stats}
    if rank == 0:
        if transport == "disk":
            body = {"model_path": disk_dir, "weight_version": str(version)}
            http_post(url + "/update_weights_from_disk", body, None, TIMEOUT_S)
        t3 = time.perf_counter()
        end = http_post(url + "/end_weight_update", {}, None, TIMEOUT_S)
        t4 = time.perf_counter()
        committed = re.search(r"committed (\d+) tensors", end.get("message", ""))
        record.update(
            seconds=t4 - t0, begin_s=t1 - t0, send_s=t2 - t1, disk_s=t3 - t2, end_s=t4 - t3,
            committed=int(committed[1]) if committed else -1, version=end.get("weight_version"),
        )  # fmt: skip
    dist.barrier()  # nobody reads the engine back before the commit
    return record


def bench_rank(
    rank: int,
    world: int,
    hf: dict[str, Any],
    layout: dict[str, Any],
    url: str,
    runs: list[tuple[str, str]],
    bucket_bytes: int,
    work_dir: str,
    repeats: int,
    to_driver: Any,
    sglang_url: str | None = None,
) -> dict[str, Any]:
    """One actor rank of one layout: plan, then per (transport, mode) `repeats` x (raw transfer, sync), then the v1
    export, which goes to the driver through `to_driver` (a spawn-context queue, as the harness sends results).
    `sglang_url` is the SGLang-code receiver that the sglang_code runs sync into."""
    urls = {t: sglang_url if t == "sglang_code" else url for t, _ in runs}  # where each transport's fence goes
    actor = _actor(rank, world, hf, layout)
    digest = actor.sync_plan(ENGINES, bucket_bytes, "full")
    digests: list[Any] = [None] * world
    dist.all_gather_object(digests, digest)
    if len(set(digests)) != 1:
        raise RuntimeError("ranks computed different sync plans")
    plan = actor._sender().plan_
    check = _check_names(plan)
    reference = {name: t.clone() for name, t in _export(actor) if name in check}
    transports = sorted({t for t, _ in runs})
    raw = RawTransfer(rank, plan.nbytes, transports, work_dir)
    groups: dict[str, dict[str, Any]] = {}  # per transport, the leader's update groups (same streams, two engines)
    for transport in sorted({"distributed", "sglang_code"} & set(transports)):
        actor._sender().groups = groups[transport] = {}
        _join_groups(actor, urls[transport])  # once per layout, as a job does at start-up
    if "tensor" in transports:
        encode_payload([("warm-up", torch.zeros(1))], None)  # starts torch_shm_manager: once per process, ~0.2 s
    records, sign, version = [], 1, 0
    for transport, mode in runs:
        if mode != actor._sender().plan_.mode:
            actor.sync_plan(ENGINES, bucket_bytes, mode)
        attempts = []
        for _ in range(repeats):
            raw_figures = raw.seconds(transport)
            _negate(actor)
            sign, version = -sign, version + 1
            disk_dir = os.path.join(work_dir, f"sync-{version}")
            if transport in groups:
                actor._sender().groups = groups[transport]
            medium = "distributed" if transport == "sglang_code" else transport
            record = _fence(actor, rank, urls[transport], medium, version, disk_dir)
            record["raw"] = raw_figures
            if transport == "sglang_code":
                problems, count = _verify_sglang(sglang_url, reference, sign, work_dir, rank)
                record["committed"] = count if rank == 0 else -1
            else:
                problems = _verify(url, reference, sign)
            everyone: list[Any] = [None] * world
            dist.all_gather_object(everyone, (record["stats"], problems, len(reference)))
            if rank == 0:
                shutil.rmtree(disk_dir, ignore_errors=True)
                record["stats"] = [stats for stats, _, _ in everyone]
                record["problems"] = [p for _, ps, _ in everyone for p in ps]
                record["checked"] = sum(n for _, _, n in everyone)
                if record["version"] != str(version):
                    record["problems"].append(f"engine at version {record['version']}, expected {version}")
                attempts.append(record)
        if rank == 0:
            records.append({"transport": transport, "mode": mode, "attempts": attempts})
    for transport in {"distributed", "sglang_code"} & set(transports):
        for name in actor.sync_addresses():
            http_post(urls[transport] + "/destroy_weights_update_group", {"group_name": name}, None, TIMEOUT_S)
    actor.sync_drop_groups()
    del raw
    # v1: begin, every rank exports full HF tensors, they travel to the driver pickled, the driver pushes them
    _negate(actor)
    dist.barrier()
    v1_start = time.time()  # wall clock: the driver ends the fence in another process
    if rank == 0:
        http_post(url + "/begin_weight_update", {}, None, TIMEOUT_S)
    dist.barrier()
    t0 = time.perf_counter()
    exported = [(name, t.detach().cpu().clone()) for name, t in _export(actor)]  # as MegatronActor.export_hf did
    export_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    blob = io.BytesIO()
    torch.save(exported, blob)  # what the harness does with a rank's result (and Ray with an actor's)
    del exported
    to_driver.put((rank, blob.getvalue()))
    del blob
    save_s = time.perf_counter() - t0
    result: dict[str, Any] = {"export_s": export_s, "save_s": save_s, "v1_start": v1_start}
    if rank == 0:
        result.update(
            runs=records, nbytes=plan.nbytes, largest=plan.largest_tensor_bytes,
            bucket_bytes=plan.bucket_bytes, buckets=len(plan.buckets), streams=[s.name for s in plan.streams],
            entries=sum(len(b.entries) for b in plan.buckets), actor=plan.actor,
        )  # fmt: skip
    return result


# ---------------------------------------------------------------------------------------------------- driver side
class EngineProfile:
    """Per update session, from begin to take_commit (before the commit's copy): thread-seconds this process spends
    receiving broadcasts and staging (copies), and its CPU seconds and fresh pages. Measured by wrapping this
    process's WeightReceiver (instance attributes; the server code is unchanged)."""

    def __init__(self, receiver: Any) -> None:
        self.sessions: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        begin, stage, receive, take = receiver.begin, receiver.stage, receiver.receive_distributed, receiver.take_commit

        def timed_begin() -> str:
            with self._lock:
                self.sessions.append(
                    {"receive_s": 0.0, "stage_s": 0.0, "_usage": resource.getrusage(resource.RUSAGE_SELF),
                     "resident_bytes": receiver.resident_bytes}  # kept from the previous session for reuse
                )  # fmt: skip
            return begin()

        def timed_take() -> Any:
            with self._lock:
                if self.sessions and "_usage" in self.sessions[-1]:
                    self.sessions[-1].update(_usage_since(self.sessions[-1].pop("_usage")))
            return take()

        def timed(key: str, fn: Any) -> Any:
            def call(*args: Any, **kwargs: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    with self._lock:
                        if self.sessions:
                            self.sessions[-1][key] += time.perf_counter() - t0

            return call

        receiver.begin = timed_begin
        receiver.take_commit = timed_take
        receiver.stage = timed("stage_s", stage)
        receiver.receive_distributed = timed("receive_s", receive)


def _engine_problems(engine: Any, named: dict[str, torch.Tensor], sign: int) -> list[str]:
    """Every engine tensor against sign x the export (names must agree both ways)."""
    state = engine.state_dict_hf()
    problems = [f"{n}: the engine has it, the export does not" for n in sorted(set(state) - set(named))]
    problems += [f"{n}: exported, the engine has no such tensor" for n in sorted(set(named) - set(state))]
    for name, tensor in named.items():
        if name in state and not torch.equal(state[name], tensor if sign > 0 else -tensor):
            problems.append(f"{name}: engine differs")
    return problems


def _drive_v1(server: Any, to_driver: Any, ranks_gone: threading.Event, out: dict[str, Any]) -> None:
    """The driver's half of v1 (a thread of this process): receive every rank's export; once the ranks have exited
    (the clock paused: on Ray they would stay, idle, and here their exit would compete for the cores), check the
    engine still holds the last pipeline sync (every tensor), then push the whole model in one
    /update_weights_from_tensor call and end the session; check every tensor again."""
    try:
        named: dict[str, torch.Tensor] = {}
        out["load_s"] = 0.0
        for _ in range(WORLD):
            _, blob = to_driver.get(timeout=TIMEOUT_S)
            t0 = time.perf_counter()
            for name, tensor in torch.load(io.BytesIO(blob), weights_only=False):
                if name in named:
                    raise RuntimeError(f"{name} was exported by two ranks")
                named[name] = tensor
            del blob
            out["load_s"] += time.perf_counter() - t0
        out["arrived"] = time.time()
        ranks_gone.wait(TIMEOUT_S)
        out["last_sync_problems"] = _engine_problems(server.server.engine, named, -1)
        t0 = time.perf_counter()
        # load_format null: each tensor moves into shared memory in place (a flattened bucket would add a copy)
        payload = encode_payload(list(named.items()), None)
        out["encode_s"] = time.perf_counter() - t0
        body = {"serialized_named_tensors": [payload], "flush_cache": False, "weight_version": "v1"}
        http_post(server.url + "/update_weights_from_tensor", body, None, TIMEOUT_S)
        del payload, body
        t1 = time.perf_counter()
        http_post(server.url + "/end_weight_update", {}, None, TIMEOUT_S)
        out["push_s"], out["end_s"] = t1 - t0, time.perf_counter() - t1
        out["problems"] = _engine_problems(server.server.engine, named, 1)
        out["tensors"] = len(named)
    except BaseException as err:  # noqa: BLE001 (reported by run_layout)
        out["error"] = err


def run_layout(
    name: str,
    hf: dict[str, Any],
    server: Any,
    profile: EngineProfile,
    runs: list[tuple[str, str]],
    bucket_bytes: int,
    repeats: int,
    sglang_url: str | None = None,
) -> dict[str, Any]:
    """All syncs of one layout on 4 fresh ranks, v1 driven from here; returns the figures."""
    from mcore_rl.parallel.harness import rank_context, run_on_ranks

    url, layout = server.url, layout_of(name, hf)
    profile.sessions.clear()
    to_driver, ranks_gone, v1 = rank_context().Queue(), threading.Event(), {}
    driver = threading.Thread(target=_drive_v1, args=(server, to_driver, ranks_gone, v1), daemon=True)
    driver.start()
    work_dir = tempfile.mkdtemp(prefix="bench_sync-")
    try:
        args = (hf, layout, url, runs, bucket_bytes, work_dir, repeats, to_driver, sglang_url)
        results = run_on_ranks(bench_rank, WORLD, args, timeout_s=1800)
    finally:
        ranks_gone.set()
        shutil.rmtree(work_dir, ignore_errors=True)
    driver.join(TIMEOUT_S)
    if "error" in v1:
        raise RuntimeError("the v1 driver failed") from v1["error"]
    info = results[0]
    start = min(part["v1_start"] for part in results)
    export_s = max(part["export_s"] for part in results)
    info["v1"] = {
        "seconds": v1["arrived"] - start + v1["push_s"] + v1["end_s"],
        "export_s": export_s,
        "travel_s": v1["arrived"] - start - export_s,
        "save_s": max(part["save_s"] for part in results),
        "load_s": v1["load_s"],
        "push_s": v1["push_s"],
        "encode_s": v1["encode_s"],
        "end_s": v1["end_s"],
        "problems": v1["problems"],
        "tensors": v1["tensors"],
    }
    sessions = iter(profile.sessions)  # one per fence, in order, then v1's
    for run in info["runs"]:
        for attempt in run["attempts"]:  # the SGLang-code receiver is not profiled
            attempt["engine"] = {} if run["transport"] == "sglang_code" else next(sessions, {})
    if v1["last_sync_problems"] and info["runs"] and info["runs"][-1]["transport"] != "sglang_code":
        info["runs"][-1]["attempts"][-1]["problems"] += [f"(every tensor) {p}" for p in v1["last_sync_problems"][:5]]
    info["raw"] = {}  # per transport: the median of the attempts measured before its syncs
    for transport in {run["transport"] for run in info["runs"]}:
        attempts = [a["raw"] for run in info["runs"] if run["transport"] == transport for a in run["attempts"]]
        info["raw"][transport] = _median(attempts, "seconds")
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gb", type=float, default=1.0, help="fp32 parameter bytes of the model, at least")
    parser.add_argument("--bucket-mb", type=float, default=None, help="sync bucket in MB (default 64; --quick 0.0625)")
    parser.add_argument("--layouts", default="tp2ep2,pp2ep2", help=f"comma-separated, of {','.join(LAYOUTS)}")
    parser.add_argument("--transports", default="distributed,tensor,disk,sglang_code", help="comma-separated")
    parser.add_argument("--repeats", type=int, default=3, help="attempts per sync and raw rate (the median is kept)")
    parser.add_argument("--quick", action="store_true", help="a tiny model: a smoke run of the whole benchmark")
    parser.add_argument(
        "--vllm", action="store_true", help="also push into a real vLLM engine (tools/_bench_sync_vllm.py; --layouts "
        "'' for that alone): its time beside the raw broadcast's, same bytes"
    )  # fmt: skip
    parser.add_argument(
        "--connect", default="", metavar="SxE,...", help="also time WeightSync.connect for S streams x E engines "
        "(tools/_bench_connect.py; --layouts '' for that alone)"
    )  # fmt: skip
    args = parser.parse_args(argv)
    try:
        shapes = [tuple(int(n) for n in x.split("x")) for x in args.connect.split(",") if x]
        assert all(len(shape) == 2 and min(shape) > 0 for shape in shapes)
    except (ValueError, AssertionError):
        parser.error(f"--connect {args.connect!r}: expected shapes SxE (streams x engines, positive), e.g. 2x2,4x4")
    layouts = [x for x in args.layouts.split(",") if x]
    transports = [x for x in args.transports.split(",") if x]
    if bad := [x for x in layouts if x not in LAYOUTS]:
        parser.error(f"unknown layouts {bad}; expected some of {list(LAYOUTS)}")
    if bad := [x for x in transports if x not in ("distributed", "tensor", "disk", "sglang_code")]:
        parser.error(f"unknown transports {bad}; expected some of distributed, tensor, disk, sglang_code")
    bucket_mb = args.bucket_mb if args.bucket_mb is not None else (0.0625 if args.quick else 64.0)
    bucket_bytes = int(bucket_mb * MB)
    # sglang_code first: the embedded engine then holds the last sync when v1 checks it
    runs = [(t, "full") for t in sorted(transports, key=lambda t: t != "sglang_code")]
    if "distributed" in transports:
        runs.insert(runs.index(("distributed", "full")) + 1, ("distributed", "shard_aware"))

    from transformers.utils import logging as hf_logging

    from mcore_rl.rollout.server import ServerThread, build_server

    hf_logging.set_verbosity_error()
    hf = model_config(args.size_gb, args.quick)
    if layouts:  # --vllm alone runs no layout
        print(
            f"model: deepseek_v3, {param_count(hf) * 4 / GB:.3f} GB of fp32 parameters (hidden {hf['hidden_size']}, "
            f"{hf['num_hidden_layers']} layers, first {hf['first_k_dense_replace']} dense, {hf['n_routed_experts']} "
            f"experts, vocab {hf['vocab_size']}); bucket {bucket_mb:g} MB; runs {runs}",
            flush=True,
        )
    import contextlib
    import sys

    sys.path.insert(0, TESTS)
    from _sglang_code import RECEIVER_PATH, sglang_receiver_process

    if "sglang_code" in transports and not RECEIVER_PATH.is_file():
        print(f"sglang_code skipped: {RECEIVER_PATH} is missing (`make setup` builds it)")
        runs = [r for r in runs if r[0] != "sglang_code"]
    rows: list[dict[str, Any]] = []
    infos: list[dict[str, Any]] = []
    # no layout (--vllm or --connect alone): no embedded engine to build
    server = ServerThread(build_server(dict(hf), init_seed=99)) if layouts else None
    try:
        profile = EngineProfile(server.server.receiver) if server is not None else None
        for layout in layouts:
            start = time.perf_counter()
            with contextlib.ExitStack() as stack:  # a fresh SGLang-code receiver per layout, as a fresh engine
                sglang_url = None
                if any(t == "sglang_code" for t, _ in runs):
                    sglang_url = stack.enter_context(sglang_receiver_process())
                info = run_layout(layout, hf, server, profile, runs, bucket_bytes, args.repeats, sglang_url)
            infos.append(info)
            rows += report(layout, info, WORLD)
            print(f"({layout} took {time.perf_counter() - start:.0f} s in all)", flush=True)
    finally:
        if server is not None:
            server.stop()
    if shapes:  # before the summary lines: the last line stays the embedded engine's best (when it ran)
        from _bench_connect import report_connect, run_connect

        report_connect(run_connect(shapes, args.repeats))  # type: ignore[arg-type]
    vllm_ok = True
    if args.vllm:  # before the summary lines: the last line stays the embedded engine's best (when it ran)
        from _bench_sync_vllm import report_vllm, run_vllm

        vllm_ok = report_vllm(run_vllm(args.size_gb, bucket_bytes, args.repeats, args.quick))
    if not rows:
        return 0 if vllm_ok else 1
    best = max(rows, key=lambda r: r["gbps"])
    failed = [r for r in rows if not r["ok"]] + [i for i in infos if i["v1"]["problems"]]
    bound_met = best["peak_mb"] <= 2 * best["bucket_mb"] + best["largest_mb"]
    print(
        f"\nbest: {best['layout']} {best['transport']} {best['mode']}; targets: vs_raw >= 0.7 "
        f"{'met' if best['vs_raw'] >= 0.7 else 'MISSED'}, vs_v1 >= 3 {'met' if best['vs_v1'] >= 3 else 'MISSED'}, "
        f"peak_extra <= 2 x bucket + largest {'met' if bound_met else 'MISSED'}; "
        f"verification {'OK' if not failed else 'FAIL'}"
    )
    print(
        f"sync: mode={best['mode']} transport={best['transport']} gb={best['gb']:.4g} seconds={best['seconds']:.4g} "
        f"vs_raw={best['vs_raw']:.3g} vs_v1={best['vs_v1']:.3g} peak_extra_mb={best['peak_mb']:.4g} "
        f"bucket_mb={best['bucket_mb']:g} largest_mb={best['largest_mb']:.4g}",
        flush=True,
    )
    return 1 if failed or not vllm_ok else 0


if __name__ == "__main__":
    raise SystemExit(main())
