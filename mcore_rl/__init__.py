"""mcore_rl: Megatron-first RL post-training for large Mixture-of-Experts LLMs."""

__version__ = "0.1.0"
