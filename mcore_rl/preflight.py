"""Checks of a run's inputs before anything starts (no Ray, no Megatron rank): `check(cfg)` at the top of train.run.

Each check raises `ConfigError` naming the field, file or tensor and what was expected, so `python -m mcore_rl.train`
exits with code 2 and one message instead of failing minutes later inside a Ray actor:

    megatron-core    a release the CPU runtime is verified with (trainer.runtime=cpu)
    device runtime   trainer.runtime=cuda sees a GPU; no context parallelism (actor/runtime.py: check_runtime)
    run_dir          created (or existing) and writable
    data files       exist and are parquet files (their schema and rows are checked by data/dataset.py next)
    model config     config.json's (or model.hf_config's) sizes are integers, its float fields numbers (called by
                     the config's own check_model, which builds the family's shape from them)
    tokenizer        the directory exists and loads, and its ids fit the model's vocab_size
    resume           the checkpoint (checkpoint/manager.check_resume; shard sizes against each torch_dist .metadata,
                     loop_state.json readable) and its data position: same data.seed, data.shuffle and data files
    Ray CPUs         trainer.ray_num_cpus covers what the actors and engines reserve (else Ray waits forever)
    Ray address      a host:port trainer.ray_address answers, and takes this process's auth token
    checkpoint       model.path's safetensors headers (truncated files, index; each file opened by safetensors'
                     safe_open, the loader the engines read it with, which refuses overlapping or gapped tensor
                     offsets) and every tensor's name and shape against the family's weight map, from the
                     meta-device model (expected_hf_tensors); a pass is remembered (preflight_cache.py: keyed by the
                     headers, config, files' sizes and times, and our code), and the same checkpoint is not
                     checked again
    host memory      trainer.runtime=cpu with a local Ray: the run's estimated host memory (controller/
                     memory_estimate.py host_memory_parts: the dry run's per-rank estimate x the actor and critic ranks,
                     plus the engines) x trainer.host_memory_margin fits what this host has available (MemAvailable,
                     or the cgroup's limit if lower); trainer.host_memory_check=false turns it off

`python -m mcore_rl.preflight <model.path> <make_vocab_size_divisible_by> [mtp]` runs the checkpoint check alone, in a
child process, so the driver never initialises torch.distributed or Megatron itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from typing import Any

from mcore_rl.config import ConfigError, RLConfig


def check(cfg: RLConfig) -> None:
    """Every check above; ConfigError on the first failure. The checkpoint's check (a child process importing torch
    and Megatron: about 5 s of CPU) starts first and runs while the others do; its answer is read in its place in the
    order, so the first failure reported is the same as when the checks run one by one. A checkpoint that passed
    before, unchanged, under the same code, starts no child (preflight_cache.py)."""
    checkpoint = None
    if cfg.model.path:
        args = (cfg.model.path, cfg.model.make_vocab_size_divisible_by, cfg.model.mtp)
        checkpoint = remembered_check(*args) or start_checkpoint_check(*args)
    try:
        _check(cfg, checkpoint)
    finally:
        if checkpoint is not None and checkpoint.poll() is None:  # an earlier check failed: its answer is not needed
            checkpoint.kill()
            checkpoint.communicate()


def _check(cfg: RLConfig, checkpoint: subprocess.Popen | RememberedCheck | None) -> None:
    # the cheap checks first: a refusal among them answers before the tokenizer loads or the checkpoint child ends
    check_api_key_env()
    check_ray_cpus(cfg)
    check_ray_address(cfg.trainer.ray_address)
    if cfg.trainer.runtime == "cpu":
        from mcore_rl.parallel.cpu_runtime import megatron_version_problem

        problem = megatron_version_problem()
        if problem is not None:
            raise ConfigError(f"trainer.runtime=cpu: {problem}")
        check_recompute_on_cpu(cfg)
    from mcore_rl.actor.runtime import check_runtime

    check_runtime(cfg)  # runtime=cuda without a GPU, cp > 1 (sequences are not split per CP rank)
    check_run_dir(cfg.trainer.run_dir)
    for path in cfg.data.train_files:
        check_parquet(path)
    check_loggers(list(cfg.trainer.loggers))
    from mcore_rl.compat.verl.shim import WITHOUT_SCORER
    from mcore_rl.reward.sources import check_data_sources

    # every data_source of the train and val files has a scorer (or reward.path is set); verl's unscored ones say why
    check_data_sources(cfg, WITHOUT_SCORER)
    if cfg.trainer.resume is not None or cfg.trainer.save_every:
        from mcore_rl.checkpoint.manager import check_resume

        resumed = check_resume(cfg)  # a resume target that is not a compatible checkpoint; saves over another run's
        if resumed is not None:
            check_resume_data(resumed, cfg)  # its data position under this run's data.seed, shuffle and files
    check_tokenizer(cfg)
    if checkpoint is not None:
        finish_checkpoint_check(checkpoint, cfg.model.path)
    check_host_memory(cfg)  # last: every input above is known good, so the estimate reads a valid model


def check_api_key_env() -> None:
    """ConfigError if MCORE_RL_API_KEY is set to something that cannot be the run's API key (rollout/client.py)."""
    from mcore_rl.rollout.client import API_KEY_ENV, api_key_problem

    key = os.environ.get(API_KEY_ENV)
    if key is not None:
        problem = api_key_problem(key)
        if problem is not None:
            raise ConfigError(f"{API_KEY_ENV} (the run's API key for its engines and router) has {problem}")


def host_available_bytes() -> tuple[int, str]:
    """(bytes, where the figure comes from): what this host can still give a new run, the smaller of the kernel's
    MemAvailable (/proc/meminfo: free memory plus the caches it can reclaim) and, inside a cgroup with a memory limit
    (a container, a Slurm job), that limit minus the cgroup's usage (v2: memory.max - memory.current; v1:
    memory.limit_in_bytes - memory.usage_in_bytes)."""
    figures: list[tuple[int, str]] = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    figures.append((int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo"))
    except OSError:
        pass
    for limit_file, usage_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        try:
            with open(limit_file) as f:
                limit = f.read().strip()
            with open(usage_file) as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < 1 << 60:  # "max" (v2) or a near-2^63 number (v1): no limit
            figures.append((max(0, int(limit) - usage), f"the cgroup's limit minus its usage ({limit_file})"))
        break
    if not figures:
        return -1, "unknown"
    return min(figures)


def check_host_memory(cfg: RLConfig, available: tuple[int, str] | None = None) -> None:
    """trainer.runtime=cpu with a local Ray (trainer.ray_address=null): refuse a run whose estimated host memory
    (controller/memory_estimate.py host_memory_parts) x trainer.host_memory_margin exceeds `available` ((bytes, source);
    None: this host's, `host_available_bytes`). Skipped with trainer.host_memory_check=false, on trainer.runtime=cuda
    (the model lives in GPU memory, which `launch/submit.py --dry-run` checks), on a cluster (trainer.ray_address
    set: Ray places the ranks on other hosts too), and where this host's figure cannot be read."""
    if not cfg.trainer.host_memory_check or cfg.trainer.runtime != "cpu" or cfg.trainer.ray_address is not None:
        return
    from mcore_rl.checkpoint.manager import hf_config_of
    from mcore_rl.controller.memory_estimate import host_memory_parts

    have, source = available if available is not None else host_available_bytes()
    if have < 0:
        return
    parts = host_memory_parts(cfg, hf_config_of(cfg))
    total = sum(nbytes for _, nbytes in parts)
    margin = cfg.trainer.host_memory_margin
    need = total * margin
    if need <= have:
        return
    gib = 1024**3
    raise ConfigError(
        f"host memory: the run needs an estimated {need / gib:.2f} GiB ("
        + "; ".join(f"{what} = {nbytes / gib:.2f} GiB" for what, nbytes in parts)
        + f"; total {total / gib:.2f} GiB x trainer.host_memory_margin={margin:g}), but this host has "
        f"{have / gib:.2f} GiB available ({source}); expected at most {have / gib:.2f} GiB: shrink the run "
        "(actor.world_size, actor.micro_batch_size, model.max_sequence_length or data.max_prompt_length + "
        "rollout.max_new_tokens, rollout.num_engines, rollout.max_running_requests, a smaller model), free memory on "
        "this host, or set trainer.host_memory_check=false (launch/submit.py --dry-run prints the per-rank figures)"
    )


def check_recompute_on_cpu(cfg: RLConfig) -> None:
    """actor.recompute on trainer.runtime=cpu: Megatron's recompute (full and selective alike go through
    tensor_parallel.checkpoint) saves and restores the CUDA RNG state, so the first update failed on a machine
    without CUDA, after Ray and the ranks had started. Refused here, naming the key."""
    granularity = cfg.actor.recompute.granularity
    if granularity is not None:
        raise ConfigError(
            f"actor.recompute.granularity={granularity!r} is invalid with trainer.runtime=cpu: Megatron's activation "
            "recompute saves the CUDA RNG state, which a CPU run has not; expected actor.recompute.granularity=null "
            "on CPU (recompute is for GPU runs)"
        )


def check_run_dir(run_dir: str) -> None:
    """Create `run_dir` if needed and prove it writable with a temporary file."""
    try:
        os.makedirs(run_dir, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=run_dir, prefix=".write-test-"):
            pass
    except OSError as err:
        raise ConfigError(
            f"trainer.run_dir={run_dir!r} is not a writable directory ({err.strerror or err}); expected a path "
            "where the run can write its metrics and artifacts"
        ) from None


def check_loggers(loggers: list[str]) -> None:
    """Each of trainer.loggers has its package installed here (the config names them; this machine has them)."""
    from mcore_rl.metrics.backends import missing_packages

    for name, package in missing_packages(loggers).items():
        raise ConfigError(
            f"trainer.loggers={loggers!r} is invalid here: the {name} logger needs the {package!r} package, which is "
            f"not installed (pip install {package}); expected it installed or {name!r} removed"
        )


def check_parquet(path: str) -> None:
    """A data file that exists and has a parquet footer."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if not os.path.isfile(path):
        raise ConfigError(f"data.train_files: {path!r} does not exist; expected a parquet file in verl's schema")
    try:
        pq.read_schema(path)
    except (pa.ArrowInvalid, OSError) as err:
        raise ConfigError(f"data.train_files: {path!r} is not a readable parquet file ({err})") from None


def check_ray_cpus(cfg: RLConfig) -> None:
    """A local Ray with fewer CPUs than the actors reserve would leave them pending forever: refuse with figures."""
    have = cfg.trainer.ray_num_cpus
    if cfg.trainer.ray_address is not None or have is None:
        return
    from mcore_rl.controller.placement import ray_cpu_reservations

    terms = ray_cpu_reservations(cfg)
    need = sum(cpus for _, cpus in terms)
    if have < need:
        raise ConfigError(
            f"trainer.ray_num_cpus={have} is too small: the run reserves {need:g} CPUs "
            f"({' + '.join(what for what, _ in terms)}); expected >= {need:g}, or lower those reservations"
        )


def check_ray_address(address: str | None, timeout_s: float = 5.0) -> None:
    """A `host:port` trainer.ray_address must accept a TCP connection (Ray's own connect retries an unreachable GCS
    for minutes without a word) and take this process's auth token (ray.init retries a refused token for about 20 s
    before it gives up; one GCS client answers in under a second). "auto", "ray://..." and null are left to Ray."""
    import socket

    if not address or address == "auto" or "://" in address:
        return
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError(f"trainer.ray_address={address!r} is invalid: expected host:port, auto, ray://... or null")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as err:
        raise ConfigError(
            f"trainer.ray_address={address!r}: no Ray cluster answers there ({err.strerror or err}); expected the "
            "address of a running cluster's head (`ray start --head` prints it), or null for a local Ray"
        ) from None
    _check_ray_token(address)


def _check_ray_token(address: str) -> None:
    """One GCS client to `address`: a refused token is a user error now. Anything else (another Ray release without
    these names, a port that accepts TCP but is no GCS: the client gives up after Ray's connect timeout, 40 s by
    default) is left to ray.init, which reports it in its own words."""
    try:
        from ray._raylet import GcsClient
        from ray.exceptions import AuthenticationError
    except ImportError:
        return
    from mcore_rl.controller.placement import ray_connect_error

    try:
        GcsClient(address=address)
    except AuthenticationError as err:
        raise ray_connect_error(address, err) from None
    except Exception:  # noqa: BLE001 (see the docstring)
        return


def check_checkpoint(path: str, divisible_by: int, mtp: str = "auto") -> None:
    """Headers of model.path against the weight map, in a child process (see the module docstring); prints the
    family's note once when the checkpoint changes what is built (DeepSeek-V3 without its MTP weights: MTP off)."""
    args = (path, divisible_by, mtp)
    finish_checkpoint_check(remembered_check(*args) or start_checkpoint_check(*args), path)


class RememberedCheck:
    """A pass of the same checkpoint remembered by preflight_cache.py: the child's answer without the child."""

    returncode = 0

    def __init__(self, note: str | None) -> None:
        self.note = note

    def poll(self) -> int:
        return 0


def remembered_check(path: str, divisible_by: int, mtp: str = "auto") -> RememberedCheck | None:
    """The remembered pass of this check (preflight_cache.py), or None: the child must run."""
    from mcore_rl.preflight_cache import MISS, checkpoint_key, passed

    note = passed(checkpoint_key(path, divisible_by, mtp))
    return None if note is MISS else RememberedCheck(note)  # type: ignore[arg-type]


def start_checkpoint_check(path: str, divisible_by: int, mtp: str = "auto") -> subprocess.Popen:
    """`check_checkpoint`'s child process, started; `finish_checkpoint_check` reads its answer (and remembers a pass
    under the checkpoint's key taken now, if the files still have it then)."""
    from mcore_rl.preflight_cache import checkpoint_key

    key = checkpoint_key(path, divisible_by, mtp)
    proc = subprocess.Popen(
        [sys.executable, "-m", "mcore_rl.preflight", path, str(divisible_by), mtp],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    proc.cache_key = (key, divisible_by, mtp)  # type: ignore[attr-defined]
    return proc


def finish_checkpoint_check(proc: subprocess.Popen | RememberedCheck, path: str) -> None:
    """Wait for `start_checkpoint_check`'s child; ConfigError naming what model.path lacks, its note printed."""
    if isinstance(proc, RememberedCheck):
        if proc.note:
            print(proc.note)
        return
    stdout, stderr = proc.communicate()
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"checkpoint pre-flight of {path} crashed (exit {proc.returncode}):\n{stderr[-4000:]}")
    result = json.loads(lines[-1])
    if result["note"]:
        print(result["note"])
    problems = result["problems"]
    if problems:
        shown = "\n  ".join(problems[:10]) + (f"\n  ... and {len(problems) - 10} more" if len(problems) > 10 else "")
        raise ConfigError(f"model.path={path!r} does not hold the weights its config.json describes:\n  {shown}")
    key, divisible_by, mtp = getattr(proc, "cache_key", (None, 0, ""))
    if key is not None:
        from mcore_rl.preflight_cache import checkpoint_key, remember

        if checkpoint_key(path, divisible_by, mtp) == key:  # the files the child read are still the ones keyed
            remember(key, result["note"], result.get("sources", []))


def check_tokenizer(cfg: RLConfig) -> None:
    """model.tokenizer exists and loads (the error names the directory), and every id it can produce is below the
    model's vocab_size: a larger one was found only by the engine's 400 after Ray and the ranks had started."""
    from mcore_rl.checkpoint.manager import hf_config_of

    if cfg.model.tokenizer:
        where = f"model.tokenizer={cfg.model.tokenizer!r}"
        from mcore_rl.resharding.hf_io import not_readable_as, unreadable_entry

        if not os.path.isdir(cfg.model.tokenizer):
            raise ConfigError(f"{where}: {not_readable_as(cfg.model.tokenizer, want_dir=True) or 'no such directory'}")
        problem = unreadable_entry(cfg.model.tokenizer)  # transformers would block on a FIFO, read /dev/zero forever
        if problem is not None:
            raise ConfigError(f"{where}: {problem}")
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer, trust_remote_code=False)
        except Exception as err:  # noqa: BLE001 - transformers raises many types for a broken directory
            raise ConfigError(
                f"{where}: cannot load a tokenizer from it ({type(err).__name__}: {str(err)[:500]}); expected an HF "
                "tokenizer directory (tokenizer.json or the files of a slow tokenizer, and tokenizer_config.json)"
            ) from None
    else:
        from mcore_rl.data.tokenizer import build_tiny_tokenizer

        where, tokenizer = (
            "the built-in tiny tokenizer (model.tokenizer=null)",
            build_tiny_tokenizer(None, tools=cfg.agent.enabled),
        )
    try:
        vocab_size = hf_config_of(cfg).get("vocab_size")
    except (OSError, ValueError):
        return  # a missing or broken config.json is named by the config's own check
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool):
        return
    largest = max(tokenizer.get_vocab().values(), default=-1)
    source = f"{cfg.model.path}/config.json" if cfg.model.path else "model.hf_config"
    if largest >= vocab_size:
        raise ConfigError(
            f"{where} has token ids up to {largest} ({len(tokenizer)} tokens), but the model's vocab_size is "
            f"{vocab_size} ({source}): expected the model's own tokenizer, whose ids are all below vocab_size"
        )
    if cfg.model.path and len(tokenizer) * 2 < vocab_size:
        # A pretrained checkpoint pads its vocabulary by a few percent at most (Qwen2.5: 151,665 tokens in 152,064
        # rows); a tokenizer covering less than half of it is another model's, whose ids would mean other words.
        raise ConfigError(
            f"{where} has {len(tokenizer)} tokens, but the model's vocab_size is {vocab_size} ({source}): it is not "
            f"this checkpoint's tokenizer; expected model.tokenizer=<the model's tokenizer directory> (or the "
            "tokenizer files inside model.path)"
        )


def check_resume_data(path: Any, cfg: RLConfig) -> None:
    """The data position in the checkpoint at `path` means the same prompts in this run: the same data.seed and
    data.shuffle, and the same data files' bytes (when the run names files and the checkpoint has their sha256)."""
    from mcore_rl.checkpoint.store import LOOP_STATE, read_loop_state

    loader, file = read_loop_state(path)["loader"], os.path.join(str(path), LOOP_STATE)
    for key, ours in (("seed", cfg.data.seed), ("shuffle", cfg.data.shuffle)):
        if key in loader and loader[key] != ours:
            raise ConfigError(
                f"data.{key}={ours!r}, but the checkpoint's data position was saved with {key}={loader[key]!r} "
                f"({file}): the saved position would point into another order; expected data.{key}={loader[key]!r}"
                ", or a new run"
            )
    saved = loader.get("data_fingerprint")
    if saved and cfg.data.train_files:
        from mcore_rl.data.dataset import check_same_data, data_fingerprint

        try:
            check_same_data(saved, data_fingerprint(list(cfg.data.train_files)))
        except ValueError as err:
            raise ConfigError(f"data.train_files: {err} ({file})") from None


def expected_hf_tensors(hf: dict[str, Any], divisible_by: int) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """(HF tensor name -> shape the actor loads, every name it knows including optional aliases), from the family's
    model built on the meta device (world of one)."""
    import torch
    import torch.distributed as dist

    from mcore_rl.models.base import HFConfig
    from mcore_rl.models.builder import ModelSpec, build_gpt_chunks
    from mcore_rl.parallel.groups import free_port, init_distributed, initialize_model_parallel
    from mcore_rl.parallel.layout import ParallelLayout
    from mcore_rl.resharding.sync.inventory import meta_sources

    if not dist.is_initialized():
        init_distributed("cpu", 0, 1, "127.0.0.1", free_port())
    pg = initialize_model_parallel(ParallelLayout())
    spec = ModelSpec(
        HFConfig(hf),
        ParallelLayout(),
        dtype=torch.float32,
        make_vocab_size_divisible_by=divisible_by,
        config_overrides={"perform_initialization": False},
    )
    shape = spec.family.shape(spec.hf)
    sources = meta_sources(
        lambda: build_gpt_chunks(spec, pg, meta=True),
        spec.weight_map(),
        ParallelLayout(),
        shape.num_layers,
        shape.num_experts,
    )
    # Aliases (tied copies) are optional in a checkpoint; the transform outputs are required.
    required = {name: tuple(s.hf_shapes[i]) for s in sources for i, name in enumerate(s.hf[: s.num_outputs])}
    return required, {name for s in sources for name in s.hf}


def loader_problems(files: list[str]) -> list[str]:
    """The safetensors files the engines' loader refuses: each is opened by safetensors' own `safe_open` (what the
    embedded server's /update_weights_from_disk and transformers read with), which parses and validates the header
    (offsets contiguous, no two tensors sharing bytes) and reads no tensor."""
    from safetensors import SafetensorError, safe_open

    problems = []
    for file in files:
        try:
            with safe_open(file, framework="pt"):
                pass
        except (SafetensorError, OSError) as err:
            problems.append(f"{file}: not valid safetensors, the engines' loader refuses it: {err}")
    return problems


def checkpoint_problems(path: str, divisible_by: int, mtp: str = "auto") -> tuple[list[str], str | None]:
    """What is wrong with the HF checkpoint at `path` (unreadable headers, missing tensors, wrong shapes), and the
    family's note on what it builds from it."""
    from mcore_rl.models.registry import checkpoint_config
    from mcore_rl.resharding.hf_io import CheckpointError, HFCheckpointReader

    try:
        reader = HFCheckpointReader(path)
        config, note, unread = checkpoint_config(path, mtp)
    except CheckpointError as err:
        return [str(err)], None
    refused = loader_problems(sorted({str(reader.file_of(name)) for name in reader.names()}))
    if refused:
        return refused, note
    expected, known = expected_hf_tensors(config, divisible_by)
    fp8 = (reader.config.get("quantization_config") or {}).get("quant_method") == "fp8"
    problems = [f"HF tensor '{name}' is missing (expected shape {list(shape)})" for name, shape in expected.items()
                if name not in reader]  # fmt: skip
    unexpected = [
        n
        for n in reader.names()
        if n not in known and not (fp8 and n.endswith("_scale_inv")) and not (unread and n.startswith(unread))
    ]
    if unexpected:
        problems.append(
            f"{len(unexpected)} unexpected tensors not in the {config['model_type']} weight map: {unexpected[:5]}"
            + (" ..." if len(unexpected) > 5 else "")
        )
    for name, shape in expected.items():
        if name in reader and tuple(reader.shape(name)) != shape and not fp8:
            problems.append(f"{reader.file_of(name)}: tensor {name} has shape {list(reader.shape(name))}, expected "
                            f"{list(shape)}")  # fmt: skip
    return problems, note


if __name__ == "__main__":
    import warnings

    warnings.filterwarnings("ignore")
    from mcore_rl.parallel.cpu_runtime import enable_cpu_runtime

    enable_cpu_runtime(allow_with_gpu=True)  # meta tensors only: nothing runs on a device here
    try:
        problems, note = checkpoint_problems(
            sys.argv[1], int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else "auto"
        )
    except (TypeError, ValueError, KeyError, AssertionError) as err:  # a value the family cannot build from
        problems, note = [f"{sys.argv[1]}/config.json cannot be built ({type(err).__name__}: {err})"], None
    # our source files this check ran (preflight_cache.py keeps their sha256 with a pass)
    loaded = list(sys.modules.items())
    ours = {m.__file__ for name, m in loaded if name.split(".")[0] == "mcore_rl" and getattr(m, "__file__", None)}
    sources = sorted(ours | {os.path.abspath(__file__)})  # this module runs as __main__
    print(json.dumps({"problems": problems, "note": note, "sources": sources}))
