"""Five HTTP routes the project adds to a vLLM server (a `vllm.endpoint_plugins` plugin, loaded only when
`VLLM_PLUGINS` names it, as `mcore_rl/rollout/vllm_launcher.py` does):

- `POST /update_weights_from_distributed` {names, dtypes, shapes, group_name, ...}: the one data-plane call of the
  project's `distributed` sync transport, which the actor ranks send without knowing the engine family. It is vLLM's
  own `update_weights` (`engine_client.update_weights`, the same call as `/update_weights`) with SGLang's field
  names (`dtypes` -> `dtype_names`; `group_name` only for the project's `mcore_gloo` backend: vLLM's own refuse an
  update_info with it, "Invalid update_info"); every other call of a push goes to vLLM's own routes (mcore_rl/rollout/
  vllm_dialect.py).
- `POST /finish_weight_update_with_version`: vLLM's `finish_weight_update` with the weight version the buckets
  carried (SGLang's buckets carry it; the fence's /end_weight_update does not), so the version moves with the
  weights, and only when they are applied.
- `POST /abort_weight_update` (SGLang's name, which the fence calls on a failed push): close the session without
  committing the version; vLLM's own backends (which load buckets as they arrive) get their layerwise reload
  finished, and the answer says `partial` (the engine is dirty until a push succeeds).
- `POST /abandon_weight_update`: drop an open update session (after a refused or interrupted push), so the next
  `/start_weight_update` opens a fresh one; vLLM 0.32 leaves a session open when `finish_weight_update` raises.
- `GET /model_info`: the served model's `model_type`, `num_hidden_layers`, `vocab_size` (the weight sync checks
  that the engine serves the actor's model before anything moves).
"""

# With VLLM_API_KEY set, every route but GET /health also needs the key (`KeyOnEveryRoute`).
# No `from __future__ import annotations`: FastAPI reads the routes' annotations (`request: Request`, imported in
# attach_router) at definition time.
import hashlib
import json
import os
import secrets
from typing import Any


class KeyOnEveryRoute:
    """ASGI middleware: every HTTP request but `GET /health` needs `Authorization: Bearer <VLLM_API_KEY>`, else 401.

    vLLM's `--api-key` (or VLLM_API_KEY) guards only the inference prefixes; with VLLM_SERVER_DEV_MODE=1 the
    server also answers /collective_rpc (any worker method by name), /pause, /resume, /reset_prefix_cache, /sleep,
    the weight-transfer routes and ours, which must answer only the run that started the engine.
    """

    def __init__(self, app: Any, key: str) -> None:
        self.app = app
        self.key_hash = hashlib.sha256(key.encode()).digest()

    def _allowed(self, scope: Any) -> bool:
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if path == "/health" and scope.get("method") == "GET":
            return True  # liveness only: the launcher and the pool poll it before they have anything to send
        for name, value in scope.get("headers") or []:
            if name == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                given = hashlib.sha256(token.encode("latin-1")).digest()
                return scheme.lower() == "bearer" and secrets.compare_digest(given, self.key_hash)
        return False

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] in ("http", "websocket") and not self._allowed(scope):
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1008})
                return
            body = json.dumps({"error": "Unauthorized: this engine needs the run's API key"}).encode()
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
            await send({"type": "http.response.start", "status": 401, "headers": headers})
            await send({"type": "http.response.body", "body": body})
            return
        await self.app(scope, receive, send)


class WorkerExtension:
    """Mixed into every vLLM worker (`--worker-extension-cls mcore_rl_vllm_plugin.routes.WorkerExtension`), so
    `collective_rpc` can name its method (vLLM serialises no callables without VLLM_ALLOW_INSECURE_SERIALIZATION)."""

    def mcore_rl_abandon_weight_update(self) -> None:
        """Close this worker's update session without applying anything more and without a version. Our backend
        drops what it staged (nothing was applied). vLLM's own backends applied the buckets that arrived and may
        have left the model inside a layerwise reload (layers still waiting for tensors sit on the meta device):
        that reload is finished, so each layer is either new or back to its old tensors and the engine can run; the
        next push (the fence's retry) loads everything again. Without an open reload, finishing is a no-op."""
        engine = getattr(self, "weight_transfer_engine", None)
        if engine is not None and type(engine).__module__.startswith("mcore_rl_vllm_plugin"):
            engine.start_weight_update()  # our engine: empties the staging area; nothing was applied
            engine.reset_weight_update_target()
        elif engine is not None:
            from vllm.config import set_current_vllm_config

            with set_current_vllm_config(self.vllm_config):
                engine.finish_weight_update()  # finalize_layerwise_reload
                engine.reset_weight_update_target()
        self._weight_update_active = False

    mcore_rl_abort_weight_update = mcore_rl_abandon_weight_update  #: /abort_weight_update (a failed push)


def stages_updates(engine_client: Any) -> bool:
    """Whether the engine's weight-transfer backend is the project's `mcore_gloo`, which stages a push and applies
    it at finish; vLLM's own backends (nccl, ipc) load each bucket as it arrives."""
    config = getattr(getattr(engine_client, "vllm_config", None), "weight_transfer_config", None)
    return getattr(config, "backend", None) == "mcore_gloo"


class SGLangSyncRoutes:
    """The endpoint plugin (see the module docstring)."""

    name = "mcore_rl_routes"
    required_tasks = None

    def attach_router(self, app: Any) -> None:
        from fastapi import APIRouter, Request
        from fastapi.responses import JSONResponse
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        key = os.environ.get("VLLM_API_KEY")
        if key:  # vLLM's own key check guards /v1, /v2, /inference and /cohere only: the dev routes stay open
            app.add_middleware(KeyOnEveryRoute, key=key)

        router = APIRouter()

        @router.post("/update_weights_from_distributed")
        async def update_weights_from_distributed(request: Request) -> JSONResponse:
            body = await request.json()
            missing = [k for k in ("names", "dtypes", "shapes") if k not in body]
            if missing:
                return JSONResponse({"success": False, "message": f"missing fields {missing}"}, status_code=400)
            info = {"names": body["names"], "dtype_names": body["dtypes"], "shapes": body["shapes"]}
            if stages_updates(request.app.state.engine_client):  # our backend's field; vLLM's refuse it
                info["group_name"] = body.get("group_name", "default")
            for key in ("tensor_sizes", "ipc_handles_pickled"):  # vLLM's ipc backend (the colocated tensor transport)
                if key in body:
                    info[key] = body[key]
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

        @router.post("/abort_weight_update")
        async def abort_weight_update(request: Request) -> JSONResponse:
            """Close a push that failed without committing its version (SGLang's name: the fence calls it first).
            `partial`: the engine loaded buckets as they arrived (vLLM's own backends), so its weights may be part
            new, part old: the caller must push again before it serves (the fence marks it dirty)."""
            request.app.state.mcore_rl_version = None
            partial = not stages_updates(request.app.state.engine_client)
            try:
                await request.app.state.engine_client.collective_rpc("mcore_rl_abort_weight_update")
            except Exception as err:  # noqa: BLE001 (the reason, not a bare 500)
                return JSONResponse({"success": False, "message": str(err), "partial": partial}, status_code=400)
            return JSONResponse({"success": True, "partial": partial})

        @router.get("/model_info")
        async def model_info(request: Request) -> JSONResponse:
            hf = request.app.state.engine_client.vllm_config.model_config.hf_config
            keys = ("model_type", "num_hidden_layers", "vocab_size")
            return JSONResponse({k: getattr(hf, k) for k in keys if hasattr(hf, k)})

        app.include_router(router)

    async def init_state(self, engine_client: Any, state: Any, args: Any) -> None:
        """Nothing to keep: the routes read the app's engine client."""
