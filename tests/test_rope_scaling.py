"""RoPE scaling (linear, llama3, yarn) against transformers: the Megatron model built from a checkpoint reproduces
transformers' logits at positions beyond original_max_position_embeddings, and conversion carries the settings.

    .venv/bin/pytest -q tests/test_rope_scaling.py

Tiny random checkpoints (2 layers, hidden 64, GQA 4/2 heads of 16, vocab 128) are built by transformers in fp32 and
saved as safetensors; their rope scales a pretraining context of 16 positions and the inputs are 64 tokens long, so
every variant changes most rotary frequencies at the positions the test reads. Each is loaded through the project's
path (family -> TransformerConfig -> GPTModel -> weight map) on 2 gloo ranks under PP2 and under TP2 with sequence
parallelism (every stage and every TP rank builds its own rotary embedding). Bound: 1e-4 absolute on fp32 logits
(measured about 1e-6). The control: the same weights with the rope scaling removed from config.json (default RoPE)
miss transformers' logits by more than 100x that bound, so a model built with the scaling dropped cannot pass.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from _parity import build_and_load, forward_logits

from mcore_rl.models.base import HFConfig, UnsupportedModel
from mcore_rl.models.registry import get_family
from mcore_rl.models.rope import read_rope
from mcore_rl.parallel.harness import run_on_ranks
from mcore_rl.parallel.layout import ParallelLayout

TOOLS = Path(__file__).resolve().parents[1] / "tools"
sys.path.insert(0, str(TOOLS))
import convert_checkpoint  # noqa: E402

ATOL = 1e-4
VOCAB, SEQ, BATCH, ORIGINAL = 128, 64, 2, 16
LAYOUTS = [ParallelLayout(tp=1, pp=2), ParallelLayout(tp=2, pp=1, sequence_parallel=True)]
TINY = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=SEQ,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    # Weights 5x transformers' default scale: with 0.02 the attention is near uniform and dropping the scaling moves
    # the logits by only ~5e-3; with 0.1 by ~3 (logits of magnitude ~3).
    initializer_range=0.1,
)
#: variant -> (family, rope settings as transformers 5 writes them in rope_parameters)
VARIANTS = {
    "linear": ("llama", dict(rope_type="linear", factor=4.0)),
    # Llama 3.1/3.2's own form, with the pretraining context shrunk from 8192 to 16
    "llama3": (
        "llama",
        dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=ORIGINAL,
        ),
    ),
    # Qwen2.5 / Qwen3's long-context form: attention factor mscale(factor)
    "yarn": ("llama", dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=ORIGINAL)),
    # every yarn knob off its default, on a Qwen-style family: the attention factor from mscale / mscale_all_dim and
    # an unrounded correction range
    "yarn-qwen3": (
        "qwen3",
        dict(
            rope_type="yarn",
            factor=4.0,
            original_max_position_embeddings=ORIGINAL,
            beta_fast=8.0,
            beta_slow=2.0,
            mscale=1.0,
            mscale_all_dim=0.5,
            truncate=False,
        ),
    ),
}
#: the variant written in the older config.json form (rope_scaling + top-level rope_theta, "type" not "rope_type"),
#: and converted HF -> Megatron -> HF by tools/convert_checkpoint.py
LEGACY = "llama3"


def _convert(*argv: object) -> int:
    return convert_checkpoint.main([str(a) for a in argv] + ["--nproc", "1"])


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def _save_tiny(path: Path, family: str, rope: dict) -> torch.Tensor:
    """Save a tiny random transformers model with this rope to `path`; return its logits on `_ids()`."""
    import transformers

    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }
    config_cls, model_cls = classes[family]
    config = config_cls(**TINY, rope_parameters=dict(rope, rope_theta=10000.0))
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = model_cls(config).float().eval()
    with torch.no_grad():  # HF initialises norms to ones: randomise them so nothing is hidden behind a constant
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
    model.save_pretrained(path)
    with torch.no_grad():
        return model(_ids()).logits


def _rewrite_config(path: Path, edit) -> None:  # noqa: ANN001 - a function of the config dict
    config_path = path / "config.json"
    config = json.loads(config_path.read_text())
    edit(config)
    config_path.write_text(json.dumps(config, indent=2))


def _to_legacy(config: dict) -> None:
    """rope_parameters -> rope_scaling + top-level rope_theta, as Llama 3.x's released config.json has them."""
    params = dict(config.pop("rope_parameters"))
    config["rope_theta"] = params.pop("rope_theta")
    params["type"] = params.pop("rope_type")
    config["rope_scaling"] = params


def _to_default(config: dict) -> None:
    """The same model with the rope scaling dropped (the control)."""
    theta = (config.get("rope_parameters") or {}).get("rope_theta", config.get("rope_theta"))
    config.pop("rope_scaling", None)
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}


def logits_rank(rank: int, world: int, jobs: list[tuple[str, str, str, list]], ids: torch.Tensor) -> dict:
    """Per (name, kind, directory, layouts) job and layout: the full logits from whichever rank holds them.

    kind "hf": built and filled from an HF checkpoint; "mcore": built from a converted torch_dist checkpoint's
    hf/config.json and loaded through Megatron's dist_checkpointing."""
    from mcore_rl.models.builder import build_gpt_chunks
    from mcore_rl.parallel.groups import initialize_model_parallel
    from mcore_rl.resharding.dist_ckpt import load_model_chunks

    out: dict = {}
    for name, kind, directory, layouts in jobs:
        for i, layout in enumerate(layouts):
            if kind == "hf":
                chunks, _, _, pg = build_and_load(directory, layout)
            else:
                pg = initialize_model_parallel(layout)
                meta = json.loads((Path(directory) / convert_checkpoint.LAYOUT_FILE).read_text())
                config = json.loads((Path(directory) / "hf" / "config.json").read_text())
                spec = convert_checkpoint._spec(config, layout, meta["dtype"], meta["make_vocab_size_divisible_by"])
                chunks, _ = build_gpt_chunks(spec, pg)
                load_model_chunks(chunks, pg, directory)
            logits = forward_logits(chunks, pg, ids)
            if logits is not None and pg.tp.rank() == 0 and pg.dp.rank() == 0:
                out[(name, i)] = logits[-1][..., :VOCAB]
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Every checkpoint saved, the legacy one converted both ways, and all of them run in one spawn of 2 ranks
    (starting ranks costs more than these models' forwards). Returns references, Megatron logits and paths."""
    root = tmp_path_factory.mktemp("rope")
    refs, jobs = {}, []
    for name, (family, rope) in VARIANTS.items():
        path = root / name
        refs[name] = _save_tiny(path, family, rope)
        if name == LEGACY:
            _rewrite_config(path, _to_legacy)
        control = root / f"{name}-default"
        shutil.copytree(path, control)
        _rewrite_config(control, _to_default)
        jobs += [(name, "hf", str(path), LAYOUTS), (f"{name}-default", "hf", str(control), LAYOUTS[:1])]
    mcore, back = root / "mcore", root / "back"
    assert _convert("hf-to-mcore", "--hf", root / LEGACY, "--out", mcore) == 0
    assert _convert("mcore-to-hf", "--mcore", mcore, "--out", back) == 0
    jobs.append(("converted", "mcore", str(mcore), LAYOUTS[:1]))
    merged: dict = {}
    for part in run_on_ranks(logits_rank, 2, (jobs, _ids())):
        merged.update(part)
    return dict(refs=refs, logits=merged, root=root, mcore=mcore, back=back)


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    return (got - want).abs().max().item()


@pytest.mark.slow  # multi-rank (gloo): the fast tier (-m 'not slow') leaves it out
@pytest.mark.parametrize("name", list(VARIANTS))
def test_scaled_rope_logits_match_transformers(runs: dict, name: str) -> None:
    for i, layout in enumerate(LAYOUTS):
        err = _err(runs["logits"][(name, i)], runs["refs"][name])
        assert err < ATOL, f"{name} {layout.describe()}: max |logits diff| {err:.2e} >= {ATOL}"


@pytest.mark.slow  # multi-rank (gloo): the fast tier (-m 'not slow') leaves it out
@pytest.mark.parametrize("name", list(VARIANTS))
def test_default_rope_control_does_not_match(runs: dict, name: str) -> None:
    err = _err(runs["logits"][(f"{name}-default", 0)], runs["refs"][name])
    assert err > 100 * ATOL, f"{name}: default RoPE is within {err:.2e} of the scaled model; the test cannot fail"


@pytest.mark.slow  # multi-rank (gloo): the fast tier (-m 'not slow') leaves it out
def test_conversion_carries_rope_scaling_both_ways(runs: dict) -> None:
    import transformers

    source = json.loads((runs["root"] / LEGACY / "config.json").read_text())
    for config_path in (runs["mcore"] / "hf" / "config.json", runs["back"] / "config.json"):
        config = json.loads(config_path.read_text())
        assert config["rope_scaling"] == source["rope_scaling"], config_path
        assert config["rope_theta"] == source["rope_theta"], config_path
    # the torch_dist checkpoint, built from its own hf/config.json, is the scaled model
    err = _err(runs["logits"][("converted", 0)], runs["refs"][LEGACY])
    assert err < ATOL, f"converted torch_dist checkpoint: max |logits diff| {err:.2e} >= {ATOL}"
    # and the exported HF directory is too, read by transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(runs["back"], attn_implementation="eager")
    assert model.config.rope_parameters["rope_type"] == "llama3"
    with torch.no_grad():
        err = _err(model.float().eval()(_ids()).logits, runs["refs"][LEGACY])
    assert err < 1e-5, f"exported HF checkpoint: max |logits diff| {err:.2e}"


def test_both_config_forms_read_the_same() -> None:
    """rope_parameters (transformers >= 5) and rope_scaling + rope_theta (older) give one reading."""
    new = dict(TINY, model_type="llama", rope_parameters=dict(VARIANTS["llama3"][1], rope_theta=5e5))
    old = dict(TINY, model_type="llama", rope_theta=5e5)
    old["rope_scaling"] = {k: v for k, v in VARIANTS["llama3"][1].items() if k != "rope_type"} | {"type": "llama3"}
    assert read_rope(HFConfig(new)) == read_rope(HFConfig(old))
    rope = read_rope(HFConfig(old))
    assert (rope.rope_type, rope.theta, rope.factor) == ("llama3", 5e5, 8.0)
    assert (rope.low_freq_factor, rope.high_freq_factor, rope.original_max_position_embeddings) == (1.0, 4.0, 16)


@pytest.mark.parametrize(
    "model_type,rope,match",
    [
        ("llama", dict(rope_type="dynamic", factor=2.0), r"'dynamic' .*supported: default, linear, llama3, yarn"),
        ("qwen2", dict(rope_type="longrope", short_factor=[1.0], long_factor=[2.0]), r"rope_type='longrope'"),
        ("llama", dict(rope_type="llama3", factor=8.0, high_freq_factor=4.0), r"llama3.*'low_freq_factor'"),
        ("qwen3", dict(rope_type="yarn", factor=4.0, attention_factor=2.0), r"yarn attention_factor=2\.0"),
        ("llama", dict(rope_type="linear", factor=2.0, partial_rotary_factor=0.5), r"partial_rotary_factor=0\.5"),
        ("deepseek_v3", dict(rope_type="llama3", factor=8.0), r"rope_type='llama3' .*supported: default, yarn"),
    ],
)
def test_unsupported_rope_is_refused_naming_it(model_type: str, rope: dict, match: str) -> None:
    raw = dict(TINY, model_type=model_type, rope_parameters=dict(rope, rope_theta=1e4))
    with pytest.raises(UnsupportedModel, match=match):
        get_family(model_type).rope(HFConfig(raw))


def test_unsupported_rope_exits_2_through_the_converter(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    _save_tiny(tmp_path / "hf", "llama", dict(rope_type="linear", factor=2.0))
    _rewrite_config(tmp_path / "hf", lambda c: c["rope_parameters"].update(rope_type="dynamic"))
    assert _convert("hf-to-mcore", "--hf", tmp_path / "hf", "--out", tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert "rope_type='dynamic'" in err and "supported: default, linear, llama3, yarn" in err
    assert not (tmp_path / "out").exists()
