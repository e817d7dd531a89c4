"""GRPO on a real model, mcore_rl beside TRL's `GRPOTrainer`: the same model, prompts, reward, n, batch, response
length, learning rate and steps, one after the other on one machine.

    make real-model trl-setup                       # the model (.models/) and TRL's virtualenv (.venv-trl)
    python tools/bench_vs_trl.py [--steps 25] [--seed N] [--config-name smollm2_arith] [-- extra mcore_rl overrides]

The settings come from the mcore_rl recipe (`--print-config`): model.path, the parquet it trains on (written into its
run dir when the recipe uses a synthetic task, then handed to TRL), reward.path/reward.name (verl's signature),
rollout.n, data.batch_size, rollout.max_new_tokens, rollout.temperature, actor.optim.lr. Both sides run without a KL
term. Printed, side by side with ratios: the median step and its phases, tokens/s, reward per step (5-step means),
wall time to reward +0.3 over the first 5 steps' mean, peak memory of the machine (MemTotal - MemAvailable, sampled
every 0.2 s, less the idle figure before each run), and start-up (launch to the end of step 1, less step 1).
Goals this project keeps: step time <= 0.7x TRL's, reward at equal wall time >= TRL's, peak memory <= TRL's,
start-up <= 15 s. The figures belong in docs/benchmarks.md with the commit, date and machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TRL_PYTHON = ROOT / ".venv-trl" / "bin" / "python"


def used_bytes() -> int:
    """MemTotal - MemAvailable of this machine."""
    info = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, value = line.split(":", 1)
            info[key] = int(value.split()[0]) * 1024
    return info["MemTotal"] - info["MemAvailable"]


class PeakMemory:
    """The machine's peak used memory above its figure at the start, sampled on a thread."""

    def __init__(self, every_s: float = 0.2) -> None:
        self.base, self.peak, self.every_s = used_bytes(), 0, every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.peak = max(self.peak, used_bytes() - self.base)

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def recipe_settings(config_name: str, overrides: list[str]) -> dict[str, Any]:
    """The resolved mcore_rl config of the recipe, as YAML -> dict."""
    import yaml

    out = subprocess.run(
        [sys.executable, "-m", "mcore_rl.train", "--config-name", config_name, *overrides, "--print-config"],
        capture_output=True, text=True, check=False, cwd=ROOT,
    )  # fmt: skip
    if out.returncode != 0:
        raise SystemExit(f"the recipe's config does not resolve:\n{out.stderr[-3000:]}")
    return yaml.safe_load(out.stdout)


def run_mcore(config_name: str, steps: int, run_dir: Path, overrides: list[str]) -> dict[str, Any]:
    """One mcore_rl run; per-step wall times from the arrival of each step's console line."""
    cmd = [sys.executable, "-m", "mcore_rl.train", "--config-name", config_name, f"trainer.steps={steps}",
           f"trainer.run_dir={run_dir}", *overrides]  # fmt: skip
    launched = time.time()
    arrivals: dict[int, float] = {}
    with PeakMemory() as memory:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("step="):
                arrivals[int(line.split()[0].split("=")[1])] = time.time()
        stderr = proc.stderr.read() if proc.stderr else ""
        proc.wait()
    if proc.returncode != 0:
        raise SystemExit(f"mcore_rl run failed (exit {proc.returncode}):\n{stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r.get("step", 0) >= 1]
    phases = sorted({k.split("/", 1)[1] for r in rows for k in r if k.startswith("timing_s/") and k != "timing_s/step"})
    return {
        "launched": launched,
        "step_end": [arrivals[r["step"]] - launched for r in rows],
        "step_s": [r["timing_s/step"] for r in rows],
        "phases": {p: [r.get(f"timing_s/{p}", 0.0) for r in rows] for p in phases},
        "reward": [r["critic/score/mean"] for r in rows],
        "response_length": [r["response_length/mean"] for r in rows],
        "peak_bytes": memory.peak,
    }


def run_trl(spec: dict[str, Any], work: Path) -> dict[str, Any]:
    """One TRL run in its own virtualenv (tools/_trl_grpo.py)."""
    if not TRL_PYTHON.exists():
        raise SystemExit(f"{TRL_PYTHON} is missing: run `make trl-setup` first")
    spec_path, out_path = work / "trl_spec.json", work / "trl_events.jsonl"
    spec_path.write_text(json.dumps({**spec, "work_dir": str(work / "trl_out")}))
    launched = time.time()
    with PeakMemory() as memory:
        done = subprocess.run(
            [str(TRL_PYTHON), str(ROOT / "tools" / "_trl_grpo.py"), str(spec_path), str(out_path)],
            capture_output=True, text=True, check=False,
            env={**os.environ, "PYTHONPATH": "", "OMP_NUM_THREADS": str(spec["threads"])},
        )  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"TRL run failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    events = [json.loads(line) for line in out_path.read_text().splitlines()]
    steps = [e for e in events if e["event"] == "step"]
    return {
        "launched": launched,
        "step_end": [e["time"] - launched for e in steps],
        "step_s": [e["seconds"] for e in steps],
        "phases": {"gen": [e["gen_seconds"] for e in steps], "train": [e["seconds"] - e["gen_seconds"] for e in steps]},
        "reward": [e["reward"] for e in steps],
        "response_length": [e["completion_length"] or 0.0 for e in steps],
        "peak_bytes": memory.peak,
    }


def time_to_gain(run: dict[str, Any], gain: float = 0.3, window: int = 5) -> float | None:
    """Wall seconds from launch to the first step whose trailing `window`-step mean reward is `gain` above the first
    `window` steps' mean; None if never."""
    rewards = run["reward"]
    if len(rewards) < window:
        return None
    base = statistics.mean(rewards[:window])
    for i in range(window - 1, len(rewards)):
        if statistics.mean(rewards[i - window + 1 : i + 1]) >= base + gain:
            return run["step_end"][i]
    return None


def reward_at(run: dict[str, Any], seconds: float) -> float | None:
    """The trailing 5-step mean reward of the last step that ended by `seconds` after launch."""
    done = [i for i, t in enumerate(run["step_end"]) if t <= seconds]
    if not done:
        return None
    i = done[-1]
    return statistics.mean(run["reward"][max(0, i - 4) : i + 1])


def summarise(name: str, run: dict[str, Any], prompts_per_step: int, n: int) -> dict[str, Any]:
    tokens = [length * prompts_per_step * n for length in run["response_length"]]
    return {
        "name": name,
        "median step s": statistics.median(run["step_s"]),
        **{f"  {p} s": statistics.median(v) for p, v in run["phases"].items()},
        "response tokens/s": sum(tokens) / sum(run["step_s"]),
        "start-up s": run["step_end"][0] - run["step_s"][0],
        "launch to last step s": run["step_end"][-1],
        "time to +0.3 s": time_to_gain(run),
        "peak memory GiB": run["peak_bytes"] / 2**30,
        "reward, 5-step means": [
            round(statistics.mean(run["reward"][i : i + 5]), 3) for i in range(0, len(run["reward"]), 5)
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--config-name", default="smollm2_arith")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads of TRL's process")
    parser.add_argument(
        "--reward",
        default="mcore_rl/reward/rule.py:arithmetic_score",
        help="FILE:NAME of the verl-signature scorer TRL calls, when the recipe scores by data_source (no reward.path)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=None,
        help="one seed for both sides: mcore_rl's trainer.seed, data.seed (prompts and their order) and rollout.seed "
        "(sampling), and TRL's seed (default: the recipe's trainer.seed for TRL, the recipe's seeds for mcore_rl)",
    )
    parser.add_argument("overrides", nargs="*", help="after --: mcore_rl overrides for both (settings) and mcore_rl")
    args = parser.parse_args()
    if args.seed is not None:  # trainer.seed alone is the ranks' seed: it moves neither the prompts nor the sampling
        args.overrides += [f"trainer.seed={args.seed}", f"data.seed={args.seed}", f"rollout.seed={args.seed}"]
    cfg = recipe_settings(args.config_name, args.overrides)
    work = Path(tempfile.mkdtemp(prefix="bench_vs_trl_"))
    print(f"work dir {work}; mcore_rl first, then TRL ({args.steps} steps each)", flush=True)
    mcore = run_mcore(args.config_name, args.steps, work / "mcore", args.overrides)
    files = cfg["data"]["train_files"] or sorted(
        str(p) for p in (work / "mcore").glob("*.parquet") if "_val" not in p.name
    )
    if not files:
        raise SystemExit("no training parquet: the recipe names none and its run dir holds none")
    reward_path, reward_name = cfg["reward"].get("path"), cfg["reward"].get("name") or "compute_score"
    if not reward_path:  # the recipe scores by data_source with a built-in scorer: TRL loads the same function by file
        reward_path, reward_name = args.reward.rsplit(":", 1)

    def absolute(path: str) -> str:
        return path if os.path.isabs(path) else str(ROOT / path)

    spec = {
        "model": absolute(cfg["model"]["path"]), "parquet": files[0], "reward_path": absolute(reward_path),
        "reward_name": reward_name, "prompts_per_step": cfg["data"]["batch_size"], "n": cfg["rollout"]["n"],
        "max_new_tokens": cfg["rollout"]["max_new_tokens"], "temperature": cfg["rollout"]["temperature"],
        "lr": cfg["actor"]["optim"]["lr"], "steps": args.steps, "seed": cfg["trainer"]["seed"], "threads": args.threads,
    }  # fmt: skip
    trl = run_trl(spec, work)
    rows = [summarise("mcore_rl", mcore, spec["prompts_per_step"], spec["n"]),
            summarise("TRL", trl, spec["prompts_per_step"], spec["n"])]  # fmt: skip
    keys = list(dict.fromkeys(k for r in rows for k in r if k != "name"))
    print(f"\n{'':28}{'mcore_rl':>14}{'TRL':>14}{'ratio':>8}")
    for key in keys:
        a, b = rows[0].get(key), rows[1].get(key)
        if isinstance(a, list) or isinstance(b, list):
            print(f"{key:28}\n  mcore_rl {a}\n  TRL      {b}")
            continue
        ratio = f"{a / b:8.2f}" if isinstance(a, float) and isinstance(b, float) and b else f"{'':8}"
        fmt = lambda v: f"{v:14.2f}" if isinstance(v, float) else f"{str(v):>14}"  # noqa: E731
        print(f"{key:28}{fmt(a)}{fmt(b)}{ratio}")
    horizon = min(mcore["step_end"][-1], trl["step_end"][-1])
    print(
        f"reward at equal wall time ({horizon:.0f} s): mcore_rl {reward_at(mcore, horizon)}, "
        f"TRL {reward_at(trl, horizon)}"
    )
    print(json.dumps({"settings": spec, "mcore_rl": rows[0], "trl": rows[1]}), file=open(work / "summary.json", "w"))
    print(f"summary: {work / 'summary.json'}")


if __name__ == "__main__":
    main()
