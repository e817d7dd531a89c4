"""mcore_rl's vLLM plugin: vLLM loads it in every process through the `vllm.general_plugins` entry point.

It registers the weight-transfer backend `mcore_gloo` (`gloo_engine.py`) with vLLM's
`WeightTransferEngineFactory`, lazily (the module is imported only by an engine started with
`--weight-transfer-config '{"backend": "mcore_gloo"}'`). vLLM may load plugins more than once per process, so
`register` is idempotent.
"""

from __future__ import annotations

BACKEND = "mcore_gloo"  #: the name an engine selects with --weight-transfer-config '{"backend": "mcore_gloo"}'


def register() -> None:
    """Register the `mcore_gloo` weight-transfer backend (no-op if it already is)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            BACKEND, "mcore_rl_vllm_plugin.gloo_engine", "GlooWeightTransferEngine"
        )
