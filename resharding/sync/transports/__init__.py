"""Sync transports: where a packed bucket goes. One small interface (`Transport` in base.py): `memory`,
`every_rank`, `allocate`, `send` (may run in the background, one bucket in flight), `wait`, `close`.

- distributed: /update_weights_from_distributed + a broadcast in a group of the stream's leader and every engine
  rank (gloo on CPU, NCCL on GPU). The default; any placement.
- tensor: /update_weights_from_tensor with the bucket in shared memory (CPU) or as a CUDA IPC handle (GPU). Engines
  on the leader's node. Its payload's bytes: resharding/sync/wire.py.
- disk: one safetensors file per bucket, then /update_weights_from_disk. The fallback (shared file systems).
- inprocess: a Python callable. Tests.
"""

from mcore_rl.resharding.sync.transports.base import BackgroundSender, Transport, http_post
from mcore_rl.resharding.sync.transports.disk import DiskTransport
from mcore_rl.resharding.sync.transports.distributed import DistributedTransport
from mcore_rl.resharding.sync.transports.inprocess import InProcessTransport
from mcore_rl.resharding.sync.transports.tensor import TensorTransport
from mcore_rl.resharding.sync.wire import encode_payload, flatten  # the tensor payload's format (sync/wire.py)

TRANSPORTS = ("distributed", "tensor", "disk")
"""Transports a run can choose with `sync.transport` (inprocess is for tests)."""

__all__ = [
    "TRANSPORTS",
    "BackgroundSender",
    "DiskTransport",
    "DistributedTransport",
    "InProcessTransport",
    "TensorTransport",
    "Transport",
    "encode_payload",
    "flatten",
    "http_post",
]
