"""Uneven first/last pipeline stages on real Megatron models: logits equal transformers', export is bit exact.

    .venv/bin/pytest -q tests/test_uneven_pipeline_parity.py

Two CPU gloo ranks (pp=2). A tiny DeepSeek-V3 with 3 decoder layers (MLA, a dense first layer, MoE after it) and one
MTP layer, which Megatron puts on the last stage on top of its decoder layers, runs with first_stage_layers 1 and 2; a
tiny Qwen3 with 9 layers runs with 4 + 5 layers, with only last_stage_layers given, and interleaved (vpp=3, 3 layers
on rank 0 and 6 on rank 1, so virtual stages of different sizes alternate between the ranks). Same bound as the
family parity tests: fp32 logits within 1e-5 of transformers'; the weights exported back equal the checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _parity import check_layouts, tiny_deepseek_v3
from test_families_dense import TINY

from mcore_rl.parallel.layout import ParallelLayout

pytestmark = pytest.mark.slow  # multi-rank (gloo): the fast tier (-m 'not slow') leaves it out
ATOL = 1e-5
SEQ, BATCH, VOCAB = 12, 2, 100


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def _check(name: str, hf_dir: Path, layouts: list[ParallelLayout], ref: dict) -> None:
    check_layouts(name, hf_dir, layouts, ref, _ids(), world=2, atol=ATOL)


def test_deepseek_v3_odd_layers_uneven_stages_with_mtp(tmp_path: Path) -> None:
    ref = tiny_deepseek_v3(tmp_path, _ids(), num_hidden_layers=3)
    assert len(ref["mtp_logits"]) == 1
    layouts = [ParallelLayout(pp=2, first_stage_layers=1), ParallelLayout(pp=2, first_stage_layers=2)]
    _check("deepseek_v3", tmp_path, layouts, ref)


def test_qwen3_odd_layers_uneven_stages_and_interleaving(tmp_path: Path) -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**{**TINY, "num_hidden_layers": 9}, tie_word_embeddings=False)).float().eval()
    with torch.no_grad():  # HF initialises norms to ones: randomise them so a misplaced layer shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
    model.save_pretrained(tmp_path)
    with torch.no_grad():
        ref = {"logits": model(_ids()).logits, "mtp_logits": []}
    layouts = [
        ParallelLayout(pp=2, first_stage_layers=4, last_stage_layers=5),
        ParallelLayout(pp=2, last_stage_layers=2),
        ParallelLayout(pp=2, vpp=3, first_stage_layers=3),
    ]
    assert layouts[2].pp_stage_layers(9) == [[0], [3], [6], [1, 2], [4, 5], [7, 8]]
    _check("qwen3", tmp_path, layouts, ref)
