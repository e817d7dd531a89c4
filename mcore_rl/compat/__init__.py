"""Compatibility with other RL post-training systems: their config keys, command lines and reward functions, read
into ours. One folder per system; nothing below this layer imports it at module level (tests/test_layers.py).

- `verl/`: verl's key tree, command line, scorers and `verl.utils.reward_score` shim
"""
