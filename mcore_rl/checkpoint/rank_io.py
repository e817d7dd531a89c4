"""One actor rank's part of a training checkpoint: Megatron model, optimizer and RNG states.

    save_rank(actor, directory, with_reference)   # every rank together (collective): model/, optimizer/,
                                                  # [reference/], rng/rank_<r>.pt
    load_rank(actor, directory)                   # every rank together, under any layout

Model and optimizer go through `megatron.core.dist_checkpointing` in the torch_dist format. Its keys are global
(absolute layer and expert indices, a TP shard is a region of one global tensor), so a checkpoint saved under one
TP/PP/EP layout loads under another. The optimizer's state is keyed by the same global parameter keys
(`optimizer.state.exp_avg.decoder.layers.0...`); Megatron's distributed optimizer is asked for its
`fully_reshardable` format for the same reason. `model/` alone is a plain Megatron model checkpoint, which is what
`tools/convert_checkpoint.py mcore-to-hf` reads.

RNG states (python, numpy, torch, CUDA, Megatron's tracker streams) are per rank and belong to the rank's place in the
layout (the tracker's streams are seeded per TP/EP/PP rank), so they are restored only under the layout they were
saved with; under another layout the ranks keep their fresh seeds and the controller says so.
"""

from __future__ import annotations

import contextlib
import pickle
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

MODEL_DIR, OPTIMIZER_DIR, REFERENCE_DIR, RNG_DIR = "model", "optimizer", "reference", "rng"
#: the PPO critic's ranks save their own model/, optimizer/ and rng/ under critic/ (its own world and layout)
CRITIC_DIR = "critic"
#: metadata Megatron's sharded_state_dict implementations read; `fully_reshardable` keeps the distributed
#: optimizer's state loadable under another layout (Megatron-LM's --dist-ckpt-optim-fully-reshardable)
SHARDING = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True}


def _metadata(actor: Any) -> dict[str, Any]:
    return {"dp_cp_group": actor.pg.dp_cp, **SHARDING}


def _names(chunks: list[torch.nn.Module]) -> list[str]:
    """Megatron-LM's convention: "model" for one chunk, "model0", "model1", ... under virtual pipelining."""
    return ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]


def _model_sharded(actor: Any, chunks: list[torch.nn.Module]) -> dict[str, Any]:
    metadata = _metadata(actor)
    return {name: chunk.sharded_state_dict(metadata=metadata) for name, chunk in zip(_names(chunks), chunks)}


def _rng_states(actor: Any) -> dict[str, Any]:
    """This rank's RNG states as tensors and plain values only, so `torch.load(weights_only=True)` reads them back
    (a checkpoint is data: loading one must not run code, and a pickle of numpy's state would need unpickling code
    objects)."""
    from megatron.core import tensor_parallel

    version, python_state, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached_gauss = np.random.get_state()
    states: dict[str, Any] = {
        "python": {"version": version, "state": torch.tensor(python_state, dtype=torch.int64), "gauss": gauss},
        "numpy": {
            "kind": str(kind),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gauss),
        },
        "torch": torch.get_rng_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available() and actor.runtime == "cuda":
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def _set_rng_states(states: dict[str, Any]) -> None:
    from megatron.core import tensor_parallel

    python, numpy_state = states["python"], states["numpy"]
    random.setstate((python["version"], tuple(int(v) for v in python["state"].tolist()), python["gauss"]))
    np.random.set_state(
        (
            numpy_state["kind"],
            numpy_state["keys"].numpy().astype(np.uint32),
            numpy_state["pos"],
            numpy_state["has_gauss"],
            numpy_state["cached_gaussian"],
        )
    )
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(states["tracker"])


def read_rng_record(path: Path) -> dict[str, Any]:
    """A rank's RNG record, read without running code (`weights_only=True`); {} if there is none. A record that
    holds anything but tensors and plain values (another writer's, or a tampered file) is refused, naming the file."""
    if not path.is_file():
        return {}
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise ValueError(
            f"{path}: RNG states hold objects other than tensors and plain values ({err}); this checkpoint was "
            "not written by this version of mcore_rl or was altered, and is not unpickled (it could run code)"
        ) from None


def _scheduler(actor: Any) -> Any:
    """The actor's Megatron OptimizerParamScheduler, if it has one."""
    return getattr(actor, "lr_scheduler", None) or getattr(actor, "scheduler", None)


def rng_file(directory: str | Path, rank: int) -> Path:
    return Path(directory) / RNG_DIR / f"rank_{rank:05d}.pt"


def save_rank(actor: Any, directory: str, with_reference: bool) -> dict[str, Any]:
    """Write this rank's share of the checkpoint into `directory` (collective over every actor rank).

    `with_reference`: also save the frozen reference model (the controller stores it once per run and links it into
    later checkpoints). Returns what the controller records in meta.json (layout and padded vocabulary)."""
    from megatron.core import dist_checkpointing

    root = Path(directory)
    if actor.rank == 0:
        for sub in (MODEL_DIR, OPTIMIZER_DIR, RNG_DIR) + ((REFERENCE_DIR,) if with_reference else ()):
            (root / sub).mkdir(parents=True, exist_ok=True)
    torch.distributed.barrier()
    model = _model_sharded(actor, actor.chunks)
    # The optimizer's sharded dict is built before the model's is saved: saving rewrites the model's ShardedTensors
    # in place, and the optimizer finds its parameters' keys by the identity of their tensors.
    optimizer = {
        "optimizer": _sharded_leaves(actor.optimizer.sharded_state_dict(model, metadata=_metadata(actor))),
        "step": _optimizer_step(actor.optimizer),  # plain values: dist_checkpointing puts them in common.pt
    }
    scheduler = _scheduler(actor)
    if scheduler is not None:
        optimizer["scheduler"] = scheduler.state_dict()
    dist_checkpointing.save(model, str(root / MODEL_DIR))
    dist_checkpointing.save(optimizer, str(root / OPTIMIZER_DIR))
    if with_reference:  # the reference's weights, resident or swapped in from the host (actor/reference.py)
        with actor.reference.weights_in(actor) as ref_chunks:
            dist_checkpointing.save(_model_sharded(actor, ref_chunks), str(root / REFERENCE_DIR))
    record = {"layout": actor.layout.describe(), "world_size": actor.world_size, "states": _rng_states(actor)}
    torch.save(record, rng_file(root, actor.rank))
    torch.distributed.barrier()  # every rank's files are complete before the controller publishes the directory
    return {
        "layout": actor.layout.describe(),
        "world_size": actor.world_size,
        "padded_vocab_size": actor.spec.padded_vocab,
    }


def load_rank(actor: Any, directory: str) -> dict[str, Any]:
    """Restore model, optimizer, scheduler, reference and (same layout only) RNG states from `directory`.

    Returns {"rng_restored": bool}."""
    from megatron.core import dist_checkpointing

    from mcore_rl.resharding.dist_ckpt import check_metadata_is_data, load_model_chunks

    root = Path(directory)
    load_model_chunks(actor.chunks, actor.pg, root / MODEL_DIR)
    model = _model_sharded(actor, actor.chunks)
    _allocate_state(actor.optimizer)
    current = actor.optimizer.sharded_state_dict(model, is_loading=True, metadata=_metadata(actor))
    leaves = _sharded_leaves(current)
    check_metadata_is_data(root / OPTIMIZER_DIR)
    loaded = dist_checkpointing.load({"optimizer": leaves}, str(root / OPTIMIZER_DIR))
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject

    for path, leaf in _walk(current):
        if isinstance(leaf, LocalNonpersistentObject):  # values the current optimizer keeps (its param groups)
            _set_leaf(current, "/".join(map(str, path)), leaf.unwrap())
    for path, value in loaded["optimizer"].items():
        _set_leaf(current, path, value)
    _put_common_step(current, loaded["step"])
    with _state_step_tolerated(actor.optimizer):
        actor.optimizer.load_state_dict(current)
    _set_group_step(actor.optimizer, loaded["step"])
    scheduler = _scheduler(actor)
    if scheduler is not None:
        if "scheduler" not in loaded:
            raise ValueError(f"{root / OPTIMIZER_DIR}: no learning-rate scheduler state (saved without one)")
        scheduler.num_steps = 0  # Megatron's load_state_dict *adds* the saved step count to the current one
        scheduler.load_state_dict(loaded["scheduler"])
    if getattr(actor, "reference", None) is not None:  # loaded into the chunks holding it, kept as the reference
        with actor.reference.weights_in(actor, writeback=True) as ref_chunks:
            load_model_chunks(ref_chunks, actor.pg, root / REFERENCE_DIR)
    record = read_rng_record(rng_file(root, actor.rank))
    same = record.get("layout") == actor.layout.describe() and record.get("world_size") == actor.world_size
    if same:
        _set_rng_states(record["states"])
    return {"rng_restored": same}


# --------------------------------------------------------------------------------------- optimizer state layout
# Megatron's optimizer state dict nests its tensors in a structure that depends on the layout: a ChainedOptimizer
# holds one sub-optimizer per parameter kind (dense, and experts when ep > 1), each with its own param groups. Its
# tensors, however, are ShardedTensors with global keys (`optimizer.state.exp_avg.<parameter key>`). So only the
# tensors are stored, flat by their path, and on load they are matched by key into the structure the *current*
# optimizer builds; the param groups (lr, betas, weight decay) come from the current config and the LR scheduler's
# state, and Adam's step count is stored once as a number.
def _walk(obj: Any, path: tuple = ()) -> Any:
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield from _walk(value, (*path, key))
    elif isinstance(obj, list | tuple):
        for i, value in enumerate(obj):
            yield from _walk(value, (*path, i))
    else:
        yield path, obj


def _sharded_leaves(state: Any) -> dict[str, Any]:
    """{path: leaf} for every ShardedTensor / ShardedObject / factory in `state` (path joined by '/')."""
    from megatron.core.dist_checkpointing.mapping import ShardedBase

    return {"/".join(map(str, p)): leaf for p, leaf in _walk(state) if isinstance(leaf, ShardedBase)}


def _set_leaf(state: Any, path: str, value: Any) -> None:
    keys = path.split("/")
    node = state
    for key in keys[:-1]:
        node = node[_key(node, key)]
    node[_key(node, keys[-1])] = value


def _key(node: Any, text: str) -> Any:
    """A path element back to the dict key or list index it came from (int keys are param ids)."""
    if isinstance(node, list | tuple):
        return int(text)
    return next(k for k in node if str(k) == text)


def _torch_optimizers(optimizer: Any) -> list[Any]:
    return [o.optimizer for o in getattr(optimizer, "chained_optimizers", [optimizer])]


def _optimizer_step(optimizer: Any) -> int:
    """Adam's step count (per-parameter `step` in torch's Adam, per group in TE's FusedAdam)."""
    steps = [int(s["step"]) for o in _torch_optimizers(optimizer) for s in o.state.values() if "step" in s]
    steps += [int(g["step"]) for o in _torch_optimizers(optimizer) for g in o.param_groups if g.get("step")]
    return max(steps, default=0)


def _allocate_state(optimizer: Any) -> None:
    """Give a never-stepped optimizer its (zero) Adam state before its loading state dict is built: Megatron
    0.16.1's DistributedOptimizer.state_dict() asserts one common `step` over the states, which without Apex/TE
    (the CPU runtime) fails on an empty state. The zeros are overwritten by the load."""
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner, init = getattr(sub, "optimizer", None), getattr(sub, "init_state_fn", None)
        if inner is None or init is None or any(len(s) for s in inner.state.values()):
            continue
        init(inner, getattr(sub, "config", None))
        for state in inner.state.values():
            state.setdefault("step", torch.tensor(0.0))


def _put_common_step(state: Any, step: int) -> None:
    """Adam's step into the current structure, where each Megatron optimizer reads it on load: `state["common_step"]`
    (FP32 / float16 optimizers: restored into every parameter's state) or each param group's `step` (the
    distributed optimizer's common state)."""
    if not step or not isinstance(state, dict):
        return
    if isinstance(state.get("state"), dict) and "param_groups" in state:
        state["state"]["common_step"] = torch.tensor(float(step))
    if isinstance(state.get("param_groups"), list):
        for group in state["param_groups"]:
            if isinstance(group, dict) and "step" in group:
                group["step"] = step
    for key, value in state.items():
        if key not in ("state", "param_groups"):
            _put_common_step(value, step)


@contextlib.contextmanager
def _state_step_tolerated(optimizer: Any) -> Any:
    """Megatron 0.16.1's distributed optimizer without Apex/TE (the CPU runtime; torch's Adam) cannot load its
    fully-reshardable state: load_state_dict first gives every parameter state torch Adam's `step` (restored from the
    param groups), then copies each key of that state from the loaded tensors, where it skipped `step`: KeyError
    'step'. For the length of the load, a parameter whose loaded tensors lack the `step` its state holds keeps that
    (already restored) `step`; everything else loads as Megatron does it."""
    patched = []
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        original = getattr(sub, "_set_main_param_and_optimizer_states", None)
        if original is None or getattr(sub.config, "use_precision_aware_optimizer_no_fp8_or_ds_fp8", False):
            continue

        def keep_step(model_param: Any, tensors: dict, sub: Any = sub, original: Any = original) -> None:
            group, order = sub.model_param_group_index_map[model_param]
            state = sub.optimizer.state[sub.optimizer.param_groups[group]["params"][order]]
            if "step" in state and "step" not in tensors:
                tensors = {**tensors, "step": state["step"]}
            original(model_param, tensors)

        sub._set_main_param_and_optimizer_states = keep_step
        patched.append(sub)
    try:
        yield
    finally:
        for sub in patched:
            del sub._set_main_param_and_optimizer_states  # the class's method again


def _set_group_step(optimizer: Any, step: int) -> None:
    """Adam's step count where Megatron's load leaves it wrong: TE's FusedAdam keeps it per param group (not in the
    state dict Megatron restores); torch's Adam per parameter, where Megatron's distributed optimizer (without
    Apex/TE) restores *one* tensor object into every parameter's state, which torch's Adam then increments in place
    once per parameter per step (measured: a resumed run's second step off by 3e-3 in the weights)."""
    for o in _torch_optimizers(optimizer):
        for group in o.param_groups:
            if "step" in group and group["params"]:
                group["step"] = step
        for state in o.state.values():
            if "step" in state:
                state["step"] = torch.tensor(float(step), dtype=state["step"].dtype, device=state["step"].device)
