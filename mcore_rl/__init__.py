"""mcore_rl: Megatron-first RL post-training for large Mixture-of-Experts LLMs."""

__version__ = "0.1.0"

from mcore_rl import _megatron_import

_megatron_import.install()  # Megatron's torch.compile fusions off where there is no CUDA (see the module)
