"""The verl launch scripts of tests/fixtures/verl_scripts/ as a verl user runs them: their override lines, a home
directory holding the parquet files they name (verl's schema, a few rows of each data source) and a Hugging Face
cache holding the config.json of each model they name (no weights)."""

from __future__ import annotations

import json
import os
import shlex

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "verl_scripts")
SCRIPTS = sorted(f.removesuffix(".txt") for f in os.listdir(FIXTURES) if f.endswith(".txt"))

#: the data_source column verl's preprocessing writes into each file the scripts name
DATA_SOURCES = {
    "gsm8k": "openai/gsm8k",
    "math": "DigitalLearningGmbH/MATH-lighteval",
    "dapo-math-17k": "math_dapo",
    "aime-2024": "aime-2024",
}


def script_args(name: str, home: str) -> list[str]:
    """The script's overrides as the shell passes them ($HOME expanded, quotes removed)."""
    out = []
    with open(os.path.join(FIXTURES, f"{name}.txt")) as f:
        for line in f:
            line = line.strip()
            if line and not line.startswith("#"):
                out.extend(shlex.split(line.replace("$HOME", home)))
    return out


def write_parquet(path: str, data_source: str, rows: int = 2048) -> None:
    """A verl-schema parquet file (rows of one data source)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(os.path.dirname(path), exist_ok=True)
    table = pa.table(
        {
            "data_source": [data_source] * rows,
            "prompt": [[{"role": "user", "content": f"question {i}"}] for i in range(rows)],
            "ability": ["math"] * rows,
            "reward_model": [{"style": "rule", "ground_truth": str(i)} for i in range(rows)],
            "extra_info": [{"split": "train", "index": i} for i in range(rows)],
        }
    )
    pq.write_table(table, path)


def make_world(home: str) -> dict[str, str]:
    """Parquet files under `home` and an HF cache with each model's config.json; returns the environment to set."""
    for name in SCRIPTS:
        for arg in script_args(name, home):
            for path in arg.split("=", 1)[-1].strip("[]").replace("'", "").split(","):
                path = path.strip()
                if path.endswith(".parquet") and not os.path.exists(path):
                    stem = os.path.basename(os.path.dirname(path)) if "gsm8k" in path or "/math/" in path else None
                    source = DATA_SOURCES[stem or os.path.basename(path).removesuffix(".parquet")]
                    write_parquet(path, source)
    with open(os.path.join(FIXTURES, "hf_configs.json")) as f:
        configs = {k: v for k, v in json.load(f).items() if not k.startswith("_")}
    cache = os.path.join(home, "hf", "hub")
    for model, config in configs.items():
        if "/" in model:  # a hub id: a snapshot in the cache
            repo = os.path.join(cache, "models--" + model.replace("/", "--"))
            snapshot = os.path.join(repo, "snapshots", "0" * 40)
            os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
            with open(os.path.join(repo, "refs", "main"), "w") as f:
                f.write("0" * 40)
        else:  # a local directory (the DAPO recipe's MODEL_PATH)
            snapshot = os.path.join(home, "verl", "models", model)
        os.makedirs(snapshot, exist_ok=True)
        with open(os.path.join(snapshot, "config.json"), "w") as f:
            json.dump(config, f)
    return {"HOME": home, "HF_HOME": os.path.join(home, "hf")}
