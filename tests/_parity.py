"""Shared helper of the family parity and conversion tests: HF checkpoint -> Megatron under a layout -> logits + export.

    results = run_on_ranks(parity_rank, world, (hf_dir, [layout_a, layout_b], input_ids))
    logits, exported = results[0][i]        # rank 0 returns, per layout, the full logits and the exported HF tensors

Each rank builds its Megatron chunks for the layout, fills them from the HF safetensors through the family's weight
map, runs Megatron's pipeline schedule forward-only (so PP goes through the real p2p path), and captures the logits on
the last stage with a hook on the output layer; the TP vocabulary shards are all-gathered. The weights are then
exported back with `export_hf_weights` and every rank's (name, tensor) pairs are gathered to rank 0, where PP stages
and EP ranks together make up the whole HF state dict. Several layouts of the same world size run in one spawn, since
starting ranks (imports) costs more than a tiny model's forward.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def forward_logits(chunks: list[torch.nn.Module], pg: Any, input_ids: torch.Tensor) -> list[torch.Tensor] | None:
    """Run the pipeline schedule forward-only; on the last stage return every output-layer call as [b, s, vocab].

    A model with MTP layers calls the output layer once per MTP depth and then for the main head (Megatron 0.16.1
    needs labels to run MTP, so labels are the inputs); the list holds those calls in order, the main logits last.
    Other stages return None. The vocabulary is gathered over TP; padding rows are kept. With virtual stages the batch
    runs as pp micro-batches (Megatron's interleaved schedule needs at least pp of them) and is put back together.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    config = chunks[0].config
    vpp = len(chunks)
    num_microbatches = pg.pp.size() if vpp > 1 else 1
    assert input_ids.shape[0] % num_microbatches == 0, f"batch {input_ids.shape[0]} is not a multiple of pp"
    microbatches = list(input_ids.chunk(num_microbatches))
    batch, seq = microbatches[0].shape
    position_ids = torch.arange(seq).unsqueeze(0).expand(batch, seq)
    captured: list[torch.Tensor] = []
    last = chunks[-1]
    hook = None
    if getattr(last, "post_process", False):
        # Clone: with labels, Megatron's vocab-parallel cross entropy edits the logits in place afterwards.
        hook = last.output_layer.register_forward_hook(lambda m, i, out: captured.append(out[0].detach().clone()))
    mtp = config.mtp_num_layers is not None

    def forward_step(data_iterator, model):  # noqa: ANN001, ANN202 - Megatron's callback signature
        ids = next(data_iterator)
        out = model(input_ids=ids, position_ids=position_ids, attention_mask=None, labels=ids if mtp else None)

        def loss_func(output: torch.Tensor):  # noqa: ANN202
            return output.float().sum() * 0.0, {}

        return out, loss_func

    schedule = get_forward_backward_func(pp_size=pg.pp.size(), vp_size=vpp if vpp > 1 else None)
    iterators = [iter(microbatches) for _ in chunks] if vpp > 1 else iter(microbatches)
    for chunk in chunks:
        chunk.eval()
    # The pipelined schedules take process groups only together with a p2p communicator on the same PP group.
    p2p = P2PCommunicator(pp_group=pg.pp, config=config) if pg.pp.size() > 1 else None
    with torch.no_grad():
        schedule(
            forward_step_func=forward_step,
            data_iterator=iterators,
            model=chunks if vpp > 1 else chunks[0],
            num_microbatches=num_microbatches,
            seq_length=seq,
            micro_batch_size=batch,
            forward_only=True,
            pg_collection=pg,
            p2p_communicator=p2p,
        )
    if hook is None:
        return None
    hook.remove()
    # The last chunk sees the micro-batches in order, each calling the output layer once per head.
    heads = len(captured) // num_microbatches
    captured = [torch.cat(captured[h::heads], dim=1) for h in range(heads)]
    out = []
    for logits in captured:  # [s, b, vocab / tp]
        shards = [torch.empty_like(logits) for _ in range(pg.tp.size())]
        dist.all_gather(shards, logits.contiguous(), group=pg.tp)
        out.append(torch.cat(shards, dim=-1).transpose(0, 1).contiguous())
    return out


def gather_export(chunks: list[torch.nn.Module], contexts: list, weight_map: Any, pg: Any) -> dict | None:
    """Export every rank's share of the HF tensors and gather them to global rank 0 (None elsewhere).

    A name emitted by two ranks (the MTP stage keeps a copy of the embedding) must carry the same values.
    """
    from mcore_rl.resharding.weight_map import export_hf_weights

    local = {name: t.clone() for name, t in export_hf_weights(chunks, contexts, weight_map, pg.tp, pg.expt_tp)}
    gathered: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(local, gathered, dst=0)
    if dist.get_rank() != 0:
        return None
    merged: dict[str, torch.Tensor] = {}
    for part in gathered:
        for name, t in part.items():
            if name in merged and not torch.equal(merged[name], t):
                raise AssertionError(f"{name} exported by two ranks with different values")
            merged[name] = t
    return merged


def build_and_load(hf_dir: str | Path, layout: Any, divisible_by: int = 16, **overrides: Any) -> tuple:
    """Groups for `layout`, this rank's chunks built and filled from the HF checkpoint: (chunks, contexts, spec, pg)."""
    from mcore_rl.models.base import HFConfig
    from mcore_rl.models.builder import ModelSpec, build_gpt_chunks
    from mcore_rl.parallel.groups import initialize_model_parallel
    from mcore_rl.resharding.hf_io import HFCheckpointReader
    from mcore_rl.resharding.weight_map import load_hf_weights

    pg = initialize_model_parallel(layout)
    reader = HFCheckpointReader(hf_dir)
    spec = ModelSpec(
        HFConfig(reader.config), layout, make_vocab_size_divisible_by=divisible_by, config_overrides=overrides
    )
    chunks, contexts = build_gpt_chunks(spec, pg)
    load_hf_weights(chunks, contexts, spec.weight_map(), reader.read)
    return chunks, contexts, spec, pg


def parity_rank(
    rank: int, world: int, hf_dir: str, layouts: list, input_ids: torch.Tensor, export: bool = True
) -> list[tuple[list[torch.Tensor] | None, dict | None]]:
    """Per layout: (logits from the last stage's TP rank 0 of DP replica 0, or None; exported HF dict on rank 0)."""
    results = []
    for layout in layouts:
        chunks, contexts, spec, pg = build_and_load(hf_dir, layout)
        logits = forward_logits(chunks, pg, input_ids)
        keep = logits is not None and pg.tp.rank() == 0 and pg.dp.rank() == 0
        exported = gather_export(chunks, contexts, spec.weight_map(), pg) if export else None
        results.append((logits if keep else None, exported))
    return results


def collect(results: list, num_layouts: int) -> list[tuple[list[torch.Tensor], dict | None]]:
    """Per layout, the logits (from whichever rank returned them) and rank 0's export."""
    out = []
    for i in range(num_layouts):
        logits = next(r[i][0] for r in results if r[i][0] is not None)
        out.append((logits, results[0][i][1]))
    return out


def check_layouts(
    name: str, hf_dir: Path, layouts: list, ref: dict, input_ids: torch.Tensor, world: int, atol: float = 1e-5
) -> None:
    """Every layout on `world` ranks: each output-layer call (MTP heads, then the main head) within `atol` of the
    transformers reference `ref`, and the export back to HF equal to the checkpoint bit for bit."""
    from mcore_rl.parallel.harness import run_on_ranks

    results = collect(run_on_ranks(parity_rank, world, (str(hf_dir), layouts, input_ids)), len(layouts))
    original = hf_state(hf_dir)
    want = ref["mtp_logits"] + [ref["logits"]]
    vocab = ref["logits"].shape[-1]
    for layout, (logits, exported) in zip(layouts, results):
        assert len(logits) == len(want), f"{name} {layout.describe()}: {len(logits)} output-layer calls"
        for i, (got, ref_logits) in enumerate(zip(logits, want)):
            err = (got[..., :vocab] - ref_logits).abs().max().item()
            head = "main" if i == len(want) - 1 else f"mtp{i}"
            assert err < atol, f"{name} {layout.describe()} {head}: max |logits diff| {err:.2e} >= {atol}"
        assert_bit_exact(exported, original)


def hf_state(hf_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF checkpoint directory (small test checkpoints only)."""
    from mcore_rl.resharding.hf_io import HFCheckpointReader

    reader = HFCheckpointReader(hf_dir)
    return {name: reader.read(name).clone() for name in reader.names()}


def assert_bit_exact(exported: dict[str, torch.Tensor], original: dict[str, torch.Tensor]) -> None:
    """The exported HF tensors equal the original checkpoint's, names, dtypes and bits."""
    missing, extra = sorted(set(original) - set(exported)), sorted(set(exported) - set(original))
    assert not missing and not extra, f"missing from export: {missing[:5]}, unexpected: {extra[:5]}"
    for name, t in original.items():
        got = exported[name]
        assert got.dtype == t.dtype and got.shape == t.shape, f"{name}: {got.dtype}{tuple(got.shape)} vs {t.dtype}"
        assert torch.equal(got.view(torch.uint8), t.contiguous().view(torch.uint8)), f"{name} differs"


DEEPSEEK_TINY = dict(
    vocab_size=100,
    hidden_size=32,
    intermediate_size=64,
    moe_intermediate_size=16,
    num_hidden_layers=2,
    first_k_dense_replace=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=16,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=8,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=4,
    n_group=4,
    topk_group=2,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    num_nextn_predict_layers=1,
    max_position_embeddings=64,
    rope_theta=10000.0,
    tie_word_embeddings=False,
)


def _randomise_routing(module: torch.nn.Module) -> None:
    """Router weights with std 1 (top-k margins dwarf fp32 rounding: no routing ties), a random expert-bias buffer,
    and random norm weights (HF initialises them to ones, which would hide a swapped norm)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 1.0)
            elif "norm" in name:
                p.normal_(1.0, 0.1)
        for name, b in module.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)


def _per_expert(prefix: str, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers 5 keeps experts fused ([E, 2I, H] gate_up, [E, H, I] down); checkpoints hold one tensor each."""
    out = {}
    for name, t in state.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            base = prefix + name[: -len("gate_up_proj")]
            for e, w in enumerate(t):
                gate, up = w.chunk(2, dim=0)
                out[f"{base}{e}.gate_proj.weight"], out[f"{base}{e}.up_proj.weight"] = gate.clone(), up.clone()
        elif name.endswith("mlp.experts.down_proj"):
            base = prefix + name[: -len("down_proj")]
            for e, w in enumerate(t):
                out[f"{base}{e}.down_proj.weight"] = w.clone()
        else:
            out[prefix + name] = t.clone()
    return out


def tiny_deepseek_v3(path: str | Path, input_ids: torch.Tensor, seed: int = 0, **overrides: Any) -> dict[str, Any]:
    """Save a tiny random DeepSeek-V3 (with DeepSeek-format MTP layers) to `path`; return reference outputs.

    transformers' DeepseekV3ForCausalLM has no MTP modules, so the MTP layer is built here from its decoder layer
    class and norms and written under model.layers.{L + i}.* with the embed_tokens / shared_head copies DeepSeek's
    checkpoints carry. Returns {"logits", "mtp_logits" (list, one per MTP layer), "model"}.
    """
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm

    from mcore_rl.resharding.hf_io import HFCheckpointWriter

    config = DeepseekV3Config(**{**DEEPSEEK_TINY, **overrides})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(config).float().eval()
    _randomise_routing(model)
    model.save_pretrained(path)
    num_layers, num_mtp = config.num_hidden_layers, config.num_nextn_predict_layers
    with torch.no_grad():
        out = model(input_ids, output_hidden_states=True)
    result: dict[str, Any] = {"logits": out.logits, "mtp_logits": [], "model": model}
    if not num_mtp:
        return result
    state = hf_state(path)
    hidden = out.hidden_states[-1]  # the final-normed hidden state (transformers ties it to last_hidden_state)
    ids = input_ids
    batch, seq = ids.shape
    position_ids = torch.arange(seq).unsqueeze(0).expand(batch, seq)
    for i in range(num_mtp):
        layer = DeepseekV3DecoderLayer(config, layer_idx=num_layers + i).float().eval()
        with torch.no_grad():  # a bare layer skips the model's init (its expert tensors are torch.empty)
            for p in layer.parameters():
                p.normal_(0.0, config.initializer_range)
        _randomise_routing(layer)
        norms = {n: DeepseekV3RMSNorm(config.hidden_size, config.rms_norm_eps) for n in ("enorm", "hnorm", "post")}
        eh_proj = torch.nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        with torch.no_grad():
            for norm in norms.values():
                norm.weight.normal_(1.0, 0.1)
            # Megatron's MTP rolls the tokens left by one and zero-fills the last position.
            ids = torch.roll(ids, -1, dims=-1)
            ids[:, -1] = 0
            x = eh_proj(torch.cat([norms["enorm"](model.model.embed_tokens(ids)), norms["hnorm"](hidden)], dim=-1))
            cos_sin = model.model.rotary_emb(x, position_ids)
            causal = torch.full((seq, seq), float("-inf")).triu(1)[None, None]
            x = layer(x, attention_mask=causal, position_ids=position_ids, position_embeddings=cos_sin)
            hidden = norms["post"](x)
            result["mtp_logits"].append(model.lm_head(hidden))
        prefix = f"model.layers.{num_layers + i}."
        state |= _per_expert(prefix, layer.state_dict())
        state |= {
            prefix + "enorm.weight": norms["enorm"].weight.detach().clone(),
            prefix + "hnorm.weight": norms["hnorm"].weight.detach().clone(),
            prefix + "eh_proj.weight": eh_proj.weight.detach().clone(),
            prefix + "shared_head.norm.weight": norms["post"].weight.detach().clone(),
            prefix + "embed_tokens.weight": state["model.embed_tokens.weight"].clone(),
            prefix + "shared_head.head.weight": state["lm_head.weight"].clone(),
        }
    import json

    config_json = json.loads((Path(path) / "config.json").read_text())
    with HFCheckpointWriter(path, max_shard_bytes=64 << 10, overwrite=True) as writer:
        for name in sorted(state):
            writer.add(name, state[name])
        writer.write_config(config_json)
        writer.copy_side_files(path)
    return result
