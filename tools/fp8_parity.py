"""FP8 rollout parity gate: how far do blockwise-FP8 weights move a model's per-token logprobs?

    BF16 HF checkpoint -> reference model (--dtype bf16|fp32)
                       -> quantise every attention/MLP/expert projection weight (128x128 e4m3, DeepSeek-style)
                       -> dequantise into a second model of the same architecture ("fp8 model")
    prompts -> reference greedy continuation (or the given one) -> teacher-forced logprobs under both models
            -> |logprob diff| mean/p99/max, KL(ref || fp8), top-1 agreement, 10 most harmful weights -> PASS/FAIL

    python tools/fp8_parity.py --hf DIR --random-prompts 8 --prompt-len 32 --max-new-tokens 16 --json parity.json
    python tools/fp8_parity.py --hf DIR --prompts data/train.parquet --max-prompts 64 --min-top1 0.97

Exit status: 0 PASS, 1 FAIL (the failing criteria are printed), 2 bad input (missing files, bad thresholds, an
already-FP8 checkpoint, a weight that cannot be quantised) or any other error that kept the check from running.

Modelled: the FP8 model runs on dequantised weights, which reproduces the weights' rounding exactly (with --dtype
bf16 the product q * scale is rounded once more to bf16: <= 2^-8 relative, against e4m3's 2^-4). Not modelled: the
dynamic activation quantisation (per token, groups of 128 channels) and FP8 tensor-core GEMMs of SGLang; real
rollouts drift somewhat more than this check reports.

Quantised: the tensors FP8 releases of DeepSeek-V3 and Qwen3-MoE carry `weight_scale_inv` for, i.e. checkpoint
names `model.layers.<i>.(self_attn|mlp).[...].<proj>.weight` with <proj> in PROJECTIONS (shared and routed experts
included). Kept: embeddings, lm_head, all norms, the router (`mlp.gate.weight`, `e_score_correction_bias`).
`--include` / `--exclude REGEX` adjust the rule; the report lists every kept tensor with its reason. Edge blocks
(dims not a multiple of 128) are partial, as in DeepSeek's format: ceil-sized scale grid, no padding.
The reference must be a BF16/FP32 checkpoint: an FP8 release has already lost what the comparison needs, so
checkpoints with `quantization_config` or `weight_scale_inv` tensors are refused.

Attribution (`--attribution ablation`, default): for each model parameter that quantisation changed, the reference
runs with only that parameter swapped for its FP8 version; its contribution is the mean |logprob change|. One
teacher-forced pass per parameter (a fused expert stack counts as one): cheap for small models. For big ones use
`--attribution weight-error`: ||W - deq(q(W))||_F / ||W||_F, no extra passes.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

from mcore_rl.models.base import FP8_TARGETS as QUANTIZE_RULE

EXIT_PASS, EXIT_FAIL, EXIT_BAD_INPUT = 0, 1, 2


class InputError(Exception):
    """Bad input: reported with its message, exit status 2."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command line; argparse itself exits 2 on malformed arguments."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--hf", type=Path, help="BF16/FP32 HF checkpoint directory (config.json + *.safetensors)")
    src.add_argument(
        "--mcore", type=Path, help="Megatron torch_dist checkpoint (from convert_checkpoint.py hf-to-mcore)"
    )
    prompts = p.add_mutually_exclusive_group()
    prompts.add_argument(
        "--prompts",
        type=Path,
        help='jsonl of {"prompt": str[, "response": str]} or parquet '
        "with a `prompt` column of chat messages (verl schema); needs the checkpoint's tokenizer",
    )
    prompts.add_argument("--random-prompts", type=int, metavar="N", help="N synthetic prompts of random token ids")
    p.add_argument("--prompt-len", type=int, default=32, help="tokens per random prompt (default 32)")
    p.add_argument("--max-prompts", type=int, default=None, help="use only the first N prompts of --prompts")
    p.add_argument("--max-new-tokens", type=int, default=32, help="greedy continuation length (default 32)")
    p.add_argument("--seed", type=int, default=0, help="seed for random prompts")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="dtype of both models (default bf16)")
    p.add_argument("--block", type=int, nargs=2, default=(128, 128), metavar=("ROWS", "COLS"))
    p.add_argument("--include", action="append", default=[], metavar="REGEX", help="also quantise these tensors")
    p.add_argument("--exclude", action="append", default=[], metavar="REGEX", help="never quantise these tensors")
    p.add_argument("--attribution", choices=("ablation", "weight-error"), default="ablation")
    # Defaults are starting points for MoE rollouts with FP8 weights, not universal truths; tune per model.
    p.add_argument("--max-mean-abs", type=float, default=0.05, help="max mean |logprob diff| (default 0.05)")
    p.add_argument("--max-p99-abs", type=float, default=0.5, help="max p99 |logprob diff| (default 0.5)")
    p.add_argument("--max-kl", type=float, default=0.02, help="max mean per-token KL(ref||fp8) (default 0.02)")
    p.add_argument("--min-top1", type=float, default=0.9, help="min top-1 agreement in [0, 1] (default 0.9)")
    p.add_argument("--corrupt-scale", metavar="NAME", help="testing aid: multiply this tensor's scale_inv ...")
    p.add_argument("--corrupt-factor", type=float, default=8.0, help="... by this factor (default 8)")
    p.add_argument("--json", type=Path, help="write every figure to this file")
    return p.parse_args(argv)


def validate(args: argparse.Namespace) -> None:
    """Check arguments and files before anything heavy is imported; raise InputError naming the culprit."""
    for name in ("max_mean_abs", "max_p99_abs", "max_kl"):
        value = getattr(args, name)
        if not math.isfinite(value) or value < 0:
            raise InputError(f"--{name.replace('_', '-')} must be a finite number >= 0, got {value}")
    if not 0.0 <= args.min_top1 <= 1.0:
        raise InputError(f"--min-top1 must be in [0, 1], got {args.min_top1}")
    for name in ("prompt_len", "max_new_tokens", "random_prompts", "max_prompts"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise InputError(f"--{name.replace('_', '-')} must be > 0, got {value}")
    if min(args.block) <= 0:
        raise InputError(f"--block must be two positive ints, got {args.block}")
    if args.prompts is None and args.random_prompts is None:
        raise InputError("give --prompts FILE or --random-prompts N")
    if args.prompts is not None and not args.prompts.is_file():
        raise InputError(f"--prompts {args.prompts}: no such file")
    if not math.isfinite(args.corrupt_factor):
        raise InputError(f"--corrupt-factor must be finite, got {args.corrupt_factor}")
    if args.json is not None and not args.json.parent.is_dir():
        raise InputError(f"--json {args.json}: directory {args.json.parent} does not exist")
    if not args.hf.is_dir():
        raise InputError(f"--hf {args.hf}: no such directory")
    if not (args.hf / "config.json").is_file():
        raise InputError(f"--hf {args.hf}: no config.json (expected an HF checkpoint directory)")
    if not list(args.hf.glob("*.safetensors")):
        raise InputError(f"--hf {args.hf}: no *.safetensors files")
    try:
        config = json.loads((args.hf / "config.json").read_text())
    except json.JSONDecodeError as err:
        raise InputError(f"--hf {args.hf}: config.json is not valid JSON ({err})") from None
    if "quantization_config" in config:
        raise InputError(
            f"--hf {args.hf}: config.json has a quantization_config (an FP8 release?); "
            "the reference must be the BF16/FP32 checkpoint"
        )
    for pattern in args.include + args.exclude:
        try:
            re.compile(pattern)
        except re.error as err:
            raise InputError(f"--include/--exclude {pattern!r}: not a regular expression ({err})") from None


def skip_reason(name: str) -> str:
    """Why a checkpoint tensor stays in high precision (for the report)."""
    rules = (("embed_tokens", "embedding"), ("lm_head", "lm_head"), ("norm", "norm"), ("mlp.gate.", "router"))
    return next((why for key, why in rules if key in name), "not an attention/MLP/expert projection")


def select(state: dict[str, Any], args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    """Split checkpoint tensor names into (quantised, {skipped: reason}); refuse what cannot be quantised."""
    chosen, skipped = [], {}
    for name, tensor in state.items():
        if name.endswith("weight_scale_inv"):
            raise InputError(f"{name}: the checkpoint is already FP8; the reference must be a BF16/FP32 checkpoint")
        wanted = QUANTIZE_RULE.match(name) or any(re.search(p, name) for p in args.include)
        if any(re.search(p, name) for p in args.exclude):
            skipped[name] = "--exclude"
        elif wanted and tensor.dim() not in (2, 3):
            raise InputError(f"{name}: shape {tuple(tensor.shape)} cannot be quantised (needs 2D, or 3D experts)")
        elif wanted and not tensor.is_floating_point():
            raise InputError(f"{name}: dtype {tensor.dtype} cannot be quantised (needs a float weight)")
        elif wanted:
            chosen.append(name)
        else:
            skipped[name] = skip_reason(name)
    if args.corrupt_scale is not None and args.corrupt_scale not in chosen:
        raise InputError(f"--corrupt-scale {args.corrupt_scale}: not one of the quantised tensors")
    return chosen, skipped


def rel_error(w: Any, w_hat: Any) -> float:
    """||w - w_hat||_F / ||w||_F in fp32 (0 for an all-zero w)."""
    import torch

    w, w_hat = w.float(), w_hat.float()
    return (torch.linalg.norm(w - w_hat) / torch.linalg.norm(w).clamp_min(1e-30)).item()


def load_checkpoint(directory: Path) -> dict[str, Any]:
    """All tensors of an HF safetensors checkpoint (single file or sharded)."""
    from safetensors.torch import load_file

    return {name: t for file in sorted(directory.glob("*.safetensors")) for name, t in load_file(file).items()}


def quantize_state(state: dict[str, Any], names: list[str], args: argparse.Namespace, dtype: Any) -> dict[str, float]:
    """Replace `names` in `state` by their FP8 round trip (in place); return relative weight error per tensor."""
    import torch

    from mcore_rl.kernels.fp8_blockwise import dequantize_blockwise, quantize_blockwise

    errors = {}
    for name in names:
        w = state[name].float()
        q, scale_inv = quantize_blockwise(w, tuple(args.block))
        if name == args.corrupt_scale:
            scale_inv = scale_inv * args.corrupt_factor
        w_hat = dequantize_blockwise(q, scale_inv, tuple(args.block), torch.float32)
        errors[name] = rel_error(w, w_hat)
        state[name] = w_hat.to(dtype)
    return errors


def load_prompts(args: argparse.Namespace, vocab_size: int) -> list[tuple[list[int], list[int] | None]]:
    """(prompt token ids, given continuation or None) per prompt."""
    import torch

    if args.random_prompts is not None:
        gen = torch.Generator().manual_seed(args.seed)
        ids = torch.randint(0, vocab_size, (args.random_prompts, args.prompt_len), generator=gen)
        return [(row.tolist(), None) for row in ids]
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(args.hf, trust_remote_code=False)
    except Exception as err:  # a missing tokenizer surfaces as OSError, ValueError or TypeError depending on files
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise InputError(f"--prompts needs a tokenizer in {args.hf}: {first_line}") from None
    if args.prompts.suffix == ".parquet":
        import pyarrow.parquet as pq

        table = pq.read_table(args.prompts)
        if "prompt" not in table.column_names:
            raise InputError(f"--prompts {args.prompts}: no `prompt` column (columns: {table.column_names})")
        chats = table["prompt"].to_pylist()
        # The chat template already holds the special tokens, so the tokenizer must not add them again.
        rows = [(tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False), None, False) for c in chats]
    else:
        rows = []
        for i, line in enumerate(args.prompts.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                record = None
            if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
                raise InputError(f'--prompts {args.prompts}:{i}: expected {{"prompt": str}}, got {line[:80]!r}')
            rows.append((record["prompt"], record.get("response"), True))
    rows = rows[: args.max_prompts]
    if not rows:
        raise InputError(f"--prompts {args.prompts}: no prompts")
    encode = lambda text, special: tok(text, add_special_tokens=special)["input_ids"]
    return [(encode(p, special), None if r is None else encode(r, False)) for p, r, special in rows]


def continuation_logprobs(model: Any, sequences: list[tuple[list[int], list[int]]]) -> tuple[Any, Any]:
    """Teacher-forced logprobs over all continuations: (log_softmax over the vocab [T, V] fp32, taken token [T])."""
    import torch

    all_lp, taken = [], []
    with torch.no_grad():
        for prompt, cont in sequences:
            ids = torch.tensor([prompt + cont])
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
            lp = torch.log_softmax(logits, dim=-1)
            all_lp.append(lp)
            taken.append(lp.gather(1, torch.tensor(cont)[:, None])[:, 0])
    return torch.cat(all_lp), torch.cat(taken)


def compare(ref: tuple[Any, Any], fp8: tuple[Any, Any]) -> dict[str, float]:
    """Per-token parity figures between reference and FP8 logprobs."""
    import torch

    diff = (ref[1] - fp8[1]).abs()
    kl = (ref[0].exp() * (ref[0] - fp8[0])).sum(-1)
    return {
        "mean_abs": diff.mean().item(),
        "p99_abs": torch.quantile(diff, 0.99).item(),
        "max_abs": diff.max().item(),
        "kl_mean": kl.mean().item(),
        "top1": (ref[0].argmax(-1) == fp8[0].argmax(-1)).float().mean().item(),
    }


def attribute(ref_model: Any, fp8_model: Any, sequences: list, ref_lp: tuple, mode: str) -> list[dict[str, Any]]:
    """Rank the parameters that quantisation changed by their contribution to the error (module docstring)."""
    import torch

    fp8_params = dict(fp8_model.named_parameters())
    rows = []
    for name, p in ref_model.named_parameters():
        q = fp8_params[name]
        if torch.equal(p, q):
            continue
        row = {"name": name.removesuffix(".weight"), "weight_rel_error": rel_error(p, q)}
        if mode == "ablation":
            original = p.data.clone()
            p.data.copy_(q.data)
            row["mean_abs_logprob_change"] = compare(ref_lp, continuation_logprobs(ref_model, sequences))["mean_abs"]
            p.data.copy_(original)
        rows.append(row)
    key = "mean_abs_logprob_change" if mode == "ablation" else "weight_rel_error"
    return sorted(rows, key=lambda r: -r[key])


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The whole check; returns the report (without the verdict).

    Memory: the checkpoint's tensors plus two models, about three times the checkpoint size in RAM; meant for
    models that fit one machine (small members of a family, or proxies), not 235B/671B on a laptop.
    """
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    transformers.utils.logging.disable_progress_bar()
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    config = AutoConfig.from_pretrained(args.hf, trust_remote_code=False)
    state = load_checkpoint(args.hf)
    names, skipped = select(state, args)
    prompts = load_prompts(args, config.vocab_size)  # before the models: a bad prompt file fails fast
    ckpt_errors = quantize_state(state, names, args, dtype)
    ref_model = AutoModelForCausalLM.from_pretrained(args.hf, dtype=dtype, trust_remote_code=False).eval()
    fp8_model = type(ref_model).from_pretrained(None, config=config, state_dict=state, dtype=dtype).eval()
    del state

    sequences = []
    for prompt, given in prompts:
        if given is None:
            ids = torch.tensor([prompt])
            out = ref_model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=args.max_new_tokens,
                min_new_tokens=args.max_new_tokens,  # a fixed length: eos cannot end it early
                pad_token_id=0,  # one sequence at a time, nothing is padded; silences the missing-pad warning
            )
            given = out[0, len(prompt) :].tolist()
        sequences.append((prompt, given))
    ref_lp = continuation_logprobs(ref_model, sequences)
    metrics = compare(ref_lp, continuation_logprobs(fp8_model, sequences))
    ranked = attribute(ref_model, fp8_model, sequences, ref_lp, args.attribution)
    return {
        "checkpoint": str(args.hf),
        "model_type": config.model_type,
        "dtype": args.dtype,
        "block": list(args.block),
        "num_sequences": len(sequences),
        "num_tokens": int(ref_lp[1].numel()),
        "metrics": metrics,
        "attribution": args.attribution,
        "top_layers": ranked[:10],
        "quantized": names,
        "skipped": skipped,
        "checkpoint_weight_rel_error": ckpt_errors,
        "corrupted": args.corrupt_scale and {"name": args.corrupt_scale, "factor": args.corrupt_factor},
        "activation_quantization_modelled": False,
        "edge_blocks": "partial (DeepSeek-style ceil scale grid)",
    }


def verdict(metrics: dict[str, float], args: argparse.Namespace) -> tuple[dict[str, float], list[str]]:
    """Thresholds and the list of failed criteria (empty means PASS)."""
    thresholds = {key: getattr(args, key) for key in ("max_mean_abs", "max_p99_abs", "max_kl", "min_top1")}
    failures = [
        f"{key} {metrics[key]:.4g} > {limit:g}"
        for key, limit in (("mean_abs", args.max_mean_abs), ("p99_abs", args.max_p99_abs), ("kl_mean", args.max_kl))
        if not metrics[key] <= limit
    ]
    if not metrics["top1"] >= args.min_top1:
        failures.append(f"top1 {metrics['top1']:.4g} < {args.min_top1:g}")
    return thresholds, failures


def mcore_to_hf(mcore: Path, out: Path) -> Path:
    """Megatron checkpoint -> a temporary HF directory through tools/convert_checkpoint.py (same weight maps)."""
    if not mcore.is_dir():
        raise InputError(f"--mcore {mcore}: no such directory")
    convert = Path(__file__).resolve().parent / "convert_checkpoint.py"
    cmd = [sys.executable, str(convert), "mcore-to-hf", "--mcore", str(mcore), "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise InputError(f"--mcore {mcore}: conversion to HF failed: {done.stderr.strip()[-800:]}")
    return out


def main(argv: list[str] | None = None) -> int:
    """Entry point: returns the exit status."""
    args = parse_args(argv)
    try:
        with tempfile.TemporaryDirectory(prefix="fp8_parity_") as tmp:
            if args.mcore is not None:
                args.hf = mcore_to_hf(args.mcore, Path(tmp) / "hf")
            validate(args)
            report = run(args)
    except InputError as err:
        print(f"fp8_parity: error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except Exception:  # e.g. an unreadable safetensors file: never let a crash read as FAIL (Python exits 1)
        traceback.print_exc()
        print("fp8_parity: error: the check could not run (see above); this is not a verdict", file=sys.stderr)
        return EXIT_BAD_INPUT
    report["thresholds"], failures = verdict(report["metrics"], args)
    report["verdict"], report["failures"] = ("FAIL" if failures else "PASS"), failures
    m = report["metrics"]
    print(
        f"{report['model_type']} ({args.dtype}): {len(report['quantized'])} tensors quantised, "
        f"{len(report['skipped'])} kept; {report['num_sequences']} sequences, {report['num_tokens']} tokens"
    )
    print(
        f"|logprob diff| mean {m['mean_abs']:.4g}  p99 {m['p99_abs']:.4g}  max {m['max_abs']:.4g}   "
        f"KL(ref||fp8) {m['kl_mean']:.4g}   top-1 agreement {m['top1']:.4f}"
    )
    print("kept in high precision: " + ", ".join(sorted(set(report["skipped"].values()))))
    print(f"most error ({args.attribution}):")
    for row in report["top_layers"]:
        alone = (
            f"  mean |dlogprob| alone {row['mean_abs_logprob_change']:.4g}" if "mean_abs_logprob_change" in row else ""
        )
        print(f"  {row['name']:<60} weight rel err {row['weight_rel_error']:.4f}{alone}")
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))
    print("PASS" if not failures else "FAIL: " + "; ".join(failures))
    return EXIT_FAIL if failures else EXIT_PASS


if __name__ == "__main__":
    sys.exit(main())
