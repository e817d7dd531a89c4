"""tools/convert_checkpoint.py end to end on a tiny DeepSeek-V3 (MLA, MoE, MTP): HF -> mcore -> HF, resharding, FP8.

    .venv/bin/pytest -q tests/test_convert.py

- hf-to-mcore under EP2, then the torch_dist checkpoint loaded under TP2 x PP2 x EP2 (ETP1): logits equal the
  transformers model's (fp32, 1e-5); mcore-to-hf under TP2 x PP2 equals the original checkpoint bit for bit and loads
  with transformers.AutoModelForCausalLM with no missing or unexpected keys.
- FP8: a DeepSeek-style FP8 checkpoint (float8_e4m3fn + 128x128 weight_scale_inv, quantization_config) is
  dequantised on import; with fp32 parameters, mcore-to-hf --fp8 reproduces the FP8 checkpoint bit for bit.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from _parity import assert_bit_exact, forward_logits, hf_state, tiny_deepseek_v3

from mcore_rl.parallel.harness import run_on_ranks
from mcore_rl.parallel.layout import ParallelLayout
from mcore_rl.resharding.hf_io import HFCheckpointWriter

TOOLS = Path(__file__).resolve().parents[1] / "tools"
sys.path.insert(0, str(TOOLS))
import convert_checkpoint  # noqa: E402

VOCAB = 100


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))


def mcore_logits_rank(rank: int, world: int, mcore_dir: str, layout: ParallelLayout, ids: torch.Tensor):
    """Load a converted torch_dist checkpoint under `layout` and return the last stage's logits."""
    from mcore_rl.models.builder import build_gpt_chunks
    from mcore_rl.parallel.groups import initialize_model_parallel
    from mcore_rl.resharding.dist_ckpt import load_model_chunks

    pg = initialize_model_parallel(layout)
    meta = json.loads((Path(mcore_dir) / convert_checkpoint.LAYOUT_FILE).read_text())
    config = json.loads((Path(mcore_dir) / "hf" / "config.json").read_text())
    spec = convert_checkpoint._spec(config, layout, meta["dtype"], meta["make_vocab_size_divisible_by"])
    chunks, _ = build_gpt_chunks(spec, pg)
    load_model_chunks(chunks, pg, mcore_dir)
    logits = forward_logits(chunks, pg, ids)
    return logits if logits is not None and pg.tp.rank() == 0 else None


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    path = tmp_path_factory.mktemp("deepseek")
    (path / "tokenizer_config.json").write_text("{}")
    ref = tiny_deepseek_v3(path, _ids())
    (path / "tokenizer_config.json").write_text('{"model_max_length": 64}')
    return path, ref


def _convert(*argv: str) -> int:
    return convert_checkpoint.main([str(a) for a in argv])


@pytest.mark.slow  # multi-rank (gloo): the fast tier (-m 'not slow') leaves it out
def test_round_trip_reshard_and_transformers_load(deepseek, tmp_path: Path) -> None:
    hf_dir, ref = deepseek
    mcore, back = tmp_path / "mcore", tmp_path / "hf"
    assert _convert("hf-to-mcore", "--hf", hf_dir, "--out", mcore, "--ep", 2, "--dtype", "fp32") == 0
    assert (mcore / "hf" / "config.json").is_file() and (mcore / "hf" / "tokenizer_config.json").is_file()

    layout = ParallelLayout(tp=2, pp=2, ep=2, etp=1, sequence_parallel=True)
    results = run_on_ranks(mcore_logits_rank, 4, (str(mcore), layout, _ids()))
    logits = next(r for r in results if r is not None)
    for got, want in zip(logits, ref["mtp_logits"] + [ref["logits"]]):
        assert (got[..., :VOCAB] - want).abs().max().item() < 1e-5

    argv = ("mcore-to-hf", "--mcore", mcore, "--out", back, "--nproc", 3)
    assert _convert(*argv, "--max-shard-size", "40KB") == 0
    assert len(list(back.glob("model-*-of-*.safetensors"))) > 1
    assert_bit_exact(hf_state(back), hf_state(hf_dir))
    assert json.loads((back / "tokenizer_config.json").read_text()) == {"model_max_length": 64}
    assert (back / "generation_config.json").is_file()

    import transformers

    model, info = transformers.AutoModelForCausalLM.from_pretrained(back, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"]
    # transformers' DeepseekV3ForCausalLM has no MTP modules: the MTP layer (model.layers.2.*, as DeepSeek stores it)
    # is the only thing it does not load. Its own ignore list names layer 61, DeepSeek-V3's real MTP index.
    assert info["unexpected_keys"] and all(k.startswith("model.layers.2.") for k in info["unexpected_keys"])
    with torch.no_grad():
        loaded = model.float().eval()(_ids()).logits
    assert (loaded - ref["logits"]).abs().max().item() < 1e-5  # sdpa here, eager in the reference


def _quantise_checkpoint(src: Path, dst: Path) -> None:
    from mcore_rl.kernels.fp8_blockwise import quantize_blockwise

    state = hf_state(src)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    with HFCheckpointWriter(dst, max_shard_bytes=1 << 20) as writer:
        for name, t in state.items():
            if convert_checkpoint.QUANTIZE_RULE.match(name):
                q, scale_inv = quantize_blockwise(t)
                writer.add(name, q)
                writer.add(name + "_scale_inv", scale_inv)
            else:
                writer.add(name, t)
        writer.write_config(config)


@pytest.mark.slow  # multi-rank (gloo): the fast tier (-m 'not slow') leaves it out
def test_fp8_import_dequantises_and_fp8_export_reproduces(deepseek, tmp_path: Path) -> None:
    from mcore_rl.kernels.fp8_blockwise import dequantize_blockwise

    hf_dir, _ = deepseek
    fp8, mcore, back = tmp_path / "fp8", tmp_path / "mcore", tmp_path / "back"
    _quantise_checkpoint(hf_dir, fp8)
    assert _convert("hf-to-mcore", "--hf", fp8, "--out", mcore, "--dtype", "fp32") == 0
    assert "quantization_config" not in json.loads((mcore / "hf" / "config.json").read_text())
    assert _convert("mcore-to-hf", "--mcore", mcore, "--out", back, "--fp8", "--nproc", 2) == 0
    # fp32 parameters hold q * scale exactly, so re-quantising finds the same scales and codes.
    original, exported = hf_state(fp8), hf_state(back)
    assert_bit_exact(exported, original)
    assert json.loads((back / "config.json").read_text())["quantization_config"]["weight_block_size"] == [128, 128]
    name = "model.layers.1.mlp.experts.3.down_proj.weight"
    w = dequantize_blockwise(exported[name], exported[name + "_scale_inv"], dtype=torch.float32)
    assert (w - hf_state(hf_dir)[name]).abs().max() < 0.1 * hf_state(hf_dir)[name].abs().max()


@pytest.mark.slow  # multi-rank (gloo): the fast tier (-m 'not slow') leaves it out
def test_fp8_import_to_bf16_rounds_the_fp32_product_once(deepseek, tmp_path: Path) -> None:
    """With bf16 parameters every FP8 weight holds bf16(fp32(q) * scale_inv): dequantised straight to bf16 by the
    reader, the same bits as rounding the reference's fp32 result."""
    from mcore_rl.kernels.fp8_blockwise import dequantize_blockwise_ref

    hf_dir, _ = deepseek
    fp8, mcore, back = tmp_path / "fp8", tmp_path / "mcore", tmp_path / "back"
    _quantise_checkpoint(hf_dir, fp8)
    assert _convert("hf-to-mcore", "--hf", fp8, "--out", mcore, "--dtype", "bf16") == 0
    assert _convert("mcore-to-hf", "--mcore", mcore, "--out", back, "--nproc", 2) == 0
    original, exported = hf_state(fp8), hf_state(back)
    quantised = [n for n, t in original.items() if t.dtype == torch.float8_e4m3fn]
    assert len(quantised) > 10
    for name in quantised:
        expected = dequantize_blockwise_ref(original[name], original[name + "_scale_inv"], dtype=torch.float32)
        assert exported[name].dtype == torch.bfloat16 and torch.equal(exported[name], expected.to(torch.bfloat16))


def megatron_save_rank(rank: int, world: int, hf_dir: str, out: str, layout: ParallelLayout) -> None:
    """Megatron's own save: the model built under `layout`, filled from HF, saved by dist_checkpointing."""
    from megatron.core import dist_checkpointing

    from mcore_rl.models.builder import build_gpt_chunks
    from mcore_rl.parallel.groups import initialize_model_parallel
    from mcore_rl.resharding.hf_io import HFCheckpointReader
    from mcore_rl.resharding.weight_map import load_hf_weights

    pg = initialize_model_parallel(layout)
    reader = HFCheckpointReader(hf_dir)
    spec = convert_checkpoint._spec(dict(reader.config), layout, "fp32", 128)
    chunks, contexts = build_gpt_chunks(spec, pg)
    load_hf_weights(chunks, contexts, spec.weight_map(), reader.read)
    sharded = {"model": chunks[0].sharded_state_dict(metadata={"dp_cp_group": pg.dp_cp})}
    dist_checkpointing.save(sharded, out)


@pytest.mark.slow  # multi-rank (gloo): the fast tier (-m 'not slow') leaves it out
def test_written_chunks_are_those_of_megatrons_own_save(deepseek, tmp_path: Path) -> None:
    """hf-to-mcore (no model built) writes the keys, global shapes, dtypes, chunks, objects and values that Megatron's
    own dist_checkpointing.save writes for the filled model at tp=pp=ep=1."""
    import pickle

    from mcore_rl.resharding.dist_ckpt import ChunkReader, Piece

    hf_dir, _ = deepseek
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    theirs.mkdir()
    assert _convert("hf-to-mcore", "--hf", hf_dir, "--out", ours, "--dtype", "fp32", "--nproc", 2) == 0
    run_on_ranks(megatron_save_rank, 1, (str(hf_dir), str(theirs), ParallelLayout()))
    metadata = [pickle.loads((d / ".metadata").read_bytes()).state_dict_metadata for d in (ours, theirs)]
    assert sorted(metadata[0]) == sorted(metadata[1])  # tensor keys and ShardedObject keys
    with ChunkReader(ours) as a, ChunkReader(theirs) as b:
        assert len(a.tensors) > 20
        for key, md in b.tensors.items():
            mine = a.tensors[key]
            assert (mine.size, mine.properties.dtype) == (md.size, md.properties.dtype), key
            chunks = sorted((tuple(c.offsets), tuple(c.sizes)) for c in md.chunks)
            assert sorted((tuple(c.offsets), tuple(c.sizes)) for c in mine.chunks) == chunks, key
            for offset, sizes in chunks:
                piece = Piece(key, tuple(md.size), offset, sizes, view=((), (), 0))
                assert torch.equal(a.read_region(piece), b.read_region(piece)), (key, offset)


@pytest.mark.slow  # multi-rank (gloo): the fast tier (-m 'not slow') leaves it out
def test_checkpoint_saved_by_megatron_under_tp_and_ep_exports_bit_exact(deepseek, tmp_path: Path) -> None:
    """mcore-to-hf reads a checkpoint Megatron saved under TP2 x EP2 (chunks split unlike ours: TP halves of each
    GLU gate and up, vocab rows, MLA heads) and assembles the same HF tensors, bit for bit. The checkpoint sits in a
    Megatron-LM save directory (latest_checkpointed_iteration.txt + iter_0000007/) with no HF config of its own:
    --hf-config names the model, and the dtype and padded vocabulary come from the checkpoint."""
    hf_dir, _ = deepseek
    save, back = tmp_path / "save", tmp_path / "back"
    (save / "iter_0000007").mkdir(parents=True)
    (save / "latest_checkpointed_iteration.txt").write_text("7\n")
    layout = ParallelLayout(tp=2, ep=2, sequence_parallel=True)
    run_on_ranks(megatron_save_rank, 4, (str(hf_dir), str(save / "iter_0000007"), layout))
    assert _convert("mcore-to-hf", "--mcore", save, "--hf-config", hf_dir, "--out", back, "--nproc", 2) == 0
    assert_bit_exact(hf_state(back), hf_state(hf_dir))
    assert json.loads((back / "config.json").read_text())["dtype"] == "float32"
    assert (back / "tokenizer_config.json").is_file()  # side files from the --hf-config directory


@pytest.mark.slow  # multi-rank (gloo): the fast tier (-m 'not slow') leaves it out
def test_virtual_pipeline_checkpoint_loads_without_it(tmp_path: Path) -> None:
    """hf-to-mcore under PP2 x VPP2 (layer offsets of interleaved stages), back to HF under PP1: bit exact."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=4,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    hf_dir, mcore, back = tmp_path / "hf", tmp_path / "mcore", tmp_path / "back"
    Qwen3ForCausalLM(config).float().save_pretrained(hf_dir)
    assert _convert("hf-to-mcore", "--hf", hf_dir, "--out", mcore, "--pp", 2, "--vpp", 2) == 0
    assert _convert("mcore-to-hf", "--mcore", mcore, "--out", back, "--nproc", 1) == 0
    assert_bit_exact(hf_state(back), hf_state(hf_dir))


@pytest.mark.slow  # multi-rank (gloo): the fast tier (-m 'not slow') leaves it out
def test_bench_smoke(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """tools/bench_convert.py at a tiny size: both directions run and the report has rates, ratios and RSS."""
    import bench_convert

    argv = ["--size-gb", "0.01", "--layers", "4", "--experts", "8", "--nproc", "2", "--workdir", str(tmp_path / "b")]
    assert bench_convert.main(argv) == 0
    out = capsys.readouterr().out
    for needle in ("hf-to-mcore", "mcore-to-hf", "raw read", "raw copy", "ratio", "peak RSS"):
        assert needle in out
    assert not (tmp_path / "b").exists()


def test_bench_cold_without_permission_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch) -> None:
    """--cold needs to evict the page cache; where it cannot, the bench says what it needs and exits 2 before
    building anything."""
    import bench_convert

    monkeypatch.setattr(bench_convert, "DROP_CACHES", tmp_path / "no_such_dir" / "drop_caches")
    argv = ["--size-gb", "0.01", "--layers", "4", "--experts", "8", "--workdir", str(tmp_path / "b"), "--cold"]
    assert bench_convert.main(argv) == 2
    err = capsys.readouterr().err
    assert "--cold needs to write" in err and "drop_caches" in err
    assert not (tmp_path / "b").exists()
