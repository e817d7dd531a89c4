"""TRL's side of tools/bench_vs_trl.py: TRL's own `GRPOTrainer` on the same model, prompts, reward and settings.

    .venv-trl/bin/python tools/_trl_grpo.py SPEC.json OUT.jsonl       # made and run by tools/bench_vs_trl.py

It runs in TRL's own virtualenv (`make trl-setup`), so nothing here imports mcore_rl. SPEC.json names the HF model
directory, the verl-schema parquet of prompts (`prompt` as chat messages, `reward_model.ground_truth`,
`data_source`), the reward function (a file and a function name with verl's signature `compute_score(data_source,
solution_str, ground_truth, extra_info)`), and the settings both sides share. OUT.jsonl gets one line per event, each
with its wall-clock time: `start`, one `step` line per optimizer step (its seconds, the seconds of generation and
scoring inside it, reward, completion length), `end`.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from typing import Any


def _load_reward(path: str, name: str) -> Any:
    spec = importlib.util.spec_from_file_location("bench_reward", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"{path}: cannot load the reward file")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)


def main(spec_path: str, out_path: str) -> None:
    started = time.time()
    out = open(out_path, "a", buffering=1)

    def emit(kind: str, **fields: Any) -> None:
        out.write(json.dumps({"event": kind, "time": time.time(), **fields}) + "\n")

    emit("start", launched=started)
    spec = json.load(open(spec_path))

    import pyarrow.parquet as pq
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(spec["seed"])
    torch.set_num_threads(spec.get("threads", torch.get_num_threads()))
    rows = pq.read_table(spec["parquet"]).to_pylist()
    dataset = Dataset.from_list(
        [
            {
                "prompt": [{"role": m["role"], "content": m["content"]} for m in row["prompt"]],
                "ground_truth": str(row["reward_model"]["ground_truth"]),
                "data_source": row["data_source"],
            }
            for row in rows
        ]
    )
    score = _load_reward(spec["reward_path"], spec["reward_name"])

    def reward(prompts: list, completions: list, ground_truth: list, data_source: list, **_: Any) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        values = []
        for source, text, truth in zip(data_source, texts, ground_truth):
            value = score(source, text, truth, None)
            values.append(float(value["score"] if isinstance(value, dict) else value))
        return values

    config = GRPOConfig(
        output_dir=spec["work_dir"],
        per_device_train_batch_size=spec["prompts_per_step"] * spec["n"],  # completions per optimizer step
        num_generations=spec["n"],
        steps_per_generation=1,
        num_iterations=1,
        max_completion_length=spec["max_new_tokens"],
        temperature=spec["temperature"],
        learning_rate=spec["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=spec.get("weight_decay", 0.0),
        max_grad_norm=spec.get("grad_clip", 1.0),
        beta=0.0,  # no KL term, as the mcore_rl recipe
        max_steps=spec["steps"],
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        seed=spec["seed"],
        use_cpu=True,
        bf16=False,
        dataloader_num_workers=0,
    )

    timings: dict[str, float] = {"gen": 0.0}

    class TimedGRPO(GRPOTrainer):
        def _generate_and_score_completions(self, inputs: Any) -> Any:  # generation + reward + old logprobs
            t0 = time.perf_counter()
            result = super()._generate_and_score_completions(inputs)
            timings["gen"] += time.perf_counter() - t0
            return result

    class Steps(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            timings["gen"], timings["begin"] = 0.0, time.perf_counter()

        def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
            if logs and "reward" in logs:
                emit(
                    "step",
                    step=state.global_step,
                    seconds=time.perf_counter() - timings["begin"],
                    gen_seconds=timings["gen"],
                    reward=logs["reward"],
                    completion_length=logs.get("completions/mean_length"),
                )

    tokenizer = AutoTokenizer.from_pretrained(spec["model"], trust_remote_code=False)
    trainer = TimedGRPO(
        model=spec["model"],
        reward_funcs=reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[Steps()],
    )
    trainer.train()
    emit("end")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
