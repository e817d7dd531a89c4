"""Colocated engines spanning GPUs: each engine TP rank's `/update_weights_from_tensor` payload is made by the actor
rank that shares its GPU (the placement's colocation map), not by the stream leader.

A CUDA IPC handle opens only in a process that sees its GPU (SGLang: "Invalid device_uuid"), so engine TP rank r
must get a payload made on r's GPU, and only the actor rank colocated with r holds memory there. With a colocation
map the tensor transport broadcasts each packed bucket to the actor ranks, each shares its own copy, the payloads
are gathered to the leader and posted as one body per engine, element r from `colocation[i][r]`.

On CPU (slow: real Megatron ranks on gloo) the receivers are SGLang's own code (tests/_sglang_receiver.py), one
process per engine TP rank, rank 0 handing each update to rank 1 as SGLang's tokenizer manager does; every byte is
checked on every receiver rank, and so is who made each payload: torch names a shared-memory segment after the pid
that allocated it (`/torch_<pid>_...`), and the receiver records the pids of every payload it opened. The `gpu` test
runs the same push on two GPUs into receivers that each see only their own GPU (CUDA_VISIBLE_DEVICES).

Run: `.venv/bin/pytest tests/test_colocated_payloads.py` (after `make setup`, which extracts SGLang's code).
"""

from __future__ import annotations

import contextlib
import os
import types
from pathlib import Path

import pytest
import requests
import torch
import torch.distributed as dist
from _sglang_code import sglang_receiver_process
from safetensors.torch import load_file
from tiny_models import tiny_qwen3_moe

from mcore_rl.parallel.harness import run_on_ranks
from mcore_rl.resharding.sync.transports.tensor import TensorTransport
from mcore_rl.rollout.engines.receivers import SGLangReceiver

MOE = tiny_qwen3_moe(vocab_size=70, initializer_range=0.5, max_position_embeddings=64, num_hidden_layers=3)
TIMEOUT_S = 60
SGLANG = SGLangReceiver()  #: the routes and bodies the transport posts: SGLang's API, which these engines read


def _sync_rank(rank: int, world: int, urls: list[str], layout: dict, colocation: list[list[int]], cuda: bool):
    """One tensor-transport sync with `colocation`; rank 0 returns the HF export of all ranks and every rank's pid."""
    from mcore_rl.actor.megatron_actor import MegatronActor
    from mcore_rl.config import ActorConfig, LayoutConfig, ModelConfig
    from mcore_rl.resharding.weight_map import export_hf_weights

    if cuda:
        torch.cuda.set_device(rank)
    actor = MegatronActor(
        rank, world, ModelConfig(hf_config=MOE), ActorConfig(world_size=world, layout=LayoutConfig(**layout))
    )
    actor.initialize(("127.0.0.1", 0))
    actor.sync_plan(dict(num_engines=len(urls), tp=len(colocation[0])), 1 << 14, "full")
    from mcore_rl.actor.sync_sender import PushRequest

    request = PushRequest(
        3, "tensor", urls, ranks_per_engine=len(colocation[0]), timeout_s=TIMEOUT_S, colocation=colocation
    )
    stats = actor.sync_send(request)
    reference = {
        n: t.detach().cpu().clone()
        for n, t in export_hf_weights(actor.chunks, actor.contexts, actor.weight_map, actor.pg.tp, actor.pg.expt_tp)
    }
    parts: list = [None] * world
    dist.all_gather_object(parts, (reference, os.getpid(), stats["buckets"]))
    if rank != 0:
        return None
    return {k: v for p in parts for k, v in p[0].items()}, [p[1] for p in parts], sum(p[2] for p in parts)


@contextlib.contextmanager
def _engines(count: int, tp: int, cuda_devices: list[str] | None = None):
    """`count` engines of `tp` ranks receiving with SGLang's code; yields [[rank URL per TP rank] per engine]."""
    with contextlib.ExitStack() as stack:
        engines = []
        for e in range(count):
            envs = [{"CUDA_VISIBLE_DEVICES": cuda_devices[e * tp + r]} if cuda_devices else None for r in range(tp)]
            others = [stack.enter_context(sglang_receiver_process(r, env=envs[r])) for r in range(1, tp)]
            first = stack.enter_context(sglang_receiver_process(0, peers=others, env=envs[0]))
            engines.append([first, *others])
        yield engines


def _check(engines: list[list[str]], colocation, reference, pids, tmp_path: Path, cpu: bool) -> None:
    for e, ranks in enumerate(engines):
        for r, url in enumerate(ranks):
            path = tmp_path / f"received-{e}-{r}.safetensors"
            answer = requests.post(url + "/dump_received", json={"path": str(path)}, timeout=120).json()
            got = load_file(path)
            assert answer["arrivals"] == {name: 1 for name in reference}, f"engine {e} rank {r}"
            for name, tensor in reference.items():
                mine = got[name]
                assert mine.dtype == tensor.dtype and mine.shape == tensor.shape, (e, r, name)
                assert torch.equal(mine.view(torch.uint8), tensor.contiguous().view(torch.uint8)), (e, r, name)
            if cpu:  # every payload this rank opened was allocated by the actor rank on its GPU, and by no other
                owners = answer["owners"]
                assert owners and all(o == [pids[colocation[e][r]]] for o in owners), (e, r, owners, pids)


CASES = [("ep2", dict(ep=2)), ("tp2", dict(tp=2, sequence_parallel=True))]


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.parametrize("name, layout", CASES, ids=[c[0] for c in CASES])
def test_each_engine_rank_opens_the_payload_of_its_colocated_actor_rank(tmp_path, name, layout) -> None:
    """Two engines of TP2 on two actor ranks, mapped crosswise (engine 0: ranks 1, 0; engine 1: ranks 0, 1): every
    receiver rank gets every byte once, from a segment the mapped actor rank allocated (both ranks lead streams
    with EP2, so the leader's own rank is not always the mapped one)."""
    colocation = [[1, 0], [0, 1]]
    with _engines(2, 2) as engines:
        urls = [ranks[0] for ranks in engines]
        reference, pids, buckets = run_on_ranks(_sync_rank, 2, (urls, layout, colocation, False))[0]
        assert buckets > 1
        _check(engines, colocation, reference, pids, tmp_path, cpu=True)


def test_colocation_must_name_every_engine_rank_inside_the_actor() -> None:
    """A map that does not match the engines is refused before anything moves, naming what is wrong."""
    with pytest.raises(ValueError, match="colocation names 1 engines for 2 URLs"):
        TensorTransport(["a", "b"], api_key=None, weight_version="1", receiver=SGLANG, ranks_per_engine=2,
                        colocation=[[0, 1]])  # fmt: skip
    with pytest.raises(ValueError, match="colocation of a names 1 actor ranks for 2"):
        TensorTransport(["a"], api_key=None, weight_version="1", receiver=SGLANG, ranks_per_engine=2, colocation=[[0]])
    with pytest.raises(ValueError, match=r"actor ranks \[1\], outside the actor's 1 ranks"):
        TensorTransport(["a"], api_key=None, weight_version="1", receiver=SGLANG, ranks_per_engine=2,
                        colocation=[[0, 1]])  # fmt: skip


def test_without_a_map_the_transport_stays_leader_only() -> None:
    """No colocation map (CPU single node, split placement): the leader sends alone, as before."""
    transport = TensorTransport(["a"], api_key=None, weight_version="1", receiver=SGLANG, ranks_per_engine=2)
    try:
        assert not transport.every_rank
    finally:
        transport.close()


SHAPES = [((16, 8), "float32"), ((3, 7), "int32"), ((5,), "bfloat16")]


def _bucket(k: int) -> tuple[types.SimpleNamespace, dict[str, torch.Tensor]]:
    """Bucket k as the transport reads it (index, nbytes, entries) and the tensors it carries, distinct per k."""
    entries, tensors, offset = [], {}, 0
    for i, (shape, dtype) in enumerate(SHAPES):
        numel = torch.Size(shape).numel()
        tensor = (torch.arange(numel) * (k + 1) + 1000 * k + i).to(getattr(torch, dtype)).reshape(shape)
        name, nbytes = f"bucket{k}.tensor{i}", tensor.numel() * tensor.element_size()
        entries.append(types.SimpleNamespace(name=name, shape=shape, dtype=dtype, offset=offset, nbytes=nbytes))
        tensors[name] = tensor
        offset += nbytes
    return types.SimpleNamespace(index=k, nbytes=offset, entries=tuple(entries)), tensors


def _push_buckets(rank: int, urls: list[str], colocation: list[list[int]], cuda: bool) -> tuple[dict, int]:
    """Actor rank `rank` (cuda:rank, or CPU) of an initialised group: four buckets, rank 0 leading and repacking one
    buffer, through the colocated tensor transport; what was sent, and this rank's pid."""
    transport = TensorTransport(
        urls, api_key=None, weight_version="1", receiver=SGLANG, ranks_per_engine=len(colocation[0]),
        timeout_s=TIMEOUT_S,
        device=f"cuda:{rank}" if cuda else "cpu", colocation=colocation, rank=rank,
    )  # fmt: skip
    stream = types.SimpleNamespace(name="pp0-dense", index=0, leader=0)
    sent: dict[str, torch.Tensor] = {}
    try:
        buffer = transport.allocate(_bucket(0)[0].nbytes) if rank == 0 else None
        for k in range(4):  # one buffer repacked for every bucket: each engine rank must read its own copy
            bucket, tensors = _bucket(k)
            if buffer is not None:
                for e in bucket.entries:
                    buffer[e.offset : e.offset + e.nbytes].copy_(tensors[e.name].reshape(-1).view(torch.uint8))
            transport.send(stream, bucket, None if buffer is None else buffer[: bucket.nbytes])
            sent.update(tensors)
        transport.wait()
    finally:
        transport.close()
    return sent, os.getpid()


def _cpu_rank(rank: int, world: int, urls: list[str], colocation: list[list[int]]) -> tuple[dict, int]:
    return _push_buckets(rank, urls, colocation, cuda=False)  # the harness started gloo


def _cuda_rank(rank: int, port: int, urls: list[str], colocation: list[list[int]], out) -> None:  # noqa: ANN001
    """A spawned rank on cuda:rank in an NCCL group of two; puts (rank, sent or its traceback) on `out`."""
    try:
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        out.put((rank, _push_buckets(rank, urls, colocation, cuda=True)[0]))
        dist.destroy_process_group()
    except BaseException:
        import traceback

        out.put((rank, traceback.format_exc()))  # the test fails at once with the rank's error
        raise


@pytest.mark.long
@pytest.mark.slow
def test_transport_alone_two_gloo_ranks_one_leader(tmp_path) -> None:
    """The transport without Megatron: rank 0 leads every bucket, rank 1 makes engine 0's rank 0 payload and engine
    1's rank 1 payload; each receiver rank gets every byte from the mapped rank's segment."""
    colocation = [[1, 0], [0, 1]]
    with _engines(2, 2) as engines:
        results = run_on_ranks(_cpu_rank, 2, ([ranks[0] for ranks in engines], colocation))
        _check(engines, colocation, results[0][0], [pid for _, pid in results], tmp_path, cpu=True)


def test_leader_only_payloads_one_segment_for_two_engines_through_reused_buffers(tmp_path) -> None:
    """No map: the leader's shared segment goes to two engines, bucket k packed into bucket k - 2's buffer. One pickle
    opened by both engines consumed the sender's own reference and the segment was gone by the third bucket."""
    with _engines(2, 1) as engines:
        urls = [ranks[0] for ranks in engines]
        transport = TensorTransport(urls, api_key=None, weight_version="1", receiver=SGLANG, timeout_s=TIMEOUT_S)
        stream, sent = types.SimpleNamespace(name="pp0-dense", index=0, leader=0), {}
        try:
            buffers = [transport.allocate(_bucket(0)[0].nbytes) for _ in range(2)]
            for k in range(4):
                bucket, tensors = _bucket(k)
                buffer = buffers[k % 2][: bucket.nbytes]
                for e in bucket.entries:
                    buffer[e.offset : e.offset + e.nbytes].copy_(tensors[e.name].reshape(-1).view(torch.uint8))
                transport.send(stream, bucket, buffer)
                sent.update(tensors)
            transport.wait()
        finally:
            transport.close()
        _check(engines, [[0], [0]], sent, [os.getpid()], tmp_path, cpu=True)


@pytest.mark.gpu
def test_cuda_payloads_open_on_engine_ranks_that_see_only_their_own_gpu(tmp_path) -> None:
    """Two GPUs, one engine of TP2: engine rank r sees only GPU r (CUDA_VISIBLE_DEVICES=r); actor rank r is on cuda:r
    (NCCL) and leader 0 packs every bucket. A payload made on the other GPU would not open there (SGLang: Invalid
    device_uuid), so every byte arriving on both engine ranks shows each opened its colocated rank's copy."""
    import multiprocessing

    from mcore_rl.parallel.groups import free_port

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    colocation = [[0, 1]]
    with _engines(1, 2, cuda_devices=["0", "1"]) as engines:
        context, port = multiprocessing.get_context("spawn"), free_port()
        out = context.Queue()
        ranks = [context.Process(target=_cuda_rank, args=(r, port, [engines[0][0]], colocation, out)) for r in (0, 1)]
        for proc in ranks:
            proc.start()
        try:
            results = dict(out.get(timeout=TIMEOUT_S * 2) for _ in ranks)
        finally:
            for proc in ranks:
                proc.join(TIMEOUT_S)
                if proc.is_alive():
                    proc.kill()
        failed = [text for text in results.values() if isinstance(text, str)]
        assert not failed, failed[0]
        _check(engines, colocation, results[0], None, tmp_path, cpu=False)


@pytest.mark.parametrize("tp, nnodes", [(2, 1), (4, 2)])
def test_placement_map_names_the_actor_rank_on_each_engine_rank_gpu(tp, nnodes) -> None:
    """ColocatedPlacement.engine_ranks against the placement's own options: engine TP rank r (node r // (tp/nnodes),
    the (r mod tp/nnodes)-th GPU of that node's CUDA_VISIBLE_DEVICES) sits on the GPU of actor rank
    engine_ranks()[e][r] (actor rank i on position i). The reserved bundles are stood in for (no Ray cluster)."""
    from mcore_rl.config import RLConfig
    from mcore_rl.controller.placement import ColocatedPlacement

    cfg = RLConfig()
    cfg.trainer.runtime, cfg.trainer.placement, cfg.sync.transport = "cuda", "colocated", "tensor"
    cfg.actor.world_size, cfg.rollout.engine, cfg.rollout.num_engines = 8, "sglang", 8 // tp
    cfg.rollout.sglang.tp, cfg.rollout.sglang.nnodes = tp, nnodes
    placement = object.__new__(ColocatedPlacement)  # what __init__ finds on a cluster: bundles in (node, GPU) order
    placement.cfg, placement.cuda, placement.actor_pg = cfg, True, None
    placement.count = types.SimpleNamespace(engine_node_gpus=tp // nnodes)
    placement.order = [5, 2, 7, 0, 1, 3, 6, 4]  # Ray's bundle indices follow no order; positions do
    placement.where = [(f"10.0.0.{i // 4}", str(i % 4 + 10)) for i in range(8)]  # two nodes of four GPUs
    ranks = placement.engine_ranks()
    assert sorted(a for engine in ranks for a in engine) == list(range(8))
    per_node = tp // nnodes
    for e, engine in enumerate(ranks):
        for r, actor_rank in enumerate(engine):
            options = placement.engine_options(e, r // per_node)
            visible = options["runtime_env"]["env_vars"]["CUDA_VISIBLE_DEVICES"].split(",")
            node = placement.where[placement.order.index(options["scheduling_strategy"].placement_group_bundle_index)]
            assert placement.where[actor_rank] == (node[0], visible[r % per_node]), (e, r)
            # the actor rank's own bundle is that GPU's
            assert (
                placement.actor_options(actor_rank)["scheduling_strategy"].placement_group_bundle_index
                == (placement.order[actor_rank])
            )


def test_weight_sync_passes_the_map_of_the_engines_it_pushes() -> None:
    """A push to some engines (a replacement: one URL) sends the map rows of those engines, in the URLs' order; no map
    for other transports or without one (CPU, split placement)."""
    from mcore_rl.controller.weight_sync import WeightSync

    sync = object.__new__(WeightSync)
    engines = [types.SimpleNamespace(index=i, url=f"http://e{i}") for i in range(3)]
    sync.pool, sync.cfg = types.SimpleNamespace(engines=engines), types.SimpleNamespace(transport="tensor")
    sync.colocation = [[0, 1], [2, 3], [4, 5]]
    assert sync._colocation_of(["http://e2", "http://e0"]) == [[4, 5], [0, 1]]
    assert sync._colocation_of(["http://e1"]) == [[2, 3]]
    sync.cfg.transport = "disk"
    assert sync._colocation_of(["http://e1"]) is None
    sync.cfg.transport, sync.colocation = "tensor", None
    assert sync._colocation_of(["http://e1"]) is None
