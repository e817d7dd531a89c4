"""Run by .venv-vllm's Python for tests/test_vllm_colocated_gpu.py: vLLM's own code reads what the project's
colocated CUDA path produces, on this CPU.

    python tests/_vllm_colocated_side.py IN.json OUT.json

- `argv`: each launcher command line (after `-m vllm.entrypoints.openai.api_server`) through vLLM's own serve
  argument parser (`make_arg_parser`), `validate_parsed_serve_args` and `AsyncEngineArgs.from_cli_args`: the engine
  arguments vLLM builds its config from.
- `ipc`: the tensor transport's captured POSTs (the init, then one body per bucket) through the project's plugin
  route (`SGLangSyncRoutes`, a FastAPI app served in-process) into vLLM's real `IPCWeightTransferEngine`
  (parse_init_info, init_transfer_engine, update_weights: parse_update_info -> receive_weights -> packed_ipc_consumer ->
  PackedBufferImporter -> unpack_tensor), one engine per GPU UUID of the engine, as vLLM's collective_rpc reaches
  each worker. Stood in, because there is no CUDA here: `torch.cuda.get_device_properties` (the worker's GPU UUID),
  `torch.multiprocessing.reductions.rebuild_cuda_tensor` (the CPU copy the sender shared under that handle, read
  from a file; the call's device argument is recorded), `torch.accelerator.synchronize` (a no-op), and the model's
  `load_weights` (records what it is given).

IN.json: {"checks": [...], ...inputs}; OUT.json: {check: result or {"error": "..."}}.
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

import torch


def check_argv(inp: dict[str, Any]) -> dict[str, Any]:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    out: dict[str, Any] = {}
    for label, argv in inp["argv"].items():
        parser = make_arg_parser(FlexibleArgumentParser(description="vLLM OpenAI-Compatible RESTful API server."))
        args = parser.parse_args(argv)
        validate_parsed_serve_args(args)
        engine = AsyncEngineArgs.from_cli_args(args)
        transfer = engine.weight_transfer_config
        out[label] = {
            "backend": None if transfer is None else transfer.backend,
            "transfer_config_class": type(transfer).__name__,
            "enable_sleep_mode": engine.enable_sleep_mode,
            "sleep_mode_offload_cudagraph": engine.sleep_mode_offload_cudagraph,
            "tensor_parallel_size": engine.tensor_parallel_size,
            "data_parallel_size": engine.data_parallel_size,
            "enable_expert_parallel": engine.enable_expert_parallel,
            "gpu_memory_utilization": engine.gpu_memory_utilization,
            "enforce_eager": engine.enforce_eager,
            "worker_extension_cls": engine.worker_extension_cls,
            "skip_tokenizer_init": engine.skip_tokenizer_init,
        }
    return out


class _Model(torch.nn.Module):
    """vLLM's receive path ends in `model.load_weights(weights)`: recorded here."""

    def __init__(self) -> None:
        super().__init__()
        self.loaded: dict[str, torch.Tensor] = {}

    def load_weights(self, weights: Any) -> set[str]:
        for name, tensor in weights:
            if name in self.loaded:
                raise AssertionError(f"{name} loaded twice")
            self.loaded[name] = tensor.clone()
        return set(self.loaded)


def check_ipc(inp: dict[str, Any]) -> dict[str, Any]:
    import torch.multiprocessing.reductions as reductions
    from fastapi import FastAPI
    from fastapi.testclient import TestClient
    from mcore_rl_vllm_plugin.routes import SGLangSyncRoutes
    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest
    from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine

    shared: dict[str, torch.Tensor] = torch.load(inp["shared"])  # handle hex -> the sender's copy
    current = {"uuid": None}
    rebuilt: list[dict[str, Any]] = []

    def rebuild_cuda_tensor(*args: Any) -> torch.Tensor:
        rebuilt.append({"uuid": current["uuid"], "device": args[6], "handle": args[7].hex()})
        return shared[args[7].hex()]

    torch.cuda.get_device_properties = lambda index: SimpleNamespace(uuid=current["uuid"])
    reductions.rebuild_cuda_tensor = rebuild_cuda_tensor
    torch.accelerator.synchronize = lambda *a, **k: None
    config = WeightTransferConfig(backend="ipc")
    workers = {
        uuid: IPCWeightTransferEngine(config, SimpleNamespace(parallel_config=None, model_config=None),
                                      SimpleNamespace(index=0), _Model())
        for uuid in inp["worker_uuids"]
    }  # fmt: skip
    versions: list[Any] = []

    class EngineClient:  # vLLM's AsyncLLM as the routes call it: collective_rpc reaches every worker
        vllm_config = SimpleNamespace(weight_transfer_config=config)

        async def update_weights(self, request: WeightTransferUpdateRequest) -> None:
            for uuid, worker in workers.items():
                current["uuid"] = uuid
                worker.update_weights(request.update_info)

        async def finish_weight_update(self, version: str | None = None) -> None:
            for worker in workers.values():  # the layerwise reload needs a real model: only the importer closes
                worker._packed_importer.close()
            versions.append(version)

    app = FastAPI()
    app.state.engine_client = EngineClient()
    SGLangSyncRoutes().attach_router(app)
    client = TestClient(app)
    out: dict[str, Any] = {"inits": [], "answers": []}
    for path, body in inp["posts"]:
        if path == "/init_weight_transfer_engine":  # vLLM's own route: its worker parses and applies init_info
            for worker in workers.values():
                worker.init_transfer_engine(worker.parse_init_info(body["init_info"]))
            out["inits"].append(body["init_info"])
            continue
        if not out["answers"]:  # the first bucket once without the launcher's environment: refused, nothing loaded
            saved = os.environ.pop("VLLM_ALLOW_INSECURE_SERIALIZATION", None)
            answer = client.post(path, json=body)
            out["without_env"] = [answer.status_code, answer.json()]
            if saved is not None:
                os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = saved
        answer = client.post(path, json=body)
        out["answers"].append([path, answer.status_code, answer.json()])
    answer = client.post("/finish_weight_update_with_version", json={})
    out["finish"] = [answer.status_code, answer.json()]
    out["versions"] = versions
    out["rebuilt"] = rebuilt
    out["packed"] = {uuid: w.packed for uuid, w in workers.items()}
    torch.save({uuid: w.model.loaded for uuid, w in workers.items()}, inp["received"])
    return out


if __name__ == "__main__":
    from _vllm_side_checks import run_checks  # tests/, this script's directory (sys.path[0])

    run_checks(globals())
