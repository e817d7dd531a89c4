"""verl compatibility: everything that exists because verl users exist.

    python -m mcore_rl.train <verl's overrides>  -> cli.py (resolve) -> keys.py (one table) -> derive.py -> our config
    a verl data_source                           -> shim.py (verl's data-source table) -> scores.py / prime_math.py
    `import verl.utils.reward_score` in a file   -> shim.py (installed when verl itself is not importable)

- `keys.py`: verl's key tree as one table (verl key -> our field, derived, ignored with why, or refused) and verl's
  defaults; `python -m mcore_rl.compat.verl.keys > docs/verl_keys.md` writes the table as markdown
- `derive.py`: the verl keys that mean something only together, turned into our fields
- `cli.py`: reads a command line of our keys or verl's, every problem at once; the dry run makes the same decision
- `scores.py`: verl's GSM8K, MATH and DAPO/AIME scorers (the same scores on the same strings)
- `prime_math.py`: verl's prime_math grader for its six `numina_*` data sources
- `shim.py`: verl's `verl.utils.reward_score` where verl is not installed, and which scorer each of verl's data
  sources gets

docs/coming_from_verl.md is the users' guide; docs/verl_keys.md lists every key.
"""
