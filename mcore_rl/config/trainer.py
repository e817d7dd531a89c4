"""The run itself: the prompts it trains on (data) and the trainer group (steps, runtime, placement, loggers,
validation, checkpoints)."""

from __future__ import annotations

from dataclasses import dataclass, field

from mcore_rl.config.checks import _check, _positive


@dataclass
class DataConfig:
    """Prompts."""

    train_files: list[str] = field(default_factory=list)  #: parquet files in verl's schema; empty = synthetic task
    #: validation parquet files (verl's schema); empty with a synthetic task and validation on (trainer.val_every or
    #: trainer.val_before_train) = a held-out synthetic set, written into the run dir with another seed
    val_files: list[str] = field(default_factory=list)
    val_batch_size: int | None = None  #: prompts per validation request batch; null = the whole set at once
    synthetic_task: str = "copy_digit"  #: task written into the run dir when train_files is empty
    synthetic_num_prompts: int = 512
    batch_size: int = 8  #: prompts per RL step
    #: longer prompts are refused (overlong=error), dropped, or cut (left/right); 512 as verl's (the demo jobs set 64)
    max_prompt_length: int = 512
    #: a prompt longer than max_prompt_length: error (refused, naming file and row) | drop | left (keep its last
    #: max_prompt_length tokens, verl's truncation=left) | right (keep its first ones)
    overlong: str = "error"
    prompt_key: str = "prompt"  #: the parquet column holding the chat messages (verl's data.prompt_key)
    shuffle: bool = True
    seed: int = 0

    def validate(self) -> None:
        _positive("data.batch_size", self.batch_size)
        if self.val_batch_size is not None:
            _positive("data.val_batch_size", self.val_batch_size)
        _positive("data.max_prompt_length", self.max_prompt_length)
        _positive("data.synthetic_num_prompts", self.synthetic_num_prompts)
        overlongs = ("error", "drop", "left", "right")
        _check(self.overlong in overlongs, "data.overlong", self.overlong, f"one of {overlongs}")


TRAINER_MODES = ("rl", "dpo")
"""What train.py's main dispatches to: the RL loop (train.run) or the DPO loop (controller/dpo_loop.py)."""


@dataclass
class TrainerConfig:
    """The run."""

    steps: int = 40  #: RL steps
    runtime: str = "cpu"  #: cpu (gloo, opt-in) | cuda (NCCL)
    run_dir: str = "runs/latest"  #: metrics.jsonl and artifacts go here
    #: per-step rollout dumps (verl's trainer.rollout_data_dir): <dir>/<step>.jsonl, one line per sample with its
    #: prompt and response text, score, ground truth and weight version (controller/producer.py); null = none
    rollout_data_dir: str | None = None
    seed: int = 0
    ray_address: str | None = None  #: host:port of a running cluster (auto: Ray's discovery); null = a new local Ray
    ray_num_cpus: int | None = None  #: logical CPUs for a local Ray (null = enough for the actors)
    #: where metrics go (metrics/backends.py): console (lines + progress bar), jsonl, tensorboard, wandb
    loggers: list[str] = field(default_factory=lambda: ["console", "jsonl"])
    project_name: str = "mcore_rl"  #: wandb project
    experiment_name: str | None = None  #: wandb run name (null = wandb's)
    wandb_mode: str = "offline"  #: offline (no network; `wandb sync` later) | online | disabled
    val_every: int = 0  #: validate every this many steps and after the last (verl: test_freq); 0 = never
    val_before_train: bool = False  #: validate the initial weights (logged as step 0)
    mode: str = "rl"  #: rl (the RL loop) | dpo (offline DPO on preference pairs, see the dpo group)
    #: split: actor ranks and rollout engines in separate pools (Ray placement groups) | colocated: they share
    #: devices; engines release weights and KV cache while the actor trains, the actor offloads while they generate
    placement: str = "split"
    #: save a training checkpoint into <run_dir>/checkpoints every this many steps and after the last; 0 = never
    save_every: int = 0
    keep_last: int | None = 2  #: checkpoints kept (older ones deleted after each save); null = keep all
    #: auto (the latest checkpoint in <run_dir>/checkpoints, else a new run) | a checkpoint dir | null (a new run)
    resume: str | None = None
    #: steps in a row whose loss or grad norm may be NaN/inf before the run stops with exit 1 naming the step and the
    #: metric (metrics/logger.py); 0 = stop at the first
    max_nonfinite_steps: int = 0
    #: trainer.runtime=cpu with a local Ray: before Ray starts, refuse (exit 2) a run whose estimated host memory (its
    #: actor and critic ranks, its engines: the dry run's per-rank estimate) exceeds what this host has available
    #: (MemAvailable, or the cgroup's limit if lower); false = no check. On GPU runs the model lives in GPU memory,
    #: which the dry run (launch/submit.py --dry-run) checks instead
    host_memory_check: bool = True
    #: the estimate is multiplied by this before it is compared: above 1 leaves room for what it does not count (the
    #: driver, Ray's own processes, other jobs on the host), below 1 lets a run start that the estimate says is tight
    host_memory_margin: float = 1.0

    def validate(self) -> None:
        from mcore_rl.config.names import LOGGERS, PLACEMENTS

        _positive("trainer.steps", self.steps)
        if self.ray_num_cpus is not None:
            _positive("trainer.ray_num_cpus", self.ray_num_cpus)
        _check(self.runtime in ("cpu", "cuda"), "trainer.runtime", self.runtime, "cpu or cuda")
        for name in self.loggers:  # whether a logger's package is installed here: preflight.check_loggers
            _check(name in LOGGERS, "trainer.loggers", list(self.loggers), f"a list of {LOGGERS}")
        modes = ("offline", "online", "disabled")
        _check(self.wandb_mode in modes, "trainer.wandb_mode", self.wandb_mode, f"one of {modes}")
        _check(
            isinstance(self.val_every, int) and self.val_every >= 0,
            "trainer.val_every",
            self.val_every,
            "an integer >= 0",
        )
        _check(self.mode in TRAINER_MODES, "trainer.mode", self.mode, f"one of {TRAINER_MODES}")
        _check(self.placement in PLACEMENTS, "trainer.placement", self.placement, f"one of {PLACEMENTS}")
        _check(
            isinstance(self.save_every, int) and not isinstance(self.save_every, bool) and self.save_every >= 0,
            "trainer.save_every",
            self.save_every,
            "an integer >= 0 (0 = no checkpoints)",
        )
        if self.keep_last is not None:
            _positive("trainer.keep_last", self.keep_last)
        _check(
            isinstance(self.max_nonfinite_steps, int) and not isinstance(self.max_nonfinite_steps, bool)
            and self.max_nonfinite_steps >= 0,
            "trainer.max_nonfinite_steps", self.max_nonfinite_steps, "an integer >= 0 (0 = stop at the first)",
        )  # fmt: skip
        _check(self.resume is None or bool(str(self.resume).strip()), "trainer.resume", self.resume,
               "auto, a checkpoint directory, or null")  # fmt: skip
        _check(self.host_memory_margin > 0, "trainer.host_memory_margin", self.host_memory_margin, "> 0")

    @property
    def validates(self) -> bool:
        """Whether the run validates at all."""
        return self.val_every > 0 or self.val_before_train
