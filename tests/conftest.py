"""Shared pytest set-up: tests marked `gpu` skip where CUDA is absent; CPU tests never see a GPU."""

import os

import pytest
import torch

# Keep every test process small on a 2-core machine (spawned ranks inherit this).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA: this machine has no usable GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
