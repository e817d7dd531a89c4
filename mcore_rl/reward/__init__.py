"""Rewards: rule functions with verl's `compute_score` signature, loading of user functions, batch scoring.

- `rule.py`: built-in rules (synthetic digit tasks, the multi-turn lookup task, GSM8K "#### n", MATH `\\boxed{}`)
- `loader.py`: `load_reward_function` / `build_reward_fn`, the `RewardFn` protocol, built-ins keyed by data_source
- `manager.py`: `RewardManager` (validated scores tensor + metrics; threads and per-call timeouts) and the
  `BatchRewardFn` protocol that the reward model implements
- `sandbox.py` (+ `sandbox_launcher.py`, the program that runs inside): generated code in its own user, pid, network
  and mount namespaces with rlimits, a wall-clock kill and an output cap; a bounded pool; the CLI
  `python -m mcore_rl.reward.sandbox FILE`
- `reward_model.py`: a sequence-classification reward model as a Ray worker (`BatchRewardFn`), weighted with the
  rule reward (`reward.model_path`, `reward.model_weight`, `reward.rule_weight`)
- `code_reward.py`: verl's code datasets (stdin/stdout, fn_name, asserts) scored through the sandbox, or through a
  SandboxFusion server
"""
