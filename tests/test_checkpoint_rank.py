"""An actor rank's checkpoint (mcore_rl/checkpoint/rank_io.py) on spawned gloo ranks, and the on-disk store.

The rank tests build real MegatronActors (tiny Qwen3-MoE), run PPO updates on a fixed synthetic batch, save, and
load into actors built from another random initialisation: the update after a load must be the update the saved
actor would have made next (model and Adam state restored), bit for bit under the same layout.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch
from tiny_models import tiny_qwen3_moe
from torch.distributed.checkpoint.metadata import Metadata

from mcore_rl.checkpoint import store
from mcore_rl.parallel.harness import run_on_ranks


def _batch(seed: int):
    from mcore_rl.actor.batch import TrainBatch

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 100, (4,), generator=g).tolist() for _ in range(8)]
    tensors = {"old_logprobs": -torch.rand(8, 3, generator=g) - 3, "advantages": torch.randn(8, 3, generator=g)}
    return TrainBatch(prompts, torch.randint(3, 100, (8, 3), generator=g), torch.ones(8, 3), tensors)


def _rank(rank: int, world: int, layout: dict, init_seed: int, load: str | None, save: str | None, batches: list):
    from mcore_rl.actor.megatron_actor import MegatronActor
    from mcore_rl.config import ActorConfig, LayoutConfig, ModelConfig

    # divisible_by=32 pads the vocabulary of 100 to 128 under tp=1 and tp=2 alike
    model = ModelConfig(hf_config=tiny_qwen3_moe(), init_seed=init_seed, make_vocab_size_divisible_by=32)
    sp = layout.get("tp", 1) > 1
    actor = MegatronActor(rank, world, model, ActorConfig(world_size=world, layout=LayoutConfig(**layout,
                          sequence_parallel=sp), mini_batches=1, use_ref=True))  # fmt: skip
    actor.initialize(("127.0.0.1", 0))
    out = {"load": actor.load_checkpoint(load) if load else None}
    out["updates"] = [actor.update(_batch(seed)).payload for seed in batches]
    out["logprobs"] = actor.logprobs(_batch(99)).payload
    out["ref"] = actor.logprobs(_batch(99), use_ref=True).payload
    if save:
        out["save"] = actor.save_checkpoint(save, with_reference=True)
    return out


def _held(results: list[dict], key: str) -> torch.Tensor:
    return torch.cat([r[key] for r in results if r[key] is not None])


@pytest.mark.slow
def test_saved_state_resumes_the_same_updates_under_any_layout(tmp_path: Path):
    ep2, tp2 = {"ep": 2}, {"tp": 2}
    straight = run_on_ranks(_rank, 2, (ep2, 1234, None, None, [0, 1]))
    first = run_on_ranks(_rank, 2, (ep2, 1234, None, str(tmp_path), [0]))
    assert first[0]["save"]["layout"] == "tp1 pp1 cp1 ep2 etp1"
    same = run_on_ranks(_rank, 2, (ep2, 999, str(tmp_path), None, [1]))  # another init: everything comes from disk
    assert all(r["load"] == {"rng_restored": True} for r in same)
    assert [r["updates"][0] for r in same] == [r["updates"][1] for r in straight]  # grad norm, losses: bit for bit
    assert torch.equal(_held(same, "logprobs"), _held(straight, "logprobs"))
    assert torch.equal(_held(same, "ref"), _held(straight, "ref"))  # the reference is the initial policy
    other = run_on_ranks(_rank, 2, (tp2, 999, str(tmp_path), None, [1]))
    assert all(r["load"] == {"rng_restored": False} for r in other)  # per-rank streams do not map across layouts
    # TP2 sums the same numbers in another order: float32 rounding, not bit for bit
    assert torch.allclose(_held(other, "logprobs"), _held(straight, "logprobs"), atol=1e-5, rtol=0)
    assert torch.allclose(_held(other, "ref"), _held(straight, "ref"), atol=1e-5, rtol=0)
    grad = [r["updates"][0]["actor/grad_norm"] for r in other if r["updates"][0]]
    assert grad and grad[0] == pytest.approx(straight[0]["updates"][1]["actor/grad_norm"], rel=1e-4)


# ------------------------------------------------------------------------------------------------- store
#: a torch_dist index that places no bytes (read_meta checks every shard it names against its size)
_EMPTY_DCP_INDEX = pickle.dumps(Metadata(state_dict_metadata={}, storage_data={}))


def _fake_checkpoint(root: Path, step: int) -> Path:
    """A directory with every part read_meta checks (the rank files are the rank tests' business)."""
    tmp = root / f"{store.TMP_PREFIX}{store.step_name(step)}-x"
    for sub in ("model", "optimizer", "reference"):
        (tmp / sub).mkdir(parents=True)
        (tmp / sub / ".metadata").write_bytes(_EMPTY_DCP_INDEX)
    (tmp / "rng").mkdir()
    (tmp / store.LOOP_STATE).write_text('{"loader": {}}')
    store.write_json(tmp / store.META, {"format": store.FORMAT, "version": store.VERSION, "reference": True})
    return store.publish(tmp, root, step)


def test_publish_moves_latest_last_and_prune_keeps_the_newest(tmp_path: Path):
    root = tmp_path / "checkpoints"
    root.mkdir()
    for step in (2, 4, 6):
        path = _fake_checkpoint(root, step)
        assert store.latest(root) == path and store.read_meta(path)["version"] == store.VERSION
    leftover = root / ".tmp-step_00000008-dead"
    leftover.mkdir()
    assert store.half_written(root) == [leftover]
    removed = store.prune(root, keep_last=2, keep=root / "step_00000006")
    assert sorted(p.name for p in removed) == [".tmp-step_00000008-dead", "step_00000002"]
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000004", "step_00000006"]
    # a step published again (a crash after the rename, before `latest` moved) replaces the stale one
    _fake_checkpoint(root, 6)
    assert store.latest(root).name == "step_00000006"


def test_resolve_and_read_meta_name_what_is_wrong(tmp_path: Path):
    root = tmp_path / "checkpoints"
    root.mkdir()
    assert store.resolve("auto", root) is None  # nothing saved yet: a new run
    path = _fake_checkpoint(root, 3)
    assert store.resolve("auto", root) == path and store.resolve(str(root), root) == path
    (root / "latest").write_text("step_00000009\n")
    with pytest.raises(store.CheckpointError, match="latest: names step_00000009, which does not exist"):
        store.resolve("auto", root)
    (path / "optimizer/.metadata").unlink()
    with pytest.raises(store.CheckpointError, match="optimizer/.metadata: missing"):
        store.read_meta(path)
    (path / store.META).write_text("{not json")
    with pytest.raises(store.CheckpointError, match="meta.json: not valid JSON"):
        store.read_meta(path)
    (path / store.META).write_text(json.dumps({"format": "something else"}))
    with pytest.raises(store.CheckpointError, match="field 'format' is not"):
        store.read_meta(path)
