"""Run by .venv-vllm's Python for tests/test_vllm_gpu_sync.py: vLLM engines whose weight-transfer backend is vLLM's
own `nccl` one, served over HTTP by vLLM's own RL routes and the project's plugin routes, so the project's wired
push (the sync's leader, the vLLM dialect, the fence, DistributedTransport) runs against vLLM's code on CPU.

    python tests/_vllm_nccl_side.py CONFIG.json

CONFIG: {"ports": [one HTTP port per engine], "dump": directory}; the test arms a refusal with POST /test_refuse_once
{name} and reads each engine's state with POST /test_dump.

vLLM's own code here: the HTTP routes (vllm.entrypoints.rl.online.api_router), AsyncLLM's weight-transfer methods
(bound to a stand-in client), the GPU worker's init/start/update/finish methods (bound to a stand-in worker),
NCCLWeightTransferEngine (parse, init, receive_weights, packed_nccl_broadcast_consumer); the project's plugin routes
and WorkerExtension. What is stood in, and only that:
- the NCCL communicator: `nccl_common.uid_init_process_group` joins a gloo group instead of
  PyNcclCommunicator.from_unique_id_bytes; its rendezvous port is read from the unique id's first bytes (the test's
  stand-in leader writes it there), so the id the engine uses is the one that travelled through the dialect;
- CUDA streams, the current device and its synchronize (a CPU torch has none), as tests/_vllm_transfer_side.py
  does;
- the model: a dict of tensors whose `load_weights` copies each bucket in as it arrives (and raises KeyError, as a
  vLLM model does for a name it lacks, on the name the test arms), and the layerwise-reload calls around it
  (recorded);
- the engine core's weight-version store, and the scheduler's pause/resume (recorded no-ops).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import struct
import sys
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from fastapi import Request  # at module level: FastAPI resolves the routes' (string) annotations in these globals

DESTROYED: list[str] = []  #: the unique ids of the communicators destroyed (PyNcclCommunicator.destroy)


def install_stand_ins() -> None:
    """Replace the CUDA-only parts (see the module docstring)."""
    from mcore_rl_vllm_plugin.gloo_engine import GlooInitInfo, join_group
    from vllm.distributed.weight_transfer import nccl_common, packed_tensor
    from vllm.model_executor.model_loader import reload

    class _NoStream:
        def synchronize(self) -> None:
            return None

    packed_tensor._get_streams = lambda device, n: tuple(_NoStream() for _ in range(n))
    packed_tensor.torch.cuda.stream = lambda s: contextlib.nullcontext()
    torch.accelerator.current_device_index = lambda: 0
    torch.accelerator.synchronize = lambda device=None: None  # the base engine's wait for its CUDA broadcasts

    class GlooCommunicator:  # PyNcclCommunicator.broadcast(tensor, src) over gloo
        def __init__(self, unique_id: bytes, rank: int, world_size: int) -> None:
            (port,) = struct.unpack("<H", unique_id[:2])
            self.unique_id = unique_id
            self.group, self._store = join_group(GlooInitInfo("127.0.0.1", port, 0, world_size, "nccl", 120.0), rank)

        def broadcast(self, tensor: torch.Tensor, src: int, stream: Any = None) -> None:
            options = dist.BroadcastOptions()
            options.rootRank = src
            self.group.broadcast([tensor], options).wait()

        def destroy(self) -> None:
            self.group = None
            DESTROYED.append(self.unique_id.hex())

    nccl_common.uid_init_process_group = lambda uid, rank, world_size, device: GlooCommunicator(uid, rank, world_size)
    reload.initialize_layerwise_reload = lambda model: model.reloads.append("initialize")
    reload.finalize_layerwise_reload = lambda model, config: model.reloads.append("finalize")


class Model:
    """The served model (see the module docstring): each bucket is applied as it arrives; `refuse_once` (a name,
    armed by the test) makes the next load of that name raise KeyError, as a vLLM model does for a name it lacks."""

    def __init__(self) -> None:
        self.weights: dict[str, torch.Tensor] = {}
        self.refuse_once: str | None = None
        self.reloads: list[str] = []
        self.loaded: set[str] = set()  #: names loaded since the session started

    def load_weights(self, pairs: Any) -> None:
        for name, tensor in pairs:
            if name == self.refuse_once:
                self.refuse_once = None
                raise KeyError(name)
            self.weights[name] = tensor.clone()
            self.loaded.add(name)


def make_worker(model: Model) -> Any:
    """A vLLM GPU worker with vLLM's own weight-transfer methods, holding vLLM's NCCLWeightTransferEngine."""
    from mcore_rl_vllm_plugin.routes import WorkerExtension
    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine
    from vllm.v1.worker.gpu_worker import Worker

    class StandInWorker(WorkerExtension):
        _check_weight_transfer_engine = Worker._check_weight_transfer_engine
        init_weight_transfer_engine = Worker.init_weight_transfer_engine
        shutdown_weight_transfer_engine = Worker.shutdown_weight_transfer_engine
        start_weight_update = Worker.start_weight_update
        _start_weight_update = Worker._start_weight_update
        update_weights = Worker.update_weights
        finish_weight_update = Worker.finish_weight_update

    parallel = SimpleNamespace(data_parallel_index=0, world_size=1, rank=0)
    config = WeightTransferConfig(backend="nccl")
    vllm_config = SimpleNamespace(
        parallel_config=parallel, model_config=SimpleNamespace(), weight_transfer_config=config
    )
    worker = StandInWorker()
    worker.vllm_config, worker.rank = vllm_config, 0
    worker._weight_update_active, worker._weight_update_is_draft = False, False
    worker.model_runner = SimpleNamespace(reset_lora_state=lambda: None)
    worker.weight_transfer_engine = NCCLWeightTransferEngine(config, vllm_config, torch.device("cpu"), model)
    return worker


def make_client(worker: Any, model: Model, versions: list[Any]) -> Any:
    """AsyncLLM's own weight-transfer methods over one in-process worker (collective_rpc runs it in a thread)."""
    from vllm.v1.engine.async_llm import AsyncLLM

    class Core:
        version: str | None = None

        async def set_weight_version_async(self, version: str) -> None:
            # what a committed version saw: every name loaded in its session?
            versions.append([version, sorted(model.loaded)])
            self.version = version

        async def get_weight_version_async(self) -> str | None:
            return self.version

    class StandInClient:
        init_weight_transfer_engine = AsyncLLM.init_weight_transfer_engine
        shutdown_weight_transfer_engine = AsyncLLM.shutdown_weight_transfer_engine
        start_weight_update = AsyncLLM.start_weight_update
        update_weights = AsyncLLM.update_weights
        finish_weight_update = AsyncLLM.finish_weight_update
        update_weight_version = AsyncLLM.update_weight_version
        get_weight_version = AsyncLLM.get_weight_version

        def __init__(self) -> None:
            self.engine_core, self.vllm_config = Core(), worker.vllm_config

        async def collective_rpc(self, method: str, timeout: Any = None, args: tuple = (), kwargs: Any = None) -> Any:
            if method == "start_weight_update":
                model.loaded = set()
            return [await asyncio.to_thread(getattr(worker, method), *args, **(kwargs or {}))]

        async def pause_generation(self, **_: Any) -> None:
            return None

        async def resume_generation(self) -> None:
            return None

    return StandInClient()


def make_app(index: int, cfg: dict[str, Any]) -> Any:
    """Engine `index`: vLLM's RL routes and the plugin's routes over its stand-in client, and /test_dump (the
    test's view: weights, committed versions with what each session loaded, reload calls, the unique id used)."""
    from fastapi import FastAPI
    from mcore_rl_vllm_plugin.routes import SGLangSyncRoutes
    from vllm.entrypoints.rl.online.api_router import router

    model = Model()
    versions: list[Any] = []
    worker = make_worker(model)
    app = FastAPI()
    app.include_router(router)
    SGLangSyncRoutes().attach_router(app)
    app.state.engine_client = make_client(worker, model, versions)

    @app.post("/test_refuse_once")
    async def refuse_once(request: Request) -> dict[str, Any]:
        model.refuse_once = (await request.json())["name"]
        return {"armed": model.refuse_once}

    @app.post("/test_dump")
    async def dump() -> dict[str, Any]:
        group = worker.weight_transfer_engine.model_update_group
        path = os.path.join(cfg["dump"], f"engine{index}.pt")
        torch.save({"weights": model.weights, "versions": versions, "reloads": model.reloads,
                    "unique_id": None if group is None else group.unique_id.hex(), "destroyed": DESTROYED},
                   path)  # fmt: skip
        return {"path": path}

    return app


async def serve(cfg: dict[str, Any]) -> None:
    import uvicorn

    servers = [
        uvicorn.Server(uvicorn.Config(make_app(i, cfg), host="127.0.0.1", port=port, log_level="warning"))
        for i, port in enumerate(cfg["ports"])
    ]
    await asyncio.gather(*(s.serve() for s in servers))


def main() -> None:
    with open(sys.argv[1]) as f:
        cfg = json.load(f)
    install_stand_ins()
    asyncio.run(serve(cfg))


if __name__ == "__main__":
    main()
