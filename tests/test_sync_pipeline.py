"""The weight-sync pipeline on real Megatron ranks (gloo): plan digests agree, every HF tensor arrives bit exact under
TP/PP/EP/ETP/uneven layouts, the memory bound holds (from the executor's allocation counts), shard-aware receivers
get only their slices, and an embedded server's logits equal Megatron's after a sync through each transport
(tests/test_weight_sync_fence.py kills a sender mid-sync through the controller).

Run: `.venv/bin/pytest tests/test_sync_pipeline.py`
"""

from __future__ import annotations

import threading

import pytest
import requests
import torch
import torch.distributed as dist
from _parity import DEEPSEEK_TINY
from tiny_models import tiny_qwen3_moe

from mcore_rl.parallel.harness import run_on_ranks

pytestmark = pytest.mark.slow

MOE = tiny_qwen3_moe(vocab_size=70, initializer_range=0.5, max_position_embeddings=64, num_hidden_layers=3)
DEEPSEEK = dict(DEEPSEEK_TINY, model_type="deepseek_v3", initializer_range=0.5, num_nextn_predict_layers=0)
BUCKET = 1 << 15


def _actor(rank: int, world: int, hf: dict, layout: dict):
    from mcore_rl.actor.megatron_actor import MegatronActor
    from mcore_rl.config import ActorConfig, LayoutConfig, ModelConfig

    actor = MegatronActor(
        rank,
        world,
        ModelConfig(hf_config=hf),
        ActorConfig(world_size=world, layout=LayoutConfig(**layout), use_ref=False),
    )
    actor.initialize(("127.0.0.1", 0))  # the harness already started torch.distributed
    return actor


def _deliver_rank(
    rank: int, world: int, hf: dict, layout: dict, engines: dict, mode: str, fp8: bool = False, bucket: int = BUCKET
):
    """Sync through the in-process transport; rank 0 gathers what every leader delivered and the reference export."""
    from mcore_rl.resharding.sync.transports import InProcessTransport
    from mcore_rl.resharding.weight_map import export_hf_weights

    actor = _actor(rank, world, hf, layout)
    digest = actor.sync_plan(engines, bucket, mode, fp8)
    sender = actor._sender()
    delivered: dict[str, torch.Tensor] = {}
    slices: dict[tuple[str, int], torch.Tensor] = {}
    plan = sender.plan_

    def receive(stream, bucket, buffer) -> None:
        for e in bucket.entries:
            tensor = buffer[e.offset : e.offset + e.nbytes].view(getattr(torch, e.dtype)).view(e.shape).clone()
            assert e.name not in delivered, f"{e.name} arrived twice"
            # fp8 tensors travel home as bytes: all_gather_object cannot pickle float8 storages (torch 2.13)
            delivered[e.name] = tensor.view(torch.uint8) if e.quant == "fp8" else tensor
            for engine_rank in range(plan.engines.tp):  # what each engine rank keeps in this mode
                got = plan.receive_slice(e, engine_rank)
                if got is not None:
                    value = delivered[e.name]
                    slices[(e.name, engine_rank)] = value.narrow(e.dim, *got) if value.dim() else value

    stats = sender.executor.run(InProcessTransport(receive))
    again = sender.executor.run(InProcessTransport(lambda *_: None))  # the next sync: the same buffers, none new
    stats.resident_after_second = again.resident_bytes
    stats.peak_second = again.peak_extra_bytes
    reference = {
        n: t.clone()
        for n, t in export_hf_weights(actor.chunks, actor.contexts, actor.weight_map, actor.pg.tp, actor.pg.expt_tp)
    }
    parts = [None] * world
    dist.all_gather_object(
        parts, (digest, delivered, reference, stats, slices, plan.bucket_bytes, plan.largest_tensor_bytes)
    )
    return parts if rank == 0 else None


LAYOUTS = [
    ("tp2", MOE, dict(tp=2, sequence_parallel=True), 2),
    ("pp2-uneven", MOE, dict(pp=2, first_stage_layers=1), 2),
    ("ep2", MOE, dict(ep=2), 2),
    ("etp1", MOE, dict(tp=2, ep=2, etp=1, sequence_parallel=True), 4),
    ("tp2ep2", MOE, dict(tp=2, ep=2, sequence_parallel=True), 4),
    ("pp2ep2-uneven", MOE, dict(pp=2, ep=2, first_stage_layers=2), 4),
    ("deepseek-tp2", DEEPSEEK, dict(tp=2, sequence_parallel=True), 2),
]


@pytest.mark.parametrize("name, hf, layout, world", LAYOUTS, ids=[c[0] for c in LAYOUTS])
def test_every_tensor_arrives_bit_exact_within_the_memory_bound(name, hf, layout, world) -> None:
    parts = run_on_ranks(_deliver_rank, world, (hf, layout, dict(num_engines=1), "full"))[0]
    assert len({p[0] for p in parts}) == 1, "every rank computed the same plan"
    delivered, reference = {}, {}
    for _, got, ref, stats, _, bucket_bytes, largest in parts:
        assert not set(got) & set(delivered), "a tensor was sent by two leaders"
        delivered.update(got)
        reference.update(ref)
        # counted from the executor's own buffers, not timed: two buckets and the largest tensor at most
        assert stats.peak_extra_bytes <= 2 * bucket_bytes + largest, (stats.peak_extra_bytes, bucket_bytes, largest)
        # the buffers stay for the next sync (resident, within the same bound), which allocates nothing more
        assert stats.resident_bytes == stats.resident_after_second == stats.peak_second <= 2 * bucket_bytes + largest
    assert sorted(delivered) == sorted(reference)
    for key, tensor in reference.items():
        assert torch.equal(delivered[key], tensor), key


def test_shard_aware_engine_ranks_receive_their_sglang_slices() -> None:
    parts = run_on_ranks(_deliver_rank, 2, (MOE, dict(ep=2), dict(num_engines=1, tp=2, ep=2), "shard_aware"))[0]
    reference, slices = {}, {}
    for _, _, ref, _, got, _, _ in parts:
        reference.update(ref)
        slices.update(got)
    q = reference["model.layers.0.self_attn.q_proj.weight"]
    for r in (0, 1):
        assert torch.equal(slices[("model.layers.0.self_attn.q_proj.weight", r)], q.chunk(2, dim=0)[r])
        o = reference["model.layers.1.self_attn.o_proj.weight"]
        assert torch.equal(slices[("model.layers.1.self_attn.o_proj.weight", r)], o.chunk(2, dim=1)[r])
    # 4 experts on engine ep 2: experts 0-1 only on engine rank 0, 2-3 only on rank 1, whole (expert tp 1)
    for e in range(4):
        name = f"model.layers.2.mlp.experts.{e}.down_proj.weight"
        assert (name, e // 2) in slices and (name, 1 - e // 2) not in slices
        assert torch.equal(slices[(name, e // 2)], reference[name])
    norm = "model.layers.0.input_layernorm.weight"
    assert torch.equal(slices[(norm, 0)], slices[(norm, 1)])  # replicated


def _push_rank(rank: int, world: int, url: str, transport: str, disk_dir: str):
    """EP2 actor -> the engine at `url` through `transport` (the test plays the controller: it opens and closes the
    engine's update session); returns Megatron's logits from rank 0."""
    actor = _actor(rank, world, MOE, dict(ep=2))
    actor.sync_plan(dict(num_engines=1), 1 << 14, "full")
    if transport == "distributed":
        for name, (host, port) in actor.sync_addresses().items():  # the streams this rank leads
            body = {"master_address": host, "master_port": port, "rank_offset": 1, "world_size": 2,
                    "group_name": name, "backend": "gloo"}  # fmt: skip
            call = threading.Thread(target=requests.post, args=(url + "/init_weights_update_group",),
                                    kwargs={"json": body, "timeout": 60})  # fmt: skip
            call.start()
            actor.sync_join(name, host, port, 2, "gloo", 60)
            call.join()
        dist.barrier()
    from mcore_rl.actor.sync_sender import PushRequest

    actor.sync_send(PushRequest(7, transport, [url], disk_dir=disk_dir, timeout_s=60))
    ids = torch.arange(2, 22).reshape(2, 10) % MOE["vocab_size"]
    logits = actor.forward_logits(ids)
    held = [None] * world
    dist.all_gather_object(held, (logits.dp_rank, logits.payload) if logits.holds_output else None)
    return torch.cat([p for _, p in sorted(h for h in held if h is not None)]) if rank == 0 else None


@pytest.fixture
def server():
    from mcore_rl.rollout.server import ServerThread, build_server

    thread = ServerThread(build_server(dict(MOE), init_seed=99))
    yield thread
    thread.stop()


@pytest.mark.parametrize("transport", ["distributed", "tensor", "disk"])
def test_engine_logits_equal_megatron_after_a_sync(server, transport, tmp_path) -> None:
    url = server.url
    assert requests.post(url + "/begin_weight_update", json={}).status_code == 200
    megatron = run_on_ranks(_push_rank, 2, (url, transport, str(tmp_path / "sync")))[0]
    if transport == "disk":
        answer = requests.post(
            url + "/update_weights_from_disk", json={"model_path": str(tmp_path / "sync"), "weight_version": "7"}
        )
        assert answer.status_code == 200, answer.text
    end = requests.post(url + "/end_weight_update", json={})
    assert end.status_code == 200 and end.json()["weight_version"] == "7", end.text
    ids = torch.arange(2, 22).reshape(2, 10) % MOE["vocab_size"]
    with torch.no_grad():
        engine = server.server.engine.model(ids).logits
    assert (engine - megatron[:, :, : engine.shape[-1]]).abs().max().item() <= 1e-4


def test_fp8_sync_sends_the_family_targets_blockwise_quantised() -> None:
    from mcore_rl.kernels.fp8_blockwise import dequantize_blockwise, quantize_blockwise_ref
    from mcore_rl.models.base import FP8_TARGETS
    from mcore_rl.rollout.weight_receiver import _dequantize_fp8

    hf = dict(MOE, hidden_size=256, moe_intermediate_size=128, intermediate_size=256, head_dim=64)
    parts = run_on_ranks(
        _deliver_rank, 2, (hf, dict(tp=2, sequence_parallel=True), dict(num_engines=1), "full", True, 1 << 21)
    )
    delivered, reference = {}, {}
    for _, got, ref, *_ in parts[0]:
        delivered.update(got)
        reference.update(ref)
    targets = [n for n in reference if FP8_TARGETS.match(n)]
    assert targets and all(delivered[n].dtype == torch.uint8 for n in targets)  # e4m3 bytes (see _deliver_rank)
    for name in targets:  # exactly the quantisation of the reference, scales included
        q, scale_inv = quantize_blockwise_ref(reference[name], (128, 128))
        assert torch.equal(delivered[name], q.view(torch.uint8)), name
        assert torch.equal(delivered[name + "_scale_inv"], scale_inv), name
    for name in set(reference) - set(targets):
        assert torch.equal(delivered[name], reference[name]), name
    # the receiving engine dequantises what it stages
    fp8 = {n: t.view(torch.float8_e4m3fn) if n in targets else t for n, t in delivered.items()}
    loaded = dict(_dequantize_fp8(list(fp8.items())))
    name = targets[0]
    expected = dequantize_blockwise(*quantize_blockwise_ref(reference[name], (128, 128)), (128, 128), torch.float32)
    assert torch.equal(loaded[name], expected) and name + "_scale_inv" not in loaded


def _live_sources(rank: int, world: int, hf: dict, layout: dict):
    from mcore_rl.resharding.sync.inventory import local_sources, merge_sources

    actor = _actor(rank, world, hf, layout)
    coords = actor.layout.coords(rank, world)
    mine = local_sources(
        actor.chunks, actor.contexts, actor.weight_map, coords.pp_rank, actor.pg.tp.size(), actor.pg.expt_tp.size()
    )
    every = [None] * world
    dist.all_gather_object(every, mine)
    return merge_sources(every) if rank == 0 else None


def _meta_sources(rank: int, world: int, hf: dict, layout: dict):
    from mcore_rl.models.base import HFConfig
    from mcore_rl.models.builder import ModelSpec, build_gpt_chunks
    from mcore_rl.parallel.groups import initialize_model_parallel
    from mcore_rl.parallel.layout import ParallelLayout
    from mcore_rl.resharding.sync.inventory import meta_sources

    actor_layout = ParallelLayout(**layout)
    pg = initialize_model_parallel(ParallelLayout())
    spec = ModelSpec(
        HFConfig(hf), ParallelLayout(), make_vocab_size_divisible_by=64 * actor_layout.tp,
        config_overrides={"perform_initialization": False},
    )  # fmt: skip
    shape = spec.family.shape(spec.hf)
    build = lambda: build_gpt_chunks(spec, pg, meta=True)  # noqa: E731
    return meta_sources(build, spec.weight_map(), actor_layout, shape.num_layers, shape.num_experts)


@pytest.mark.parametrize("layout", [dict(ep=2), dict(tp=2, sequence_parallel=True), dict(pp=2, first_stage_layers=1)])
def test_live_and_meta_inventories_agree(layout) -> None:
    """The plan's input from running ranks (train-time) equals the one tools/plan_sync.py builds from the meta model."""
    live = run_on_ranks(_live_sources, 2, (MOE, layout))[0]
    meta = run_on_ranks(_meta_sources, 1, (MOE, layout))[0]
    assert live == meta
