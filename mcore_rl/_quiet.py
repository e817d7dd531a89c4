"""The one list of known, harmless warnings that a run silences, so the console shows the run's own lines only.

    from mcore_rl._quiet import quiet_process, ray_init_kwargs
    quiet_process()                         # this process's warning filters
    ray.init(..., **ray_init_kwargs())      # Ray's start-up notices; every worker runs quiet_process() first

Each entry below (KNOWN_WARNINGS, KNOWN_LOG_RECORDS) names what emits it, why nobody can act on it, and the version
it was seen with. A filter matches the message's start and the warning class (and the module where it helps), never
a whole category, so an unexpected warning from the same library still shows. Add an entry only with a comment
saying why it is safe to hide.
"""

from __future__ import annotations

import logging
import warnings

# (category, message regex (matched at the start), module regex or "" for any, why it is safe to hide)
KNOWN_WARNINGS: tuple[tuple[type[Warning], str, str, str], ...] = (
    # megatron-core 0.16.1 warns at import in five modules when neither Transformer Engine nor Apex is importable,
    # which is the CPU runtime's normal state (DESIGN.md: Megatron's local spec on CPU); it then uses torch code.
    (UserWarning, r"Transformer Engine and Apex are not installed", r"megatron\.", "CPU runtime: no TE/apex"),
    (UserWarning, r"Apex is not installed\. Falling back to Torch Norm", r"megatron\.", "CPU runtime: torch norm"),
    # megatron-core 0.16.1's TransformerConfig.__post_init__ warns about its own default cuda_graph_scope
    # ("full"), which nothing here sets; no CUDA graphs are captured on CPU or by our GPU path.
    (UserWarning, r"full scope is deprecated", r"megatron\.", "Megatron's own default value"),
    # torch 2.13 deprecates all_gather_into_tensor / reduce_scatter_tensor, which megatron-core 0.16.1's
    # tensor_parallel mappings and DDP call every step (the warning points at torch's c10d_logger wrapper, whose
    # `return func(*args, **kwargs)` source line Ray prints beneath it). Megatron's call, not ours.
    (FutureWarning, r"`torch\.distributed\.all_gather_into_tensor` is deprecated", "", "Megatron's collective"),
    (FutureWarning, r"`torch\.distributed\.reduce_scatter_tensor` is deprecated", "", "Megatron's collective"),
    # megatron-core 0.16.1's torch_dist load strategy (dist_checkpointing/strategies/torch.py) calls torch's
    # checkpoint.load_state_dict, which torch 2.13 deprecates for `load`: every rank printed it on every resume.
    (FutureWarning, r"`load_state_dict` is deprecated and will be removed", "", "Megatron's checkpoint load"),
    # The same load builds torch ShardedTensors (dist_checkpointing/strategies/torch.py), whose methods torch 2.13
    # marks deprecated for DTensor: every rank printed it on every resume, through parallel/cpu_runtime.py's wrapper.
    (FutureWarning, r"Please use DTensor instead and we are deprecating ShardedTensor", "", "Megatron's checkpoint"),
)


def quiet_process() -> None:
    """Install the filters of KNOWN_WARNINGS in this process (idempotent: warnings.filterwarnings de-duplicates)."""
    for category, message, module, _why in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)


class _DropMessage(logging.Filter):
    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefix)


# (logger, message start, why it is safe to hide)
KNOWN_LOG_RECORDS: tuple[tuple[str, str, str], ...] = (
    # Ray 2.60 turns token authentication on by default for a new local cluster and announces it at WARNING level
    # on every start ("Set RAY_AUTH_MODE=disabled to opt out"): authentication stays on, nothing is wrong. (Setting
    # RAY_AUTH_MODE=token from Python instead does not work: Ray's C++ side has read the mode at import.)
    (
        "ray._private.authentication.authentication_token_setup",
        "Token authentication is enabled for this Ray cluster",
        "Ray's default, announced",
    ),
)


def quiet_ray_driver() -> None:
    """Drop Ray's known start-up notices in the driver (idempotent)."""
    for name, prefix, _why in KNOWN_LOG_RECORDS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessage) and f.prefix == prefix for f in logger.filters):
            logger.addFilter(_DropMessage(prefix))


def ray_init_kwargs() -> dict:
    """Arguments for ray.init that keep Ray's INFO lines ("Started a local Ray instance.") and every worker's known
    warnings off the console; Ray's own warnings and errors still show."""
    quiet_ray_driver()
    return {
        "logging_level": logging.WARNING,
        # Runs in every worker process before it imports an actor's module, i.e. before Megatron warns at import.
        "runtime_env": {"worker_process_setup_hook": "mcore_rl._quiet.quiet_process"},
    }
