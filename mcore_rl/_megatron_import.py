"""Megatron's `jit_fuser` as a no-op decorator on machines without CUDA, set as `megatron.core.jit` is imported.

megatron-core 0.16.1 sets `megatron.core.jit.jit_fuser = torch.compile` and decorates a dozen functions with it at
import (bias-GeLU/SwiGLU fusions, the MoE router's expert-bias update, activations). Decorating alone imports
torch._dynamo and torch._inductor: about 3 s of CPU in every process that imports Megatron (each actor and critic
rank, the dry run), on a 2-core machine while the engines start beside them. Without CUDA nothing gains from it:
the CPU runtime runs Megatron's eager code, and a compiled function called on CPU (DeepSeek-V3's expert-bias update)
would build an inductor C++ kernel on its first call. Megatron's own `disable_jit_fuser()` makes the decorator the
identity, so the same Python functions run eagerly; with CUDA present nothing changes.

`mcore_rl/__init__.py` installs the hook, so it is in place before any of our modules imports Megatron (a Ray
worker imports `mcore_rl` before an actor's module). The hook wraps only that one module's loader.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from types import ModuleType

JIT_MODULE = "megatron.core.jit"


class _DisableJitFuserWithoutCuda(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader) -> None:
        self.loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)  # type: ignore[attr-defined]
        import torch  # already imported: megatron.core.jit imports it

        if not torch.cuda.is_available():
            module.disable_jit_fuser()


class _JitModuleFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):  # noqa: ANN001, ANN201 (the MetaPathFinder protocol)
        if name != JIT_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _DisableJitFuserWithoutCuda(spec.loader)
        return spec


def install() -> None:
    """Put the finder first on sys.meta_path (idempotent; a no-op once megatron.core.jit is imported)."""
    if JIT_MODULE in sys.modules or any(isinstance(f, _JitModuleFinder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _JitModuleFinder())
