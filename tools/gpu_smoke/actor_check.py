"""Kit steps `actor_qwen3_moe` and `actor_dsv3`: the project's Megatron actor on one GPU (world 1, NCCL, distributed
optimizer, bf16, Megatron's local spec where Transformer Engine is absent), on a Qwen3-MoE- or DeepSeek-V3-shaped
model written by transformers:

    parity     logprobs of response tokens against transformers fp32: mean / p99 / max |dlogp|, beside transformers'
               own bf16-vs-fp32 gap as the yardstick (the bar: Megatron within 1.5x of it)
    updates    three optimizer steps: seconds each, tokens/s, model TFLOP/s (6 x active parameters per token)
    memory     the dry run's estimate (models/estimate.py) for these shapes against one more update, term by term
               (memory_check.py): exact storages, CUDA's peak allocated (the profiler's peak on the CPU), ratios
    offload    bytes moved by kind, memory before / after, logprobs equal after onload

Without transformers (a bare box that carries only megatron-core) the model is the actor's own random init and the
parity part is skipped with that reason. --dry-cpu: the same on the CPU runtime (gloo) at a tiny size, no rates.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from typing import Any

import torch

from tools.gpu_smoke import memory_check

SHAPES = {
    "qwen3_moe": dict(
        model_type="qwen3_moe", vocab_size=32768, hidden_size=1024, intermediate_size=2816, moe_intermediate_size=512,
        num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=4, head_dim=64, num_experts=32,
        num_experts_per_tok=4, norm_topk_prob=True, rope_theta=1000000.0, rms_norm_eps=1e-6,
        max_position_embeddings=4096, tie_word_embeddings=False,
    ),
    "dsv3": dict(
        model_type="deepseek_v3", vocab_size=32768, hidden_size=1024, intermediate_size=2816,
        moe_intermediate_size=512, num_hidden_layers=4, first_k_dense_replace=1, num_attention_heads=16,
        num_key_value_heads=16, q_lora_rank=384, kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32,
        v_head_dim=64, n_routed_experts=32, n_shared_experts=1, num_experts_per_tok=4, n_group=4, topk_group=2,
        routed_scaling_factor=2.5, norm_topk_prob=True, num_nextn_predict_layers=1, max_position_embeddings=4096,
        rope_theta=10000.0, tie_word_embeddings=False,
    ),
}  # fmt: skip
#: --dry-cpu sizes: the same architectures, small enough for a CI second
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
            v_head_dim=16, num_experts=8, n_routed_experts=8, head_dim=16, max_position_embeddings=64)  # fmt: skip


def _hf_config(family: str, dry: bool) -> dict[str, Any]:
    config = dict(SHAPES[family])
    if dry:
        config.update({k: v for k, v in TINY.items() if k in config})
        config["num_key_value_heads"] = 2 if family == "qwen3_moe" else config["num_attention_heads"]
    return config


def _write_checkpoint(config: dict[str, Any], path: str) -> bool:
    """An HF checkpoint of `config` by transformers (random weights, routers with std 1 so no two experts tie); False
    when transformers is not importable."""
    try:
        import transformers
    except ImportError:
        return False
    torch.manual_seed(0)
    cls = {"qwen3_moe": "Qwen3MoeForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}[config["model_type"]]
    conf_cls = {"qwen3_moe": "Qwen3MoeConfig", "deepseek_v3": "DeepseekV3Config"}[config["model_type"]]
    model = getattr(transformers, cls)(getattr(transformers, conf_cls)(**config))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.normal_(0.0, 1.0)
    model.save_pretrained(path)
    return True


def _hf_logprobs(path: str, ids: torch.Tensor, prompt: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    """transformers' logprobs of the response tokens ids[:, prompt:], in `dtype`, as fp32 [B, R]."""
    import transformers

    model = (
        transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=dtype, trust_remote_code=False)
        .to(device)
        .eval()
    )
    with torch.no_grad():
        logits = model(ids.to(device)).logits.float()
    logp = torch.log_softmax(logits[:, prompt - 1 : -1], dim=-1)
    out = logp.gather(-1, ids[:, prompt:, None].to(device))[..., 0].cpu()
    del model
    return out


def _stats(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    diff = (a - b).abs().flatten().double()
    return {"mean": float(diff.mean()), "p99": float(diff.quantile(0.99)), "max": float(diff.max())}


def _sync(dry: bool) -> None:
    if not dry:
        torch.cuda.synchronize()


def run(rec: Any, dry: bool, family: str) -> None:
    """The step body (see the module docstring)."""
    from mcore_rl.actor.batch import TrainBatch
    from mcore_rl.actor.megatron_actor import MegatronActor
    from mcore_rl.config import ActorConfig, ModelConfig, OptimConfig
    from mcore_rl.models.estimate import count_params
    from mcore_rl.models.spec import te_in_use
    from mcore_rl.parallel.groups import free_port

    runtime, device = ("cpu", "cpu") if dry else ("cuda", "cuda")
    config = _hf_config("dsv3" if family == "dsv3" else family, dry)
    batch_size, prompt, response = (2, 8, 8) if dry else (8, 64, 192)
    workdir = tempfile.TemporaryDirectory(prefix="gpu_smoke_")  # removed when this check returns or raises
    tmp = workdir.name
    has_hf = _write_checkpoint(config, tmp)
    rec["spec"] = "transformer_engine" if te_in_use(runtime) else "local"
    model_cfg = ModelConfig(path=tmp if has_hf else None, hf_config={} if has_hf else config, dtype="bfloat16")
    cfg = ActorConfig(world_size=1, use_ref=True, mini_batches=1, micro_batch_size=batch_size,
                      optim=OptimConfig(distributed=True, lr=1e-5))  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, config["vocab_size"], (batch_size, prompt + response), generator=gen)
    if has_hf:  # before the actor: the CPU runtime's patches are not for transformers, and the GPU memory is freed
        fp32 = _hf_logprobs(tmp, ids, prompt, torch.float32, device)
        bf16 = _hf_logprobs(tmp, ids, prompt, torch.bfloat16, device)
        if not dry:
            torch.cuda.empty_cache()
    start = time.perf_counter()
    actor = MegatronActor(0, 1, model_cfg, cfg, runtime=runtime)
    actor.initialize(("127.0.0.1", free_port()))
    rec["build_s"] = round(time.perf_counter() - start, 2)
    batch = TrainBatch([row.tolist() for row in ids[:, :prompt]], ids[:, prompt:].clone(),
                       torch.ones(batch_size, response))  # fmt: skip
    logprobs = actor.logprobs(batch).payload
    rec["logprobs_on_host"] = logprobs.device.type == "cpu"
    if has_hf:
        ours, yardstick = _stats(logprobs, fp32), _stats(bf16, fp32)
        rec["parity"] = {"megatron_bf16_vs_hf_fp32": ours, "hf_bf16_vs_hf_fp32": yardstick,
                         "ratio_mean": ours["mean"] / max(yardstick["mean"], 1e-12)}  # fmt: skip
    else:
        rec["parity"] = "skipped: transformers is not importable (carry its wheels for parity: docs/gpu.md)"
    # --- three updates
    batch.tensors.update(old_logprobs=logprobs, advantages=torch.randn(batch_size, response, generator=gen))
    if not dry:
        torch.cuda.reset_peak_memory_stats()
    seconds = []
    for _ in range(3):
        _sync(dry)
        t0 = time.perf_counter()
        metrics = actor.update(batch).payload
        _sync(dry)
        seconds.append(time.perf_counter() - t0)
    tokens = batch_size * (prompt + response)
    counts = count_params(config)
    experts = int(config.get("n_routed_experts") or config.get("num_experts") or 0)
    active = counts.dense + (counts.expert * config["num_experts_per_tok"] / experts if experts else 0.0)
    step = statistics.median(seconds)
    rec["updates"] = {"seconds": [round(s, 4) for s in seconds], "tokens_per_s": round(tokens / step, 1),
                      "model_tflops": round(6 * active * tokens / step / 1e12, 2), "active_params": active,
                      "update_ok": metrics["actor/update_ok"]}  # fmt: skip
    # --- memory: the dry run's estimate for these shapes against one more update (tools/gpu_smoke/memory_check.py)
    rec["memory"] = memory_check.measure(actor, batch, config, prompt + response + 1, dry)
    # --- offload / onload
    before = actor.logprobs(batch).payload
    allocated = torch.cuda.memory_allocated() if not dry else 0
    moved = actor.offload()
    after_off = torch.cuda.memory_allocated() if not dry else 0
    back = actor.onload()
    again = actor.logprobs(batch).payload
    equal = torch.equal(before, again)
    rec["offload"] = {"moved": moved, "onload_bytes": back["bytes"], "allocated_before": allocated,
                      "allocated_offloaded": after_off, "logprobs_equal_after_onload": equal}  # fmt: skip
    parity = rec.data["parity"]
    rec["summary"] = (
        (f"|dlogp| mean {parity['megatron_bf16_vs_hf_fp32']['mean']:.2e} ({parity['ratio_mean']:.2f}x HF bf16); "
         if isinstance(parity, dict) else "parity skipped; ")
        + f"update {step * 1e3:.0f} ms, {tokens / step:.0f} tok/s, {6 * active * tokens / step / 1e12:.2f} TFLOP/s; "
        + f"{memory_check.summary(rec['memory'])}; "
        + f"offload {moved.get('bytes', 0) / 2**20:.0f} MiB, equal after onload: {torch.equal(before, again)}"
    )  # fmt: skip
    # the 1.5x bar is for CUDA; CPU bf16 kernels round differently from transformers' (dry run: reported only)
    if not torch.equal(before, again) or (not dry and isinstance(parity, dict) and parity["ratio_mean"] > 1.5):
        rec["status"] = "failed"
