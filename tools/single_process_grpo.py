"""The default job as one plain PyTorch process: the reference point for what the distributed loop's overhead costs.

    python tools/single_process_grpo.py --steps 150       # prints per-phase medians and the reward curve's ends
    python tools/profile_step.py --baseline               # the same, in a column beside the real loop's phases

Same model (configs/default.yaml's Qwen3-MoE shape, as a transformers model), same task, prompts, tokenizer, rule
reward, GRPO advantages, PPO clip loss (the project's own functions), Adam with the same learning rate, betas and
gradient clip, 2 optimizer steps per RL step. What it leaves out is everything that makes the job distributed: no Ray,
no HTTP rollout engine, no Megatron ranks, no expert parallelism, no weight sync (the sampler is the trained model),
no checkpointing or metric sinks. Its phases carry the loop's names (gen, reward, old_log_prob, adv, update_actor;
update_weights is 0), so `profile_step.py` can print them side by side.
"""

from __future__ import annotations

import argparse
import random
import statistics
from typing import Any


def default_config() -> Any:
    """configs/default.yaml as the loop sees it (an RLConfig)."""
    from hydra import compose, initialize_config_module

    from mcore_rl.config import register_schema, to_config

    register_schema()
    with initialize_config_module("mcore_rl.configs", version_base=None):
        return to_config(compose("default"))


def run(steps: int, cfg: Any = None) -> list[dict[str, float]]:
    """Train the default job for `steps` steps in this process; returns one record per step: the loop's timing_s/*
    keys and critic/score/mean."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from mcore_rl.algorithms.advantages import grpo_advantages
    from mcore_rl.algorithms.losses import ppo_clip_loss
    from mcore_rl.data.synthetic import synthetic_rows
    from mcore_rl.data.tokenizer import build_tiny_tokenizer
    from mcore_rl.metrics.logger import StepTimer
    from mcore_rl.reward.loader import default_compute_score

    cfg = cfg or default_config()
    torch.manual_seed(cfg.trainer.seed)
    hf = dict(cfg.model.hf_config)
    model_type = hf.pop("model_type")
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **hf), dtype=torch.float32)
    tok = build_tiny_tokenizer()
    rows = synthetic_rows(cfg.data.synthetic_num_prompts, cfg.data.seed, cfg.data.synthetic_task)
    texts = [tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False) for r in rows]
    prompts = tok(texts, add_special_tokens=False)["input_ids"]
    if len({len(p) for p in prompts}) != 1:
        raise ValueError("this baseline batches prompts without padding: the task's prompts must be equally long")
    eos, pad = hf["eos_token_id"], hf["pad_token_id"]
    actor = cfg.actor
    optim = torch.optim.Adam(
        model.parameters(),
        lr=actor.optim.lr,
        betas=(actor.optim.adam_beta1, actor.optim.adam_beta2),
        eps=actor.optim.adam_eps,
        weight_decay=actor.optim.weight_decay,
    )
    n, batch_size, new_tokens = cfg.rollout.n, cfg.data.batch_size, cfg.rollout.max_new_tokens
    order = list(range(len(rows)))
    rng = random.Random(cfg.data.seed)
    gen = torch.Generator().manual_seed(cfg.rollout.seed)
    records = []
    cursor = len(order)
    for _step in range(steps):
        if cursor + batch_size > len(order):
            rng.shuffle(order)
            cursor = 0
        picked = order[cursor : cursor + batch_size]
        cursor += batch_size
        timer = StepTimer()  # the loop's own: timing_s/<phase> = seconds since the previous lap
        mark = timer.lap
        # gen: n samples per prompt, temperature sampling with a KV cache, stop at eos
        prompt_ids = torch.tensor([prompts[i] for i in picked for _ in range(n)])
        with torch.no_grad():
            out = model(prompt_ids, use_cache=True)
            cache, logits = out.past_key_values, out.logits[:, -1]
            response = torch.full((len(prompt_ids), new_tokens), pad)
            mask = torch.zeros(len(prompt_ids), new_tokens)
            alive = torch.ones(len(prompt_ids), dtype=torch.bool)
            for t in range(new_tokens):
                probs = torch.softmax(logits.float() / cfg.rollout.temperature, dim=-1)
                token = torch.multinomial(probs, 1, generator=gen).squeeze(1)
                response[:, t] = torch.where(alive, token, pad)
                mask[:, t] = alive.float()
                alive &= token != eos
                if t + 1 < new_tokens and alive.any():
                    out = model(response[:, t : t + 1], past_key_values=cache, use_cache=True)
                    cache, logits = out.past_key_values, out.logits[:, -1]
        mark("gen")
        scores = []
        for row, ids, m in zip((rows[i] for i in picked for _ in range(n)), response.tolist(), mask.tolist()):
            text = tok.decode([t for t, keep in zip(ids, m) if keep], skip_special_tokens=True)
            score = default_compute_score(row["data_source"], text, row["reward_model"]["ground_truth"])
            scores.append(score["score"] if isinstance(score, dict) else float(score))
        rewards = torch.tensor(scores)
        mark("reward")
        seqs = torch.cat([prompt_ids, response], dim=1)
        plen = prompt_ids.shape[1]
        with torch.no_grad():
            old_logp = _response_logp(model, seqs, plen)
        mark("old_log_prob")
        groups = torch.arange(len(picked)).repeat_interleave(n)
        adv = grpo_advantages(rewards, mask, groups, norm_by_std=cfg.algorithm.norm_adv_by_std).advantages
        mark("adv")
        per = len(seqs) // actor.mini_batches
        for _epoch in range(actor.ppo_epochs):
            for mb in range(actor.mini_batches):
                sl = slice(mb * per, (mb + 1) * per)
                loss = ppo_clip_loss(
                    _response_logp(model, seqs[sl], plen),
                    old_logp[sl],
                    adv[sl],
                    mask[sl],
                    clip_ratio_low=actor.clip_ratio_low,
                    clip_ratio_high=actor.clip_ratio_high,
                    clip_ratio_c=actor.clip_ratio_c,
                    loss_agg_mode=actor.loss_agg_mode,
                ).loss
                optim.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), actor.optim.clip_grad)
                optim.step()
        mark("update_actor")
        times = {f"timing_s/{phase}": seconds for phase, seconds in timer.laps.items()}
        times["timing_s/update_weights"] = 0.0
        times["timing_s/step"] = sum(times.values())
        records.append({"step": len(records) + 1, "critic/score/mean": rewards.mean().item(), **times})
    return records


def _response_logp(model: Any, ids: Any, prompt_len: int) -> Any:
    """Log-probabilities of the tokens after the first `prompt_len` of each row of `ids`, [rows, response_len]."""
    import torch

    logits = model(ids).logits[:, prompt_len - 1 : -1].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, ids[:, prompt_len:].unsqueeze(-1)).squeeze(-1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--skip", type=int, default=10, help="warm-up steps left out of the medians")
    args = parser.parse_args(argv)
    records = run(args.steps)
    kept = [r for r in records if r["step"] > args.skip]
    print(f"reward: first step {records[0]['critic/score/mean']:.3f}, last {records[-1]['critic/score/mean']:.3f}")
    for key in [k for k in records[0] if k.startswith("timing_s/")]:
        print(f"{key[9:]:<16}{statistics.median(r[key] for r in kept):>10.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
