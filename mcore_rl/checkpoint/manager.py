"""The controller's side of training checkpoints: save after a step, resume before the first one.

    ckpt = Checkpointer(cfg)
    state = ckpt.resume(actor, loader, LoopState())   # the fresh state for a new run; else the actor ranks, the data
                                           # position and the metric history restored, metrics.jsonl cut back to it
    sync.push(state.weight_version)        # the engines get the restored weights before the first generation
    ...
    ckpt.after_step(actor, state)          # every trainer.save_every steps and after the last one

A save: the ranks write model, optimizer, RNG (and, once per run, the reference) into a temporary directory
(rank_io.py), the controller adds loop_state.json and meta.json, renames it into place, moves `latest` and prunes to
trainer.keep_last (store.py). A failed save (a full disk) raises, naming the step and the cause; the previous
checkpoint stays in place.

PPO's critic (a CriticGroup: its own ranks, world and layout) saves into critic/ of the same checkpoint, through the
same rank_io.py code, and is restored from there; a gae run refuses a checkpoint without one (check_resume).

The reference model is the initial policy in GRPO. It is saved once, in the run's first checkpoint, and hard-linked
into every later one: each checkpoint stays self-contained and prunable at no extra disk. It is not rebuilt from the
initial weights on resume, because a randomly initialised model (model.path=null) depends on the layout's RNG streams,
so under another layout the rebuilt reference would differ, and an HF model.path may have changed since.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path
from typing import Any

from mcore_rl.checkpoint import store
from mcore_rl.checkpoint.rank_io import CRITIC_DIR, MODEL_DIR, REFERENCE_DIR
from mcore_rl.config import RLConfig
from mcore_rl.models.base import padded_vocab_size

#: test hook (tests/test_checkpoint_resume.py): `<step>` stops that step's save after the ranks have written their
#: files, before the checkpoint is complete; `<step>:published` after the step directory is renamed into place, before
#: `latest` moves; `<step>:latest` with the new `latest` written beside the old one, before it replaces it. A test
#: kills -9 the trainer there, deterministically. Unset in runs.
PAUSE_ENV = "MCORE_RL_TEST_CKPT_PAUSE_AT_STEP"
#: a failed save with less than this free on the checkpoint file system is reported as a full disk (no checkpoint of
#: a model worth training fits in it), whatever error the writer raised
FULL_DISK_BYTES = 64 * 2**20


def hf_config_of(cfg: RLConfig) -> dict[str, Any]:
    """The run's HF config: model.path's config.json, else model.hf_config."""
    if cfg.model.path:
        with open(os.path.join(cfg.model.path, "config.json")) as f:
            return json.load(f)
    return dict(cfg.model.hf_config)


def run_model_identity(cfg: RLConfig, hf_config: dict[str, Any]) -> dict[str, Any]:
    """The model identity of this run, as a checkpoint records it."""
    padded = padded_vocab_size(
        int(hf_config.get("vocab_size", 0)), cfg.model.make_vocab_size_divisible_by, cfg.actor.layout.tp
    )
    return store.model_identity(hf_config, cfg.model.dtype, cfg.model.make_vocab_size_divisible_by, padded)


def check_resume(cfg: RLConfig) -> Path | None:
    """The checkpoint this run resumes from (None: a new run), checked against the config before anything starts;
    also refuses a new run whose saves would overwrite another run's checkpoints."""
    root = store.checkpoints_root(cfg.trainer.run_dir)
    store.check_root(root)
    trainer = cfg.trainer
    if trainer.resume is None:
        earlier = store.latest(root)
        if trainer.save_every and earlier is not None:
            raise store.CheckpointError(
                f"{earlier}: {root} holds checkpoints of an earlier run, which this new run "
                f"(trainer.resume=null, trainer.save_every={trainer.save_every}) would overwrite: set "
                f"trainer.resume=auto to continue that run, or choose another trainer.run_dir"
            )
        metrics = Path(trainer.run_dir) / "metrics.jsonl"
        if earlier is not None and metrics.is_file() and metrics.stat().st_size:
            raise store.CheckpointError(
                f"{metrics}: holds the metrics of an earlier run whose checkpoints are in {root} (newest: "
                f"{earlier.name}); this new run (trainer.resume=null) would overwrite them: set trainer.resume=auto "
                f"to continue that run, or choose another trainer.run_dir"
            )
        return None
    path = store.resolve(trainer.resume, root)
    if path is None:
        return None
    meta = store.read_meta(path)
    store.check_compatible(
        path, meta, run_model_identity(cfg, hf_config_of(cfg)), cfg.actor.use_ref, critic=cfg.critic.enable
    )
    return path


def _pause_for_test(step: int, point: str | None) -> None:
    """PAUSE_ENV's hook: hold the save of `step` at `point` (None: before the checkpoint is complete)."""
    wanted = os.environ.get(PAUSE_ENV)
    if wanted is not None and wanted == (str(step) if point is None else f"{step}:{point}"):
        at = f" ({point})" if point else ""
        print(f"checkpoint: test hook {PAUSE_ENV}: pausing inside the save of step {step}{at}", flush=True)
        time.sleep(3600)


def _logged_step(line: str) -> int | None:
    """The step of one metrics.jsonl line; None for a line cut short by the crash."""
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None


class Checkpointer:
    """Saves and restores a run's training checkpoints (controller side)."""

    def __init__(self, cfg: RLConfig) -> None:
        self.cfg, self.hf_config = cfg, hf_config_of(cfg)
        self.root = store.checkpoints_root(cfg.trainer.run_dir)
        self.metrics_path = Path(cfg.trainer.run_dir) / "metrics.jsonl"
        #: where the reference model's files are to link from (set by the first save, or by a resume)
        self._reference: Path | None = None

    # ------------------------------------------------------------------------------------------------ resume
    def resume(self, actor: Any, loader: Any, new: Any, critic: Any = None) -> Any:
        """Restore the checkpoint trainer.resume designates into the actor ranks, the critic's (a CriticGroup, with
        critic.enable) and the loader, and return its loop state (of `new`'s type: controller/state.py's LoopState);
        `new` itself when there is nothing to resume."""
        for tmp in store.half_written(self.root):
            print(f"checkpoint: ignoring {tmp} (a save that did not finish; removed by the next save)", flush=True)
        path = check_resume(self.cfg)
        if path is not None and self.cfg.trainer.resume == "auto":
            named = (self.root / store.LATEST).read_text().strip() if (self.root / store.LATEST).is_file() else None
            if named != path.name:  # a save killed after its rename, before `latest` moved (store.latest)
                note = f"checkpoint: {path.name} is complete and newer than `latest` names ({named}); using it"
                print(note, flush=True)
        if path is None:
            if self.cfg.trainer.resume == "auto":
                print(f"checkpoint: none in {self.root}; starting a new run", flush=True)
            return new
        start = time.perf_counter()
        meta = store.read_meta(path)
        from mcore_rl.actor.megatron_actor import MegatronActor

        results = actor.call(MegatronActor.load_checkpoint, str(path))
        critic_results = []
        if critic is not None:  # its own world and layout; check_resume made sure the checkpoint holds one
            critic_results = critic.group.call(MegatronActor.load_checkpoint, str(path / CRITIC_DIR))
        try:
            state = type(new).from_dict(json.loads((path / store.LOOP_STATE).read_text()))
        except (ValueError, TypeError) as err:
            raise store.CheckpointError(f"{path / store.LOOP_STATE}: {err}") from None
        loader.load_state_dict(state.loader)
        self._trim_metrics(state.step)
        if self.cfg.actor.use_ref:
            self._reference = path / REFERENCE_DIR
        rng = "restored" if all(r["rng_restored"] for r in results) else (
            f"not restored: saved under {meta['layout']} x{meta['world_size']}, running under "
            f"{self.cfg.actor.layout.to_layout().describe()} x{self.cfg.actor.world_size} (per-rank streams differ)"
        )  # fmt: skip
        if critic_results and not all(r["rng_restored"] for r in critic_results):
            saved = meta.get("critic") or {}
            rng += (
                f"; the critic's not restored: saved under {saved.get('layout')} x{saved.get('world_size')}, running "
                f"under {self.cfg.critic.layout.to_layout().describe()} x{self.cfg.critic.world_size}"
            )
        print(
            f"checkpoint: resumed {path} at step {state.step}, weight version {state.weight_version} "
            f"in {time.perf_counter() - start:.1f} s; RNG states {rng}",
            flush=True,
        )
        return state

    def _trim_metrics(self, step: int) -> None:
        """Drop metric lines of steps after the checkpoint (the crashed run's): the resumed run writes them again."""
        if not self.metrics_path.is_file():
            return
        lines = self.metrics_path.read_text().splitlines(keepends=True)
        kept = [line for line in lines if _logged_step(line) is not None and _logged_step(line) <= step]
        if len(kept) != len(lines):
            tmp = self.metrics_path.with_name(self.metrics_path.name + ".tmp")
            tmp.unlink(missing_ok=True)  # never written through a link left there
            with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644), "w") as f:
                f.write("".join(kept))
            os.replace(tmp, self.metrics_path)

    # -------------------------------------------------------------------------------------------------- save
    def after_step(self, actor: Any, state: Any, critic: Any = None) -> Path | None:
        """Save if the step is a multiple of trainer.save_every, or the last step (with saving on)."""
        every = self.cfg.trainer.save_every
        if every and (state.step % every == 0 or state.step == self.cfg.trainer.steps):
            return self.save(actor, state, critic)
        return None

    def save(self, actor: Any, state: Any, critic: Any = None) -> Path:
        """Write a complete checkpoint of `state`, the actor ranks and the critic's (if any, under critic/); publish
        it atomically; prune."""
        start = time.perf_counter()
        store.check_root(self.root)  # also here: a link put in place after the run's pre-flight
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f"{store.TMP_PREFIX}{store.step_name(state.step)}-{uuid.uuid4().hex[:8]}"
        try:
            tmp.mkdir()
            use_ref = self.cfg.actor.use_ref
            linked = use_ref and self._reference is not None and self._reference.is_dir()
            if linked:
                store.link_tree(self._reference, tmp / REFERENCE_DIR)
            from mcore_rl.actor.megatron_actor import MegatronActor

            saved = actor.call(MegatronActor.save_checkpoint, str(tmp), use_ref and not linked)[0]
            critic_saved = (
                critic.group.call(MegatronActor.save_checkpoint, str(tmp / CRITIC_DIR))[0] if critic else None
            )
            _pause_for_test(state.step, None)
            self._write_export_files(tmp / MODEL_DIR, saved)
            store.write_json(tmp / store.LOOP_STATE, state.to_dict())
            meta = {
                "format": store.FORMAT,
                "version": store.VERSION,
                "step": state.step,
                "weight_version": state.weight_version,
                "model": run_model_identity(self.cfg, self.hf_config),
                "layout": saved["layout"],
                "world_size": saved["world_size"],
                "reference": use_ref,
                "critic": critic_saved and {"layout": critic_saved["layout"], "world_size": critic_saved["world_size"]},
                "saved_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            }
            if saved["padded_vocab_size"] != meta["model"]["padded_vocab_size"]:
                raise store.CheckpointError(
                    f"the actor pads the vocabulary to {saved['padded_vocab_size']}, the controller computed "
                    f"{meta['model']['padded_vocab_size']}"
                )
            store.write_json(tmp / store.META, meta)  # last: a directory without meta.json is not a checkpoint
            final = store.publish(tmp, self.root, state.step, pause=lambda point: _pause_for_test(state.step, point))
        except BaseException as err:
            import shutil

            free = shutil.disk_usage(self.root).free  # before the partial save is removed
            shutil.rmtree(tmp, ignore_errors=True)
            if not isinstance(err, Exception):
                raise
            previous = store.latest(self.root)
            cause = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
            if free < FULL_DISK_BYTES and "No space left on device" not in cause:
                # torch.save's zip writer reports a full disk as "[enforce fail at inline_container.cc] unexpected
                # pos ..." (seen with torch 2.13), which names nothing a user can act on
                cause = f"No space left on device ({free} bytes were free on the file system of {self.root}; {cause})"
            raise store.CheckpointError(
                f"saving the checkpoint of step {state.step} into {self.root} failed: {cause}; "
                f"{'the previous checkpoint ' + str(previous) + ' is intact' if previous else 'no checkpoint exists'}"
            ) from err
        if use_ref:
            self._reference = final / REFERENCE_DIR
        removed = store.prune(self.root, self.cfg.trainer.keep_last, keep=final)
        note = f", removed {', '.join(p.name for p in removed)}" if removed else ""
        print(f"checkpoint: saved {final} in {time.perf_counter() - start:.1f} s{note}", flush=True)
        return final

    def _write_export_files(self, model_dir: Path, saved: dict[str, Any]) -> None:
        """Beside model/'s torch_dist files: the HF config, tokenizer files and the dtype / vocabulary padding / layout
        file, as hf-to-mcore writes them, so `convert_checkpoint.py mcore-to-hf` exports the checkpoint as it is."""
        from dataclasses import asdict

        from mcore_rl.resharding.dist_ckpt import CONVERT_META_NAME, HF_SUBDIR
        from mcore_rl.resharding.hf_io import copy_side_files

        hf_dir = model_dir / HF_SUBDIR
        hf_dir.mkdir()
        store.write_json(hf_dir / "config.json", dict(self.hf_config, dtype=self.cfg.model.dtype))
        tokenizer = self.cfg.model.tokenizer or os.path.join(self.cfg.trainer.run_dir, "tokenizer")
        for source in (self.cfg.model.path, tokenizer):  # generation config from the model, then the tokenizer
            if source and os.path.isdir(source):
                copy_side_files(source, hf_dir)
        identity = run_model_identity(self.cfg, self.hf_config)
        convert_meta = {
            "model_type": self.hf_config.get("model_type"),
            "dtype": self.cfg.model.dtype,
            "make_vocab_size_divisible_by": self.cfg.model.make_vocab_size_divisible_by,
            "layout": asdict(self.cfg.actor.layout),
            "padded_vocab_size": identity["padded_vocab_size"],
            "saved_under": saved["layout"],
        }
        store.write_json(model_dir / CONVERT_META_NAME, convert_meta)
