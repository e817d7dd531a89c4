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


def _cuda_actor(dtype: str = "bfloat16", use_ref: bool = True):  # noqa: ANN202
    """A one-rank actor on this GPU (NCCL, distributed optimizer, local spec unless TE imports)."""
    from test_cuda_first_run import QWEN3_MOE_TINY

    from mcore_rl.actor.megatron_actor import MegatronActor
    from mcore_rl.config import ActorConfig, ModelConfig, OptimConfig
    from mcore_rl.parallel.groups import free_port

    cfg = ActorConfig(world_size=1, use_ref=use_ref, mini_batches=1, optim=OptimConfig(distributed=True))
    actor = MegatronActor(0, 1, ModelConfig(hf_config=QWEN3_MOE_TINY, dtype=dtype), cfg, runtime="cuda")
    actor.initialize(("127.0.0.1", free_port()))
    return actor


def _batch():  # noqa: ANN202
    from mcore_rl.actor.batch import TrainBatch

    torch.manual_seed(0)
    batch = TrainBatch([[3, 4, 5], [6, 7]], torch.randint(1, 90, (2, 4)), torch.ones(2, 4))
    batch.tensors.update(advantages=torch.randn(2, 4))
    return batch


@pytest.mark.gpu
def test_cuda_actor_steps_and_returns_host_tensors() -> None:
    """The first CUDA step: micro-batches reach the GPU, logprobs and metrics come back on the host."""
    from mcore_rl.parallel.groups import destroy_model_parallel

    try:
        actor = _cuda_actor()
        batch = _batch()
        logprobs = actor.logprobs(batch).payload
        assert logprobs.device.type == "cpu" and bool(torch.isfinite(logprobs).all())
        batch.tensors["old_logprobs"] = logprobs
        metrics = actor.update(batch).payload
        assert metrics["actor/update_ok"] == 1.0
    finally:
        destroy_model_parallel()


@pytest.mark.gpu
def test_cuda_offload_moves_the_fp32_masters_and_onload_restores_logprobs() -> None:
    from mcore_rl.actor.offload import offload_targets
    from mcore_rl.parallel.groups import destroy_model_parallel

    try:
        actor = _cuda_actor()
        batch = _batch()
        batch.tensors["old_logprobs"] = actor.logprobs(batch).payload
        actor.update(batch)  # Adam's state and the masters exist
        before = actor.logprobs(batch).payload
        torch.cuda.synchronize()
        allocated = torch.cuda.memory_allocated()
        moved = actor.offload()
        assert moved["master_params"] > 0 and moved["optimizer_state"] > 0
        assert all(not p.is_cuda for p in offload_targets(actor)["master_params"])
        assert torch.cuda.memory_allocated() < allocated - moved["master_params"]
        actor.onload()
        assert torch.equal(actor.logprobs(batch).payload, before)
        actor.update(batch)  # the optimizer steps on the restored state
    finally:
        destroy_model_parallel()
