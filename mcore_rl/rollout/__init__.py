"""Rollout engines: the embedded transformers engine (in-process or as a Ray actor) and its HF name translation."""

from mcore_rl.rollout.engine import HFRolloutEngine
from mcore_rl.rollout.hf_names import HF_NAME_RULES, FusedExpertRule, HFNameMap
from mcore_rl.rollout.ray_engine import RolloutEngineActor, RolloutEngineWorker, create_rollout_engine_actor
from mcore_rl.rollout.sampling import Sample, sample_next_tokens, top_p_filter

__all__ = [
    "HF_NAME_RULES",
    "FusedExpertRule",
    "HFNameMap",
    "HFRolloutEngine",
    "RolloutEngineActor",
    "RolloutEngineWorker",
    "Sample",
    "create_rollout_engine_actor",
    "sample_next_tokens",
    "top_p_filter",
]
