"""Rollout: the embedded transformers engine, its SGLang-compatible HTTP server, the one client for it and real
SGLang, sglang-router, and the launcher of real SGLang servers on GPUs."""

from mcore_rl.rollout.engine import HFRolloutEngine
from mcore_rl.rollout.hf_names import HF_NAME_RULES, FusedExpertRule, HFNameMap
from mcore_rl.rollout.sampling import Sample, sample_rows, top_p_filter

__all__ = ["HF_NAME_RULES", "FusedExpertRule", "HFNameMap", "HFRolloutEngine", "Sample", "sample_rows", "top_p_filter"]
