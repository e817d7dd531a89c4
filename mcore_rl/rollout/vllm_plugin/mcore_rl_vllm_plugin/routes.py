"""Four HTTP routes the project adds to a vLLM server (a `vllm.endpoint_plugins` plugin, loaded only when
`VLLM_PLUGINS` names it, as `mcore_rl/rollout/vllm_launcher.py` does):

- `POST /update_weights_from_distributed` {names, dtypes, shapes, group_name, ...}: the one data-plane call of the
  project's `distributed` sync transport, which the actor ranks send without knowing the engine family. It is vLLM's
  own `update_weights` (`engine_client.update_weights`, the same call as `/update_weights`) with SGLang's field
  names (`dtypes` -> `dtype_names`); every other call of a push goes to vLLM's own routes (mcore_rl/rollout/
  vllm_dialect.py).
- `POST /finish_weight_update_with_version`: vLLM's `finish_weight_update` with the weight version the buckets
  carried (SGLang's buckets carry it; the fence's /end_weight_update does not), so the version moves with the
  weights, and only when they are applied.
- `POST /abandon_weight_update`: drop an open update session (after a refused or interrupted push), so the next
  `/start_weight_update` opens a fresh one; vLLM 0.32 leaves a session open when `finish_weight_update` raises.
- `GET /model_info`: the served model's `model_type`, `num_hidden_layers`, `vocab_size` (the weight sync checks
  that the engine serves the actor's model before anything moves).
"""

# No `from __future__ import annotations`: FastAPI reads the routes' annotations (`request: Request`, imported in
# attach_router) at definition time.
from typing import Any


class WorkerExtension:
    """Mixed into every vLLM worker (`--worker-extension-cls mcore_rl_vllm_plugin.routes.WorkerExtension`), so
    `collective_rpc` can name its method (vLLM serialises no callables without VLLM_ALLOW_INSECURE_SERIALIZATION)."""

    def mcore_rl_abandon_weight_update(self) -> None:
        """Close this worker's update session without applying anything."""
        engine = getattr(self, "weight_transfer_engine", None)
        if engine is not None:
            engine.start_weight_update()  # our engine: empties the staging area; nothing was applied
            engine.reset_weight_update_target()
        self._weight_update_active = False


class SGLangSyncRoutes:
    """The endpoint plugin (see the module docstring)."""

    name = "mcore_rl_routes"
    required_tasks = None

    def attach_router(self, app: Any) -> None:
        from fastapi import APIRouter, Request
        from fastapi.responses import JSONResponse
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        router = APIRouter()

        @router.post("/update_weights_from_distributed")
        async def update_weights_from_distributed(request: Request) -> JSONResponse:
            body = await request.json()
            missing = [k for k in ("names", "dtypes", "shapes") if k not in body]
            if missing:
                return JSONResponse({"success": False, "message": f"missing fields {missing}"}, status_code=400)
            info = {
                "names": body["names"],
                "dtype_names": body["dtypes"],
                "shapes": body["shapes"],
                "group_name": body.get("group_name", "default"),
            }
            try:
                await request.app.state.engine_client.update_weights(WeightTransferUpdateRequest(update_info=info))
            except Exception as err:  # noqa: BLE001 (the sender needs the reason, not a bare 500)
                return JSONResponse({"success": False, "message": str(err)}, status_code=400)
            if body.get("weight_version") is not None:  # every bucket of a push carries it; finish commits it
                request.app.state.mcore_rl_version = str(body["weight_version"])
            return JSONResponse({"success": True, "message": "bucket received"})

        @router.post("/finish_weight_update_with_version")
        async def finish_weight_update_with_version(request: Request) -> JSONResponse:
            version = getattr(request.app.state, "mcore_rl_version", None)
            try:
                await request.app.state.engine_client.finish_weight_update(version)
            except Exception as err:  # noqa: BLE001 (a refused update: the engine keeps its weights and version)
                return JSONResponse({"success": False, "message": str(err)}, status_code=400)
            finally:
                request.app.state.mcore_rl_version = None
            return JSONResponse({"success": True, "weight_version": version})

        @router.post("/abandon_weight_update")
        async def abandon_weight_update(request: Request) -> JSONResponse:
            request.app.state.mcore_rl_version = None
            await request.app.state.engine_client.collective_rpc("mcore_rl_abandon_weight_update")
            return JSONResponse({"success": True})

        @router.get("/model_info")
        async def model_info(request: Request) -> JSONResponse:
            hf = request.app.state.engine_client.vllm_config.model_config.hf_config
            keys = ("model_type", "num_hidden_layers", "vocab_size")
            return JSONResponse({k: getattr(hf, k) for k in keys if hasattr(hf, k)})

        app.include_router(router)

    async def init_state(self, engine_client: Any, state: Any, args: Any) -> None:
        """Nothing to keep: the routes read the app's engine client."""
