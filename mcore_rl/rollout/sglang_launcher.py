"""Real SGLang servers for the RL loop on GPU machines: the launch command, and a Ray actor that runs one server.

`rollout.engine=sglang` makes each rollout engine a `python -m sglang.launch_server` process (SGLang 0.5.23 flag
spellings). An engine spans `rollout.sglang.nnodes` nodes; the controller places one `SGLangServerActor` per node of
an engine, asks node 0 for a rendezvous address, then starts every node:

```
SGLangConfig + model path/dtype/key -> build_launch_command -> subprocess (own process group, log file)
                                    -> poll GET /health until 200 (node 0) -> base URL -> router / weight sync
```

Example (the controller does this; `num_gpus` is GPUs per node, `cfg.tp // cfg.nnodes`):

```
actor_cls = ray.remote(num_gpus=cfg.tp // cfg.nnodes)(SGLangServerActor)
head = actor_cls.remote(cfg, "/ckpt/hf", "bfloat16", api_key, 256, None, node_rank=0)
url = ray.get(head.start.remote())            # "http://127.0.0.1:PORT" for a one-node engine
```

On a machine without SGLang or CUDA, `sglang_unavailable_reason()` says what is missing; `rollout.engine=hf` runs our
embedded server (the same HTTP API over transformers) instead.
"""

from __future__ import annotations

import atexit
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from mcore_rl.parallel.groups import free_port
from mcore_rl.parallel.net import is_loopback

if TYPE_CHECKING:  # a type only: the config reaches this module through the engine kinds (rollout/engines/)
    from mcore_rl.config import SGLangConfig

SGLANG_ENTRY: tuple[str, ...] = ("-m", "sglang.launch_server")
"""What follows the interpreter on the command line; tests put a stand-in script here."""

# Our dtype names (model.dtype) -> SGLang's --dtype choices.
_SGLANG_DTYPES = {"float32": "float32", "bfloat16": "bfloat16"}

# Flags the launcher sets from SGLangConfig or its arguments, with SGLang's aliases for them (arg_groups/fields/ in
# 0.5.23). extra_args may not set any of them: a second value would silently override ours, and --dp-size would
# multiply the GPUs an engine uses behind Ray's back (SGLang's --dp-size counts whole model replicas).
_OWNED_FLAGS: dict[str, str] = {
    "--model-path": "--model-path",
    "--model": "--model-path",
    "--host": "--host",
    "--port": "--port",
    "--api-key": "--api-key",
    "--dtype": "--dtype",
    "--tp-size": "--tp-size",
    "--tensor-parallel-size": "--tp-size",
    "--ep-size": "--ep-size",
    "--ep": "--ep-size",
    "--expert-parallel-size": "--ep-size",
    "--dp-size": "--dp-size",
    "--data-parallel-size": "--dp-size",
    "--attn-dp-size": "--attn-dp-size",
    "--attention-data-parallel-size": "--attn-dp-size",
    "--enable-dp-attention": "--attn-dp-size",
    "--moe-a2a-backend": "--moe-a2a-backend",
    "--mem-fraction-static": "--mem-fraction-static",
    "--enable-memory-saver": "--enable-memory-saver",
    "--load-format": "--load-format",
    "--skip-tokenizer-init": "--skip-tokenizer-init",
    "--max-running-requests": "--max-running-requests",
    "--context-length": "--context-length",
    "--nnodes": "--nnodes",
    "--node-rank": "--node-rank",
    "--dist-init-addr": "--dist-init-addr",
    "--nccl-init-addr": "--dist-init-addr",
    "--enable-return-routed-experts": "--enable-return-routed-experts",
    "--quantization": "--quantization",
}

#: what an engine's config.json declares when sync.fp8 sends 128x128-blockwise e4m3 weights + weight_scale_inv (the
#: layout of DeepSeek-V3's and Qwen3's FP8 checkpoints; SGLang's Fp8Config reads it and builds e4m3 parameters with
#: a scale per block, so the pushed bytes land in FP8 parameters, not in bf16 ones)
FP8_QUANTIZATION_CONFIG: dict[str, object] = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
}

_HEALTH_POLL_S = 1.0  # between /health attempts while the server loads weights and captures CUDA graphs
_LOG_TAIL_LINES = 40


def build_launch_command(
    cfg: SGLangConfig,
    *,
    model_path: str,
    host: str,
    port: int,
    api_key: str | None,
    dtype: str,
    max_running_requests: int | None = None,
    context_length: int | None = None,
    node_rank: int = 0,
    dist_init_addr: str | None = None,
    return_routed_experts: bool = False,
    fp8: bool = False,
    python: str = sys.executable,
    entry: Sequence[str] = SGLANG_ENTRY,
) -> list[str]:
    """The argv that starts node `node_rank` of one SGLang engine: `[python, *entry, --model-path, ..., *extra_args]`.

    `return_routed_experts` (R3 routing replay) adds `--enable-return-routed-experts` (without it SGLang answers no
    `routed_experts`); `fp8` adds `--quantization fp8`, and the model directory's config.json must then declare
    `FP8_QUANTIZATION_CONFIG` (`engine_model_dir` writes it).

    DP attention uses SGLang 0.5.23's `--attn-dp-size N` (its replacement for the deprecated
    `--dp-size N --enable-dp-attention`; `--dp-size` alone now means N whole replicas). Raises ValueError naming the
    argument for a multi-node engine without `dist_init_addr`, an unknown dtype, a non-loopback host without an API
    key, or `extra_args` that set a flag the launcher owns.
    """
    if dtype not in _SGLANG_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_SGLANG_DTYPES)}, got {dtype!r}")
    if not is_loopback(host) and not api_key:
        raise ValueError(f"host={host!r} is not a loopback address: an api_key is required to bind it")
    if cfg.nnodes > 1 and not dist_init_addr:
        raise ValueError(
            f"dist_init_addr is required for a multi-node engine (rollout.sglang.nnodes={cfg.nnodes}): "
            "pass node 0's SGLangServerActor.address_for_dist_init()"
        )
    if not 0 <= node_rank < cfg.nnodes:
        raise ValueError(f"node_rank must be in [0, {cfg.nnodes}), got {node_rank}")

    cmd = [python, *entry, "--model-path", model_path, "--host", host, "--port", str(port)]
    if api_key:
        cmd += ["--api-key", api_key]
    cmd += ["--dtype", _SGLANG_DTYPES[dtype], "--tp-size", str(cfg.tp), "--ep-size", str(cfg.ep)]
    if cfg.enable_dp_attention:
        cmd += ["--attn-dp-size", str(cfg.dp)]
    if cfg.moe_a2a_backend is not None:
        cmd += ["--moe-a2a-backend", cfg.moe_a2a_backend]
    cmd += ["--mem-fraction-static", str(cfg.mem_fraction_static), "--load-format", cfg.load_format]
    if cfg.enable_memory_saver:
        cmd.append("--enable-memory-saver")
    if cfg.skip_tokenizer_init:
        cmd.append("--skip-tokenizer-init")
    if max_running_requests is not None:
        cmd += ["--max-running-requests", str(max_running_requests)]
    if context_length is not None:
        cmd += ["--context-length", str(context_length)]
    if return_routed_experts:
        cmd.append("--enable-return-routed-experts")
    if fp8:
        cmd += ["--quantization", "fp8"]
    if cfg.nnodes > 1:
        cmd += ["--nnodes", str(cfg.nnodes), "--node-rank", str(node_rank), "--dist-init-addr", str(dist_init_addr)]

    for arg in cfg.extra_args:
        flag = arg.split("=", 1)[0]
        if flag in _OWNED_FLAGS:
            raise ValueError(
                f"rollout.sglang.extra_args sets {flag}, which the launcher already sets "
                f"(as {_OWNED_FLAGS[flag]}) from rollout.sglang and the model/rollout config; set it there instead"
            )
    return cmd + list(cfg.extra_args)


def engine_model_dir(model: str | dict[str, Any], out_dir: str, fp8: bool = False) -> str:
    """The directory an SGLang engine loads: `model` itself (a checkpoint directory) when nothing changes, else
    `out_dir` with a config.json (the HF config of a `model` dict, or the checkpoint's) that declares
    `FP8_QUANTIZATION_CONFIG` when `fp8`, beside links to the checkpoint's other files (tokenizer, weights)."""
    if isinstance(model, str) and not fp8:
        return model
    if isinstance(model, str):
        with open(os.path.join(model, "config.json")) as f:
            config = json.load(f)
    else:
        config = dict(model)
    if fp8:
        config["quantization_config"] = dict(FP8_QUANTIZATION_CONFIG)
    os.makedirs(out_dir, exist_ok=True)
    if isinstance(model, str):
        for name in os.listdir(model):
            link = os.path.join(out_dir, name)
            if name != "config.json" and not os.path.lexists(link):
                os.symlink(os.path.abspath(os.path.join(model, name)), link)
    tmp = os.path.join(out_dir, f"config.json.tmp.{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(config, f, indent=2)
    os.replace(tmp, os.path.join(out_dir, "config.json"))
    return out_dir


def sglang_unavailable_reason() -> str | None:
    """None where real SGLang servers can run here (the `sglang` package is installed and CUDA works), else why not.

    The package is located, not imported: importing sglang pulls in triton, which needs a GPU toolchain.
    """
    spec = importlib.util.find_spec("sglang")
    # A bare directory named sglang on sys.path is a namespace package (no origin), not an install.
    installed = spec is not None and spec.origin is not None and spec.submodule_search_locations is not None
    import torch  # lazily: the rest of this module is standard library only

    missing = []
    if not installed:
        missing.append("the sglang package is not installed")
    if not torch.cuda.is_available():
        missing.append("CUDA is not available")
    if not missing:
        return None
    return (
        f"rollout.engine=sglang needs SGLang on a CUDA machine, but {' and '.join(missing)}: install it with "
        "`pip install -e '.[gpu]'` on a CUDA machine, or set rollout.engine=hf to run the embedded "
        "SGLang-compatible server (CPU or GPU)."
    )


def _node_ip() -> str:
    import ray  # lazily: only multi-node engines need the node's address

    return ray.util.get_node_ip_address()


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _tail(path: str, lines: int = _LOG_TAIL_LINES) -> str:
    with open(path, "rb") as f:
        return b"".join(f.readlines()[-lines:]).decode(errors="replace")


class SGLangServerActor:
    """One node of one SGLang engine, run as a subprocess of this actor. Wrap with `ray.remote(num_gpus=...)`.

    The server runs in its own process group, so `stop()` reaches SGLang's scheduler and detokenizer children too.
    Arguments are checked here (ValueError), not minutes later in `start()`. `python` and `entry` set the command
    prefix (`python -m sglang.launch_server` by default).
    """

    def __init__(
        self,
        cfg: SGLangConfig,
        model_path: str,
        dtype: str,
        api_key: str | None,
        max_running_requests: int | None,
        context_length: int | None,
        node_rank: int = 0,
        dist_init_addr: str | None = None,
        log_dir: str | None = None,
        *,
        bind_node_ip: bool = False,
        return_routed_experts: bool = False,
        fp8: bool = False,
        python: str = sys.executable,
        entry: Sequence[str] = SGLANG_ENTRY,
    ) -> None:
        self.cfg, self.node_rank, self.log_dir = cfg, node_rank, log_dir
        # A one-node engine on a one-node cluster stays on loopback. On a multi-node Ray cluster the router and the
        # actor ranks that push weights may run on other nodes, and a multi-node engine's ranks must reach each
        # other: then it binds the node's address, guarded by the per-run API key (build_launch_command insists).
        self.host = _node_ip() if bind_node_ip or cfg.nnodes > 1 else "127.0.0.1"
        self._launch_kwargs = dict(
            model_path=model_path,
            api_key=api_key,
            dtype=dtype,
            max_running_requests=max_running_requests,
            context_length=context_length,
            node_rank=node_rank,
            dist_init_addr=dist_init_addr,
            return_routed_experts=return_routed_experts,
            fp8=fp8,
            python=python,
            entry=tuple(entry),
        )
        self.api_key = api_key
        # validate now; a multi-node engine's rendezvous address may come later (set_dist_init_addr)
        placeholder = {"dist_init_addr": dist_init_addr or "127.0.0.1:1"} if cfg.nnodes > 1 else {}
        build_launch_command(cfg, host=self.host, port=0, **{**self._launch_kwargs, **placeholder})
        self._proc: subprocess.Popen[bytes] | None = None
        self._stopped = False  # once its group is swept, a pid may be recycled: never signal it again
        self._log_path: str | None = None
        # A Ray actor that exits normally runs atexit hooks; one that is SIGKILLed cannot, so the controller must
        # call stop() on shutdown.
        atexit.register(self.stop)

    def address_for_dist_init(self) -> str:
        """`host:port` on this node for SGLang's rendezvous: ask node 0 of a multi-node engine, pass to all nodes.

        SGLang also uses the next few ports above it (DP attention's ZMQ sockets); they are not reserved here.
        """
        host = _node_ip()
        return _host_port(host, free_port(host))

    def set_dist_init_addr(self, address: str) -> None:
        """Set the rendezvous address (node 0's `address_for_dist_init()`) before `start()`."""
        self._launch_kwargs["dist_init_addr"] = address

    def start(self, port: int | None = None) -> str:
        """Launch the server and wait for it: node 0 returns its base URL once GET /health answers 200; other nodes
        return "" once their process is running (node 0's health covers the whole engine).

        Raises RuntimeError (exit code and the log's last lines) if the process exits while starting, TimeoutError
        if /health is not 200 within `startup_timeout_s` (the process is stopped then).
        """
        if self._proc is not None and self._proc.poll() is None:
            raise RuntimeError(f"the SGLang server (pid {self._proc.pid}) is already running; stop() it first")
        port = free_port(self.host) if port is None else port
        cmd = build_launch_command(self.cfg, host=self.host, port=port, **self._launch_kwargs)
        log_dir = self.log_dir or tempfile.mkdtemp(prefix="sglang-")
        os.makedirs(log_dir, exist_ok=True)
        self._log_path = os.path.join(log_dir, f"sglang-node{self.node_rank}-port{port}.log")
        env = dict(os.environ, PYTHONUNBUFFERED="1")  # the log tail on a crash should hold the last words
        with open(self._log_path, "wb") as log:
            self._proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        self._stopped = False
        if self.node_rank != 0:
            self._raise_if_exited()
            return ""

        url = f"http://{_host_port(self.host, port)}"
        request = urllib.request.Request(f"{url}/health")
        if self.api_key:
            request.add_header("Authorization", f"Bearer {self.api_key}")
        # No proxies: a cluster's http_proxy must not capture requests to our own node.
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        while True:
            self._raise_if_exited()
            try:
                with opener.open(request, timeout=max(1.0, min(10.0, deadline - time.monotonic()))) as response:
                    if response.status == 200:
                        return url
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass  # not listening yet, or 503 while starting
            if time.monotonic() >= deadline:
                self.stop()
                raise TimeoutError(
                    f"SGLang at {url} did not answer GET /health with 200 within "
                    f"rollout.sglang.startup_timeout_s={self.cfg.startup_timeout_s}; last lines of "
                    f"{self._log_path}:\n{_tail(self._log_path)}"
                )
            time.sleep(_HEALTH_POLL_S)

    def _raise_if_exited(self) -> None:
        assert self._proc is not None and self._log_path is not None
        code = self._proc.poll()
        if code is None:
            return
        self.stop()  # its children may outlive it
        raise RuntimeError(
            f"the SGLang server (node {self.node_rank}) exited with code {code} while starting; "
            f"last {_LOG_TAIL_LINES} lines of {self._log_path}:\n{_tail(self._log_path)}"
        )

    def pid(self) -> int | None:
        """The server process's pid (also its process group id), or None before `start()`."""
        return None if self._proc is None else self._proc.pid

    def log_path(self) -> str | None:
        """The server's log file (stdout and stderr), or None before `start()`."""
        return self._log_path

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM the server's process group, SIGKILL it after `grace_s`; a no-op when nothing runs."""
        if self._proc is None or self._stopped:
            return
        pgid = self._proc.pid
        try:
            os.killpg(pgid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            self._proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
        # SIGKILL even when the leader exited in time: a child still in the group after that (a scheduler stuck in a
        # collective) would hold its GPU memory forever.
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._proc.wait()
        self._stopped = True
