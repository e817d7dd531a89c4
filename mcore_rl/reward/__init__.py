"""Rewards: rule functions with verl's `compute_score` signature, loading of user functions, batch scoring.

- `rule.py`: built-in rules (synthetic digit task, GSM8K "#### n", MATH `\\boxed{}`)
- `loader.py`: `load_reward_function` / `build_reward_fn`, the `RewardFn` protocol, built-ins keyed by data_source
- `manager.py`: `RewardManager` (validated scores tensor + metrics; threads and per-call timeouts) and the
  `BatchRewardFn` protocol that a reward model or code sandbox will implement
"""
