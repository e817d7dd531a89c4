"""The `disk` transport: each bucket becomes one safetensors file in a directory the engines can read (a shared
file system on clusters); the controller then sends `/update_weights_from_disk` with that directory. Each file is
written under a temporary name and renamed, so an engine never reads half a bucket."""

from __future__ import annotations

import os

import torch

from mcore_rl.resharding.hf_io import write_safetensors
from mcore_rl.resharding.sync.plan import Bucket, Stream
from mcore_rl.resharding.sync.transports.base import BackgroundSender


class DiskTransport:
    memory = "cpu"  #: where allocate puts buffers (the executor reuses them while this stays the same)
    every_rank = False  #: only stream leaders send

    def __init__(self, directory: str) -> None:
        self.directory = directory
        os.makedirs(directory, exist_ok=True)
        self._sender = BackgroundSender(self._send)

    def allocate(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def send(self, stream: Stream, bucket: Bucket, buffer: torch.Tensor) -> None:
        self._sender.submit((stream, bucket, buffer))

    def _send(self, item: tuple[Stream, Bucket, torch.Tensor]) -> None:
        stream, bucket, buffer = item
        tensors = {
            e.name: buffer[e.offset : e.offset + e.nbytes].view(getattr(torch, e.dtype)).view(e.shape)
            for e in bucket.entries
        }
        path = os.path.join(self.directory, f"{stream.name}-{bucket.index:05d}.safetensors")
        write_safetensors(path + ".tmp", {k: v.cpu() for k, v in tensors.items()})
        os.replace(path + ".tmp", path)

    def wait(self) -> None:
        self._sender.wait()

    def close(self) -> None:
        self._sender.close()
