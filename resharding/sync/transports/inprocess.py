"""The `inprocess` transport (tests): every bucket is handed to a Python callable, synchronously."""

from __future__ import annotations

from collections.abc import Callable

import torch

from mcore_rl.resharding.sync.plan import Bucket, Stream


class InProcessTransport:
    memory = "cpu"  #: where allocate puts buffers (the executor reuses them while this stays the same)
    every_rank = False  #: only stream leaders send

    def __init__(self, receive: Callable[[Stream, Bucket, torch.Tensor], None]) -> None:
        self.receive = receive

    def allocate(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def send(self, stream: Stream, bucket: Bucket, buffer: torch.Tensor) -> None:
        self.receive(stream, bucket, buffer)

    def wait(self) -> None:
        return None

    def close(self) -> None:
        return None
