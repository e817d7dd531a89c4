"""Two runs' metrics.jsonl compared step by step, timings aside: did a change of code change what a seeded run
computes? (A refactor must leave the default job's metrics as they were; docs and commits record the diff.)

    python tools/diff_metrics.py runs/before runs/after            # run dirs, or the metrics.jsonl files themselves

read both files -> pair rows by "step" -> drop ignored keys -> report steps and keys only in one run, then every
(step, key) whose values differ with both values and |a - b|, then one summary line per differing key (ignored keys
written by one run only are listed too, for the record).
Values are compared exactly, without a tolerance: the seeded default job on CPU is bit-reproducible (two runs of one
commit wrote the same values for every compared key at every step), so any difference is a finding, and the summary's
max |a - b| says whether it is rounding noise or a change of behaviour.

Ignored keys (machine- and load-dependent, measured with a clock or from the OS), as the default job writes them:
  timing_s/...            wall seconds per phase (gen, reward, adv, old_log_prob, update_actor, update_weights, step)
  timing_per_token_ms/... the same seconds divided by the phase's tokens
  perf/...                perf/throughput, perf/time_per_step, perf/tokens_per_s/<phase> (clock);
                          perf/cpu_memory_used_gb (the OS's view of the host, other processes included);
                          perf/reward_rss_delta_mb, perf/reward_driver_rss_gb (the driver's RSS over the reward phase:
                          the allocator's figure, not the run's; moved under perf/ in 93bc3fa)
  any key containing time, seconds, throughput, mfu, tokens_per_s, rss or memory: the same kinds of figure outside
                          those prefixes (reward/rss_delta_mb and reward/driver_rss_gb, as 7505541 first named them;
                          a GPU run's mfu and memory figures)
except perf/total_num_tokens, which sits under perf/ but is a count of the batch's tokens, fixed by the seed.

Exit 0: the same steps and keys with the same values (ignored keys aside); 1: they differ; 2: bad input (a path that
is neither a metrics.jsonl nor a run dir holding one, a line that is not a JSON object with an integer "step", a step
written twice, no rows).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import dataclass

IGNORED_PREFIXES = ("timing_s/", "timing_per_token_ms/", "perf/")
IGNORED_WORDS = ("time", "seconds", "throughput", "mfu", "tokens_per_s", "rss", "memory")
COMPARED_ANYWAY = frozenset({"perf/total_num_tokens"})  # a token count under perf/: deterministic, see the docstring
STEP = "step"
ABSENT = "<absent>"


class BadInput(Exception):
    """A path or a file that is not a run's metrics.jsonl (exit 2)."""


def is_ignored(key: str) -> bool:
    """True for a timing- or machine-dependent metric, which two runs of the same code need not share."""
    if key in COMPARED_ANYWAY:
        return False
    return key.startswith(IGNORED_PREFIXES) or any(word in key for word in IGNORED_WORDS)


def metrics_path(path: str) -> str:
    """The metrics.jsonl a command-line argument names: the file itself or <run dir>/metrics.jsonl."""
    if os.path.isdir(path):
        path = os.path.join(path, "metrics.jsonl")
    if not os.path.isfile(path):
        raise BadInput(f"{path} does not exist: expected a metrics.jsonl or a run dir holding one")
    return path


def read_metrics(path: str) -> dict[int, dict]:
    """The rows of one metrics.jsonl keyed by their step (blank lines skipped)."""
    rows: dict[int, dict] = {}
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                raise BadInput(f"{path}:{number}: not JSON ({e}): expected one JSON object per line") from None
            if not isinstance(row, dict) or not isinstance(row.get(STEP), int):
                raise BadInput(f"{path}:{number}: expected a JSON object with an integer {STEP!r}")
            if row[STEP] in rows:
                raise BadInput(f"{path}:{number}: step {row[STEP]} written twice")
            rows[row[STEP]] = row
    if not rows:
        raise BadInput(f"{path} holds no metrics")
    return rows


def same(a: object, b: object) -> bool:
    """Exact equality, with NaN equal to NaN (a NaN written by both runs is the same result)."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, bool) != isinstance(b, bool):  # JSON true and 1 are different results, though True == 1
        return False
    return a == b


def abs_diff(a: object, b: object) -> float | None:
    """|a - b| for two numbers; None when either is not a number (or is absent)."""
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (a, b))
    return abs(a - b) if numbers else None  # type: ignore[operator]


@dataclass
class Difference:
    """One (step, key) whose values differ; ABSENT where the key is missing from one run's row at that step."""

    step: int
    key: str
    a: object
    b: object
    diff: float | None


@dataclass
class MetricsDiff:
    """What two runs' metrics do not share, with what was compared and what was left out."""

    steps_compared: list[int]
    steps_only: tuple[list[int], list[int]]
    keys_compared: list[str]
    keys_ignored: list[str]
    keys_only: tuple[list[str], list[str]]
    ignored_only: tuple[list[str], list[str]]  # listed for the record; they do not make the runs differ
    differences: list[Difference]

    @property
    def identical(self) -> bool:
        """No step, key or value differs (ignored keys aside)."""
        return not (
            self.steps_only[0] or self.steps_only[1] or self.keys_only[0] or self.keys_only[1] or self.differences
        )


def diff_metrics(a: dict[int, dict], b: dict[int, dict]) -> MetricsDiff:
    """Compare two runs' rows step by step: keys are the union over each run's rows, minus the ignored ones."""
    keys_a = {k for row in a.values() for k in row} - {STEP}
    keys_b = {k for row in b.values() for k in row} - {STEP}
    kept_a = {k for k in keys_a if not is_ignored(k)}
    kept_b = {k for k in keys_b if not is_ignored(k)}
    common_keys = sorted(kept_a & kept_b)
    common_steps = sorted(a.keys() & b.keys())
    differences = []
    for step in common_steps:
        for key in common_keys:
            va, vb = a[step].get(key, ABSENT), b[step].get(key, ABSENT)
            if not same(va, vb):
                differences.append(Difference(step, key, va, vb, abs_diff(va, vb)))
    return MetricsDiff(
        steps_compared=common_steps,
        steps_only=(sorted(a.keys() - b.keys()), sorted(b.keys() - a.keys())),
        keys_compared=common_keys,
        keys_ignored=sorted((keys_a | keys_b) - kept_a - kept_b),
        keys_only=(sorted(kept_a - kept_b), sorted(kept_b - kept_a)),
        ignored_only=(sorted(keys_a - keys_b - kept_a), sorted(keys_b - keys_a - kept_b)),
        differences=differences,
    )


def report(result: MetricsDiff, name_a: str, name_b: str) -> str:
    """The diff as text: what was compared, what only one run has, every differing value, a summary per key."""
    lines = [
        f"a: {name_a}",
        f"b: {name_b}",
        f"steps compared: {len(result.steps_compared)}; keys compared: {len(result.keys_compared)}; "
        f"keys ignored ({len(result.keys_ignored)}): {' '.join(result.keys_ignored) or '-'}",
    ]
    for label, steps in zip("ab", result.steps_only):
        if steps:
            lines.append(f"steps only in {label} ({len(steps)}): {' '.join(map(str, steps))}")
    for label, keys in zip("ab", result.keys_only):
        if keys:
            lines.append(f"keys only in {label} ({len(keys)}): {' '.join(keys)}")
    for label, keys in zip("ab", result.ignored_only):
        if keys:
            lines.append(f"ignored keys only in {label} ({len(keys)}): {' '.join(keys)}")
    if result.differences:
        lines.append("step\tkey\ta\tb\tabs_diff")
        lines += [
            f"{d.step}\t{d.key}\t{d.a!r}\t{d.b!r}\t{'-' if d.diff is None else f'{d.diff:.6g}'}"
            for d in result.differences
        ]
        lines.append("per key: first differing step, steps differing, max abs_diff")
        by_key: dict[str, list[Difference]] = {}
        for d in result.differences:
            by_key.setdefault(d.key, []).append(d)
        for key, rows in sorted(by_key.items(), key=lambda item: item[1][0].step):
            diffs = [d.diff for d in rows if d.diff is not None]
            largest = f"{max(diffs):.6g}" if diffs else "-"
            lines.append(f"  {key}: step {rows[0].step}, {len(rows)}/{len(result.steps_compared)} steps, max {largest}")
    lines.append(
        "identical (ignored keys aside)"
        if result.identical
        else f"DIFFERENT: {len(result.differences)} values in {len({d.key for d in result.differences})} keys; "
        f"{len(result.keys_only[0]) + len(result.keys_only[1])} keys in one run only; "
        f"{len(result.steps_only[0]) + len(result.steps_only[1])} steps in one run only"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Command line: print the report; 0 identical, 1 different, 2 bad input."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("a", help="first run: its dir or its metrics.jsonl")
    parser.add_argument("b", help="second run: its dir or its metrics.jsonl")
    args = parser.parse_args(argv)
    try:
        path_a, path_b = metrics_path(args.a), metrics_path(args.b)
        result = diff_metrics(read_metrics(path_a), read_metrics(path_b))
    except (BadInput, OSError, UnicodeDecodeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(report(result, path_a, path_b))
    return 0 if result.identical else 1


if __name__ == "__main__":
    sys.exit(main())
