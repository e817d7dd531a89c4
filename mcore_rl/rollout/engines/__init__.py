"""The rollout engine kinds, one module each behind one protocol (`base.EngineKind`): `embedded.py` (rollout.engine=hf,
our server), `sglang.py` (real SGLang servers), `vllm.py` (vLLM servers). `kind_of(rollout.engine)` gives the kind;
`KINDS` is the registry, and so the list of engine names the config accepts.

Importing this package imports no torch, SGLang or vLLM: each kind imports its launcher inside the method that needs
it.
"""

from mcore_rl.rollout.engines.base import KINDS, EngineKind, EngineShape, kind_of, register
from mcore_rl.rollout.engines.embedded import EmbeddedKind
from mcore_rl.rollout.engines.sglang import SGLangKind
from mcore_rl.rollout.engines.vllm import VLLMKind

for _kind in (EmbeddedKind(), SGLangKind(), VLLMKind()):  # this order is the order the config lists them in
    register(_kind)

__all__ = ["KINDS", "EmbeddedKind", "EngineKind", "EngineShape", "SGLangKind", "VLLMKind", "kind_of", "register"]
