"""Training checkpoints: save, resume, atomic publication and retention.

    rank_io.py   an actor rank's part: Megatron model, optimizer, scheduler, reference and RNG states
                 (megatron.core.dist_checkpointing, torch_dist: loads under any TP/PP/EP layout)
    store.py     the on-disk layout (<run_dir>/checkpoints/step_<n>/, `latest`), publication by rename, pruning,
                 and the checks a resume runs before anything starts
    manager.py   the controller's side: Checkpointer.resume before the loop, Checkpointer.after_step after each step

Config: trainer.save_every, trainer.keep_last, trainer.resume=auto|<dir>|null (mcore_rl/config/trainer.py).
"""
