"""CUDA runtime (GPU only): Qwen3-MoE on one GPU with NCCL and Transformer Engine's spec when TE imports, logits equal
to transformers' in fp32. Skips on machines without CUDA (the conftest marks `gpu` tests)."""

from __future__ import annotations

import pytest
import torch
from test_qwen3_moe_parity import VOCAB, tiny_qwen3_moe


@pytest.mark.gpu
def test_qwen3_moe_logits_on_cuda_match_transformers(tmp_path):
    from mcore_rl.models.base import HFConfig
    from mcore_rl.models.builder import ModelSpec, build_gpt_chunks
    from mcore_rl.parallel.groups import destroy_model_parallel, free_port, init_distributed, initialize_model_parallel
    from mcore_rl.parallel.layout import ParallelLayout
    from mcore_rl.resharding.hf_io import HFCheckpointReader
    from mcore_rl.resharding.weight_map import load_hf_weights

    ids, ref, _ = tiny_qwen3_moe(str(tmp_path))
    init_distributed("cuda", 0, 1, "127.0.0.1", free_port())
    try:
        layout = ParallelLayout()
        pg = initialize_model_parallel(layout)
        reader = HFCheckpointReader(tmp_path)
        spec = ModelSpec(HFConfig(reader.config), layout, runtime="cuda", make_vocab_size_divisible_by=64)
        chunks, contexts = build_gpt_chunks(spec, pg)
        model = chunks[0].cuda().eval()
        load_hf_weights(chunks, contexts, spec.weight_map(), reader.read)
        with torch.no_grad():
            ids_cuda = ids.cuda()
            out = model(
                input_ids=ids_cuda,
                position_ids=torch.arange(ids.shape[1], device="cuda").expand_as(ids_cuda),
                attention_mask=None,
            )
        assert (out[..., :VOCAB].float().cpu() - ref).abs().max().item() <= 1e-3  # TF32/cuBLAS reductions
    finally:
        destroy_model_parallel()
