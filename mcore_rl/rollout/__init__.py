"""Rollout: the embedded transformers engine (`engine.py`), its SGLang-compatible HTTP server (`server.py`), the one
client for it and real SGLang (`client.py`), sglang-router, and the launcher of real SGLang servers on GPUs.

Import what you use from its module (`from mcore_rl.rollout.engine import HFRolloutEngine`). The package itself
imports nothing: config checks and the agent's tools import `mcore_rl.rollout.agent`, and must not pay for
transformers' model code (seconds, in every CLI call that only checks a config). No name is imported lazily either:
each import happens where its module is imported, at the top of a module, never first from a thread.
"""
