"""Run by .venv-vllm's Python for tests/test_vllm_transfer.py: vLLM's own code parses and consumes what the
project's sender side (mcore_rl/rollout/vllm_transfer.py, vllm_nccl.py) produces. vLLM cannot be imported in the
project's virtualenv, so the project modules are loaded here by file path (they import only torch and the stdlib).

    python tests/_vllm_transfer_side.py IN.json OUT.json

IN.json: {"checks": [...], ...inputs}; OUT.json: {check: result or {"error": "..."}}. Tensors go through torch.save
files named in IN.json.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import importlib.util
import os
from types import SimpleNamespace
from typing import Any

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(name: str) -> Any:
    path = os.path.join(ROOT, "mcore_rl", "rollout", f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"_project_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _ctype_key(t: Any) -> Any:
    """A ctypes type as comparable data: structs by size, pointers by what they point to, simple types by code."""
    if t is None:
        return None
    if isinstance(t, type) and issubclass(t, ctypes.Structure):
        return ["struct", ctypes.sizeof(t)]
    if isinstance(t, type) and issubclass(t, ctypes._Pointer):
        return ["ptr", _ctype_key(t._type_)]
    return ["simple", t._type_]


class _NoStream:
    """A CUDA stream stand-in (a CPU torch has none): vLLM's packed consumer only synchronizes its streams."""

    def synchronize(self) -> None:
        return None


def check_nccl_init(inp: dict[str, Any]) -> dict[str, Any]:
    from vllm.distributed.weight_transfer.nccl_common import worker_init_payload
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

    # parse_init_info is the worker's own parser (what /init_weight_transfer_engine runs); it reads only the class
    info = NCCLWeightTransferEngine.parse_init_info(NCCLWeightTransferEngine, inp["nccl_init"])
    update = NCCLWeightTransferEngine.parse_update_info(NCCLWeightTransferEngine, inp["nccl_update"])
    try:  # what the plugin's /update_weights_from_distributed passes today (for its own gloo backend)
        NCCLWeightTransferEngine.parse_update_info(NCCLWeightTransferEngine, dict(inp["nccl_update"], group_name="s0"))
        with_group_name = None
    except ValueError as err:
        with_group_name = str(err)
    return {
        "update": [update.names, update.dtype_names, update.shapes],
        "with_group_name": with_group_name,
        "unique_id_hex": info.nccl_unique_id_bytes.hex(),
        "rank_offset": info.rank_offset,
        "world_size": info.world_size,
        "packed": info.packed,
        "packed_buffer_size_bytes": info.packed_buffer_size_bytes,
        "packed_num_buffers": info.packed_num_buffers,
        "payload_keys": sorted(worker_init_payload(info)),
    }


def check_signatures(inp: dict[str, Any]) -> dict[str, Any]:
    from vllm.distributed.device_communicators import pynccl_wrapper as w

    ours = _load("vllm_nccl")
    theirs = {f.name: f for f in w.NCCLLibrary.exported_functions}
    out: dict[str, Any] = {"ours": {}, "theirs": {}}
    for name, (restype, argtypes) in ours.SIGNATURES.items():
        out["ours"][name] = [_ctype_key(restype), [_ctype_key(a) for a in argtypes]]
        f = theirs[name]
        out["theirs"][name] = [_ctype_key(f.restype), [_ctype_key(a) for a in f.argtypes]]
    out["enums"] = {
        "ours": [ours.NCCL_UINT8, ours.NCCL_FLOAT32, ours.NCCL_SUM],
        "theirs": [w.ncclDataTypeEnum.ncclUint8, w.ncclDataTypeEnum.ncclFloat32, w.ncclRedOpTypeEnum.ncclSum],
        "uint8": w.ncclDataTypeEnum.from_torch(torch.uint8),
    }
    out["unique_id_bytes"] = [ctypes.sizeof(ours.NcclUniqueId), w.NCCL_UNIQUE_ID_BYTES]
    return out


def check_ipc(inp: dict[str, Any]) -> dict[str, Any]:
    from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine
    from vllm.distributed.weight_transfer.packed_tensor import unpack_tensor

    out: dict[str, Any] = {}
    os.environ.pop("VLLM_ALLOW_INSECURE_SERIALIZATION", None)
    try:
        IPCWeightTransferEngine.parse_update_info(IPCWeightTransferEngine, inp["ipc_update"])
        out["refused_without_env"] = None
    except ValueError as err:
        out["refused_without_env"] = str(err)
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    info = IPCWeightTransferEngine.parse_update_info(IPCWeightTransferEngine, inp["ipc_update"])
    out["handles"] = {uuid: [repr(a) for a in args] for uuid, args in info.ipc_handles.items()}
    init = IPCWeightTransferEngine.parse_init_info(IPCWeightTransferEngine, inp["ipc_init"])
    out["init_packed"] = init.packed
    # packed_ipc_consumer after rebuild_cuda_tensor (CUDA only): slice to the content, unpack by the sizes
    buffer = torch.load(inp["ipc_buffer"])
    packed = buffer[: sum(info.tensor_sizes)]
    dtypes = [getattr(torch, d) for d in info.dtype_names]
    got = unpack_tensor(packed, info.names, info.shapes, dtypes, info.tensor_sizes)
    torch.save({n: t.clone() for n, t in got}, inp["ipc_out"])
    return out


def check_buckets(inp: dict[str, Any]) -> dict[str, Any]:
    """vLLM's NCCL worker engine receives each bucket through vLLM's packed consumer; its group replays the
    leader's broadcasts (the sender's bucket buffers, in order) and records what the consumer asked for."""
    from vllm.distributed.weight_transfer import packed_tensor
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

    # CUDA stream plumbing only (a CPU torch has no streams); the chunking, sizes and unpacking stay vLLM's
    packed_tensor._get_streams = lambda device, n: tuple(_NoStream() for _ in range(n))
    packed_tensor.torch.cuda.stream = lambda s: contextlib.nullcontext()
    packed_tensor.torch.accelerator.current_device_index = lambda: 0

    class ReplayGroup:
        """Replays one broadcast of the leader (the bucket's buffer) and records every size asked for."""

        def __init__(self, buffer: torch.Tensor) -> None:
            self.buffer, self.calls = buffer, []

        def broadcast(self, tensor: torch.Tensor, src: int) -> None:
            assert src == 0
            self.calls.append(tensor.numel())
            if tensor.numel() == self.buffer.numel():
                tensor.copy_(self.buffer)

    sent = torch.load(inp["buckets_in"])  # [(update_info, buffer)]
    out: dict[str, Any] = {}
    for label, buffer_bytes in inp["limits"].items():
        received: dict[str, torch.Tensor] = {}
        asked: list[list[int]] = []
        for update, buffer in sent:
            engine = object.__new__(NCCLWeightTransferEngine)
            init = engine.parse_init_info(dict(inp["nccl_init"], packed_buffer_size_bytes=buffer_bytes))
            engine.packed = init.packed  # what init_transfer_engine keeps (it then joins NCCL: CUDA only)
            engine.packed_buffer_size_bytes = init.packed_buffer_size_bytes
            engine.packed_num_buffers = init.packed_num_buffers
            engine.device = torch.device("cpu")
            engine.model_update_group = group = ReplayGroup(buffer)
            engine.model = SimpleNamespace(load_weights=lambda pairs, into=received: into.update(
                (n, t.clone()) for n, t in pairs))  # fmt: skip
            engine.receive_weights(engine.parse_update_info(update))
            asked.append(group.calls)
        out[label] = {"broadcasts": asked, "bucket_bytes": [int(b.numel()) for _, b in sent]}
        if label == "ours":
            torch.save(received, inp["buckets_out"])
    return out


def check_gloo_buckets(inp: dict[str, Any]) -> dict[str, Any]:
    """The same, with the leader's real broadcasts over a gloo group standing in for NCCL: this worker joins the
    group the project's sender hosts (the plugin's join_group: the store keys of parallel/update_group.py) as rank 1,
    and vLLM's NCCL worker engine receives every bucket through vLLM's packed consumer."""
    import torch.distributed as dist
    from mcore_rl_vllm_plugin.gloo_engine import GlooInitInfo, join_group
    from vllm.distributed.weight_transfer import packed_tensor
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

    packed_tensor._get_streams = lambda device, n: tuple(_NoStream() for _ in range(n))
    packed_tensor.torch.cuda.stream = lambda s: contextlib.nullcontext()
    packed_tensor.torch.accelerator.current_device_index = lambda: 0
    g = inp["gloo"]
    group, _store = join_group(GlooInitInfo(g["host"], g["port"], 1, 2, g["name"], 120.0), rank=1)

    class GlooGroup:  # PyNcclCommunicator.broadcast(tensor, src) over gloo
        def __init__(self) -> None:
            self.calls: list[int] = []

        def broadcast(self, tensor: torch.Tensor, src: int) -> None:
            options = dist.BroadcastOptions()
            options.rootRank = src
            group.broadcast([tensor], options).wait()
            self.calls.append(tensor.numel())

    engine = object.__new__(NCCLWeightTransferEngine)
    init = engine.parse_init_info(inp["nccl_init"])
    engine.packed, engine.packed_buffer_size_bytes = init.packed, init.packed_buffer_size_bytes
    engine.packed_num_buffers, engine.device = init.packed_num_buffers, torch.device("cpu")
    engine.model_update_group = stand_in = GlooGroup()
    received: dict[str, torch.Tensor] = {}
    engine.model = SimpleNamespace(load_weights=lambda pairs: received.update((n, t.clone()) for n, t in pairs))
    for update in inp["updates"]:
        engine.receive_weights(engine.parse_update_info(update))
    torch.save(received, inp["buckets_out"])
    return {"broadcasts": stand_in.calls}


def check_memory(inp: dict[str, Any]) -> dict[str, Any]:
    """The dialect's memory calls against vLLM's own sleep router (an engine client that records)."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient
    from vllm.entrypoints.serve.dev.sleep.api_router import router
    from vllm.platforms import current_platform

    transfer = _load("vllm_transfer")
    calls: list[list[Any]] = []

    class Engine:
        async def sleep(self, level: int, mode: str) -> None:
            calls.append(["sleep", level, mode])

        async def wake_up(self, tags: list[str] | None) -> bool:
            calls.append(["wake_up", tags])
            return True

        async def release_kv_cache_memory(self) -> None:
            calls.append(["release_kv_cache_memory"])

    app = FastAPI()
    app.include_router(router)

    @app.post("/pause")
    async def pause(mode: str = "abort") -> dict[str, Any]:  # vLLM's dev router's; recorded, not vLLM's code
        calls.append(["pause", mode])
        return {}

    app.state.engine_client = Engine()
    http = TestClient(app)

    class Client:  # the rollout client's arequest, over the test client
        async def arequest(self, method: str, url: str, path: str, body: Any, timeout_s: Any) -> tuple[int, Any]:
            answer = http.request(method, path, json=body)
            return answer.status_code, answer.json()

    out: dict[str, Any] = {"sleep_mode_on_this_platform": current_platform.is_sleep_mode_available()}
    for label, (route, body) in inp["memory_calls"].items():
        del calls[:]
        status, payload = asyncio.run(transfer.memory_call(Client(), "http://engine", route, body, 5.0))
        out[label] = {"status": status, "calls": list(calls), "payload": payload}
    return out


if __name__ == "__main__":
    from _vllm_side_checks import run_checks  # tests/, this script's directory (sys.path[0])

    run_checks(globals())
