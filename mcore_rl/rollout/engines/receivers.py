"""The engines' side of a weight push as the transports see it: the routes and JSON bodies each engine kind takes
(`resharding/sync/transports/base.py` UpdateReceiver). The transports move the bytes; a kind's `receiver()` says what
to POST with them.

```
SGLangReceiver   SGLang's API (SGLang servers, our embedded server): /update_weights_from_distributed with the
                 bucket's names, dtypes and shapes; /update_weights_from_tensor with one pickled payload per rank
VLLMReceiver     vLLM behind its dialect: the distributed body as SGLang's (the dialect maps it); on the tensor
                 transport vLLM's IPC update (rollout/vllm_transfer.py): one handle per engine GPU, after
                 /init_weight_transfer_engine once per engine and push
```
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from mcore_rl.resharding.sync.transports.base import TransportError

__all__ = ["SGLangReceiver", "VLLMReceiver"]


class SGLangReceiver:
    """SGLang's API (0.5.23's request bodies), which every engine speaks (our embedded server reads them; vLLM's
    dialect maps the distributed one): the receiver of every kind that does not name its own
    (`EngineKind.receiver()`), and of tools and tests that push to an SGLang-API server directly."""

    gpu_handles = False

    def distributed_update(
        self, group_name: str, entries: Sequence[Any], weight_version: str
    ) -> tuple[str, dict[str, Any]]:
        """/update_weights_from_distributed: the bucket's names, dtypes and shapes, read as one flattened bucket."""
        return "/update_weights_from_distributed", {
            "names": [e.name for e in entries],
            "dtypes": [e.dtype for e in entries],
            "shapes": [list(e.shape) for e in entries],
            "group_name": group_name,
            "load_format": "flattened_bucket",
            "flush_cache": False,
            "weight_version": weight_version,
        }

    def tensor_init(self) -> tuple[str, dict[str, Any]] | None:
        """None: SGLang needs no call before a tensor update."""
        return None

    def share(self, tensor: torch.Tensor) -> Any:
        """Refused: SGLang takes pickled payloads (`gpu_handles` is False, so no transport asks)."""
        raise TransportError("SGLang's tensor payloads are pickled per engine rank, not shared as GPU handles")

    def tensor_update(
        self, url: str, bucket: Any, payloads: list[Any], weight_version: str
    ) -> tuple[str, dict[str, Any]]:
        """/update_weights_from_tensor: one flattened-bucket payload per engine rank (resharding/sync/wire.py)."""
        return "/update_weights_from_tensor", {
            "serialized_named_tensors": payloads,
            "load_format": "flattened_bucket",
            "flush_cache": False,
            "weight_version": weight_version,
        }


class VLLMReceiver(SGLangReceiver):
    """vLLM's formats: SGLang's distributed body (rollout/vllm_dialect.py maps it to vLLM's routes) and, on the
    tensor transport, vLLM's `ipc` update_info: each engine GPU's copy shared by its GPU's UUID."""

    gpu_handles = True

    def tensor_init(self) -> tuple[str, dict[str, Any]] | None:
        """vLLM's IPC init ({packed: true}, no rendezvous): its worker decodes a bucket as the last init said."""
        from mcore_rl.rollout.vllm_transfer import IPC_INIT_INFO

        return "/init_weight_transfer_engine", {"init_info": IPC_INIT_INFO}

    def share(self, tensor: torch.Tensor) -> tuple[str, tuple]:
        """(GPU UUID, reduce_tensor args) of a CUDA bucket copy (vllm_transfer.ipc_share)."""
        from mcore_rl.rollout.vllm_transfer import ipc_share

        return ipc_share(tensor)

    def tensor_update(
        self, url: str, bucket: Any, payloads: list[Any], weight_version: str
    ) -> tuple[str, dict[str, Any]]:
        """vLLM's ipc request for one engine: its ranks' handles by GPU UUID (vllm_transfer.bucket_ipc_request)."""
        from mcore_rl.rollout.vllm_transfer import IPC_UPDATE_ROUTE, bucket_ipc_request

        handles: dict[str, tuple] = {}
        for r, (uuid, args) in enumerate(payloads):
            if uuid in handles:  # vLLM's worker finds its handle by its GPU alone: two ranks there would mix
                raise TransportError(f"engine {url}: TP ranks share GPU {uuid} (rank {r}); expected one per GPU")
            handles[uuid] = args
        return IPC_UPDATE_ROUTE, bucket_ipc_request(bucket, handles, weight_version)
