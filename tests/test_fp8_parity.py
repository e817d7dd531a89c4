"""tools/fp8_parity.py end to end: tiny random Qwen3-MoE and DeepSeek-V3 checkpoints, the tool run as a subprocess.

Tiny models use transformers' default init (std 0.02), so their next-token distributions are nearly flat. Measured
on them with bf16 weights: clean FP8 gives mean |logprob diff| ~0.002-0.006, p99 ~0.005-0.02, KL ~1e-5; one o_proj
scale multiplied by 8 gives mean ~0.12, KL ~8e-3, top-1 ~0.1-0.2. LOOSE sits between the two with margin.
Top-1 agreement is only loosely bounded: on a nearly flat distribution ties flip under any perturbation.
"""

import json
import os
import string
import subprocess
import sys
from pathlib import Path

import pytest
import torch

TOOL = Path(__file__).resolve().parents[1] / "tools" / "fp8_parity.py"
LOOSE = ["--max-mean-abs", "0.03", "--max-p99-abs", "0.1", "--max-kl", "1e-3", "--min-top1", "0.5"]
RANDOM = ["--random-prompts", "3", "--prompt-len", "12", "--max-new-tokens", "6"]


def run_tool(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, env=env, timeout=120)


def _save_char_tokenizer(directory: Path) -> None:
    """A character-level tokenizer (97 ids < vocab 128) with a chat template, for the --prompts paths."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate(string.printable[:95])}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<eos>")
    tok.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    tok.save_pretrained(directory)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    from transformers import AutoModelForCausalLM, DeepseekV3Config, Qwen3MoeConfig

    common = dict(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32)
    common.update(num_hidden_layers=2, num_attention_heads=4, num_experts_per_tok=2, max_position_embeddings=256)
    configs = {
        "qwen3_moe": Qwen3MoeConfig(**common, num_key_value_heads=2, head_dim=16, num_experts=4),
        "deepseek_v3": DeepseekV3Config(
            **common,
            num_key_value_heads=4,
            n_routed_experts=4,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            q_lora_rank=32,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=16,
        ),
    }
    paths = {}
    for name, config in configs.items():
        torch.manual_seed(0)
        paths[name] = tmp_path_factory.mktemp(name)
        AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(paths[name])
    _save_char_tokenizer(paths["qwen3_moe"])
    return paths


def test_help_exits_zero():
    result = run_tool("--help")
    assert result.returncode == 0 and "--max-mean-abs" in result.stdout and "Exit status" in result.stdout


def test_qwen3_moe_passes_and_json_holds_every_figure(checkpoints, tmp_path):
    out = tmp_path / "parity.json"
    result = run_tool("--hf", str(checkpoints["qwen3_moe"]), *RANDOM, *LOOSE, "--json", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip().endswith("PASS")
    report = json.loads(out.read_text())
    assert report["verdict"] == "PASS" and report["failures"] == []
    assert report["num_sequences"] == 3 and report["num_tokens"] == 3 * 6
    assert set(report["metrics"]) == {"mean_abs", "p99_abs", "max_abs", "kl_mean", "top1"}
    assert 0 < report["metrics"]["mean_abs"] <= report["metrics"]["p99_abs"] <= report["metrics"]["max_abs"]
    assert report["thresholds"]["max_kl"] == 1e-3
    # Rule: 4 attention projections + 4 experts x 3 projections per layer; router, norms, embeddings kept.
    assert len(report["quantized"]) == 2 * (4 + 4 * 3)
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in report["quantized"]
    skipped = report["skipped"]
    assert skipped["model.layers.0.mlp.gate.weight"] == "router"
    assert skipped["model.embed_tokens.weight"] == "embedding" and skipped["lm_head.weight"] == "lm_head"
    assert skipped["model.layers.0.self_attn.q_norm.weight"] == "norm"
    # RMS relative error of e4m3 on Gaussian weights is ~2.6%; anything far off means a wrong scale.
    assert all(0.01 < e < 0.05 for e in report["checkpoint_weight_rel_error"].values())
    top = report["top_layers"]
    assert len(top) == 10 and report["attribution"] == "ablation"
    changes = [row["mean_abs_logprob_change"] for row in top]
    assert changes == sorted(changes, reverse=True) and changes[0] > 0
    assert report["activation_quantization_modelled"] is False


@pytest.mark.long
@pytest.mark.slow
def test_megatron_checkpoint_gives_the_same_figures_as_its_hf_source(checkpoints, tmp_path):
    convert = TOOL.parent / "convert_checkpoint.py"
    mcore = tmp_path / "mcore"
    done = subprocess.run(
        [sys.executable, str(convert), "hf-to-mcore", "--hf", str(checkpoints["qwen3_moe"]), "--out", str(mcore),
         "--ep", "2"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    figures = []
    for source in (["--hf", str(checkpoints["qwen3_moe"])], ["--mcore", str(mcore)]):
        out = tmp_path / f"{source[0][2:]}.json"
        result = run_tool(*source, *RANDOM, *LOOSE, "--attribution", "weight-error", "--json", str(out))
        assert result.returncode == 0, result.stdout + result.stderr
        figures.append(json.loads(out.read_text())["metrics"])
    # Conversion is bit-exact, so quantisation and logprobs are the same to the last digit.
    assert figures[0] == figures[1]


def test_deepseek_v3_passes_with_mla_and_shared_experts(checkpoints, tmp_path):
    out = tmp_path / "parity.json"
    args = ("--hf", str(checkpoints["deepseek_v3"]), *RANDOM, *LOOSE, "--dtype", "fp32", "--json", str(out))
    result = run_tool(*args, "--attribution", "weight-error")
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    quantized, skipped = set(report["quantized"]), report["skipped"]
    for name in ("self_attn.q_a_proj", "self_attn.q_b_proj", "self_attn.kv_a_proj_with_mqa", "self_attn.kv_b_proj"):
        assert f"model.layers.0.{name}.weight" in quantized
    assert "model.layers.0.mlp.gate_proj.weight" in quantized  # the dense first layer
    assert "model.layers.1.mlp.shared_experts.up_proj.weight" in quantized
    assert "model.layers.1.mlp.experts.2.down_proj.weight" in quantized
    assert skipped["model.layers.1.mlp.gate.e_score_correction_bias"] == "router"
    assert skipped["model.layers.0.self_attn.kv_a_layernorm.weight"] == "norm"
    assert "mean_abs_logprob_change" not in report["top_layers"][0]


def test_corrupted_scale_fails_and_is_blamed(checkpoints, tmp_path):
    out = tmp_path / "parity.json"
    target = "model.layers.1.self_attn.o_proj.weight"
    result = run_tool(
        "--hf", str(checkpoints["qwen3_moe"]), *RANDOM, *LOOSE, "--corrupt-scale", target, "--json", str(out)
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "FAIL" in result.stdout and "mean_abs" in result.stdout
    report = json.loads(out.read_text())
    assert report["verdict"] == "FAIL" and report["corrupted"] == {"name": target, "factor": 8.0}
    assert report["top_layers"][0]["name"] == "model.layers.1.self_attn.o_proj"
    assert report["checkpoint_weight_rel_error"][target] > 5  # every element scaled by 8: error ~7x the weight


# The long tier: the prompt file's path through the tool is the CI tier's parquet test below; this one reads JSONL rows
# with a given response (about 12 s in CI).
@pytest.mark.long
def test_jsonl_prompts_use_the_given_response(checkpoints, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    rows = [{"prompt": "hello world", "response": "fine, thanks"}, {"prompt": "2+2="}]
    prompts.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = tmp_path / "parity.json"
    args = ("--hf", str(checkpoints["qwen3_moe"]), "--prompts", str(prompts), "--max-new-tokens", "4")
    result = run_tool(*args, *LOOSE, "--attribution", "weight-error", "--json", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    assert json.loads(out.read_text())["num_tokens"] == len("fine, thanks") + 4  # char tokenizer


def test_parquet_chat_prompts(checkpoints, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    chats = [
        [{"role": "user", "content": "hi"}],
        [{"role": "system", "content": "x"}, {"role": "user", "content": "y"}],
    ]
    prompts = tmp_path / "train.parquet"
    pq.write_table(pa.table({"prompt": chats, "data_source": ["a", "b"]}), prompts)
    args = ("--hf", str(checkpoints["qwen3_moe"]), "--prompts", str(prompts), "--max-new-tokens", "3")
    result = run_tool(*args, *LOOSE, "--attribution", "weight-error")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 sequences, 6 tokens" in result.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--hf", "/nonexistent/ckpt", *RANDOM], "no such directory"),
        (["--hf", "{qwen3_moe}", *RANDOM, "--max-mean-abs", "-1"], "--max-mean-abs must be a finite number >= 0"),
        (["--hf", "{qwen3_moe}", *RANDOM, "--min-top1", "1.5"], r"--min-top1 must be in [0, 1]"),
        (["--hf", "{qwen3_moe}"], "give --prompts FILE or --random-prompts N"),
        (["--mcore", "/some/dir", *RANDOM], "--mcore /some/dir: no such directory"),
        (["--hf", "{qwen3_moe}", *RANDOM, "--include", "norm"], "input_layernorm.weight: shape (64,) cannot be"),
        (["--hf", "{qwen3_moe}", *RANDOM, "--corrupt-scale", "lm_head.weight"], "not one of the quantised tensors"),
        (["--hf", "{deepseek_v3}", "--prompts", "{jsonl}"], "needs a tokenizer"),
    ],
)
def test_bad_input_exits_2_with_a_message(checkpoints, tmp_path, args, message):
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"prompt": "a"}\n')
    result = run_tool(*[a.format(jsonl=jsonl, **checkpoints) for a in args])
    assert result.returncode == 2, result.stdout + result.stderr
    assert message in result.stderr


def test_already_fp8_checkpoint_is_refused(checkpoints, tmp_path):
    fp8_dir = tmp_path / "fp8"
    fp8_dir.mkdir()
    config = json.loads((checkpoints["qwen3_moe"] / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    (fp8_dir / "config.json").write_text(json.dumps(config))
    (fp8_dir / "model.safetensors").write_bytes((checkpoints["qwen3_moe"] / "model.safetensors").read_bytes())
    result = run_tool("--hf", str(fp8_dir), *RANDOM)
    assert result.returncode == 2 and "the reference must be the BF16/FP32 checkpoint" in result.stderr
