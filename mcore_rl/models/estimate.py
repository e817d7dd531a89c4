"""Parameter counts and a per-GPU memory estimate for an actor layout, from the HF config alone.

Used by `launch/submit.py --dry-run` to refuse a layout that cannot fit before a 32-node job waits in the queue:

    python launch/submit.py --nodes 32 --gpus-per-node 8 --partition p --time 1:00:00 --job-name j --dry-run \
        -- --config-name qwen3_235b_a22b_32n

Counts come straight from the HF config dict (hidden size, layers, heads, experts, FFN sizes, vocab, MLA ranks), so the
estimate works for any MoE or dense config without importing Megatron. Supported layouts of the weights:
- GQA attention (Llama/Qwen): q, k, v, o projections (+ q/k norms, ignored: they are tiny).
- MLA attention (DeepSeek-V3, `kv_lora_rank` present): q_a/q_b (or plain q), kv_a (with the rope part), kv_b, o.
- MoE layers: routed experts (gate+up+down), shared experts, router; dense layers: gate+up+down of `intermediate_size`.

Pipeline stages: every figure is for the rank holding the most decoder layers. With even stages that is 1/pp of them;
with uneven first/last stages (`first_stage_layers` / `last_stage_layers`) the largest stage's share.

Memory per GPU (bytes): the per-parameter bytes of weights, fp32 grads and the optimizer (fp32 masters + Adam state,
sharded over dp by the distributed optimizer, partly on the host when offloaded) come from the run's
`OptimizerPlan` (mcore_rl/actor/optimizer.py), the same object the Megatron ranks build from, passed in by the caller
(this module sits below the workers and imports nothing of theirs); parameters per rank come
from the meta-device model at the actor's layout (`rank_params`: padded vocabulary and every norm included), so the
figures are what the ranks allocate. On top: a frozen reference copy when actor.use_ref with
actor.ref_placement=resident (with `host` its weights and the parked policy's are host memory, reported beside the
GPU figures, as the offloaded optimizer share is), an activation allowance
(`activation_bytes`, from the run's `actor.recompute`, the setting the ranks pass to Megatron), Megatron's attention
scores buffer where the local spec runs on CUDA (`attention_buffer_bytes`), a fixed allowance for the runtime (CUDA:
the context and NCCL buffers; the CPU runtime: the rank's process image and what building and running it add besides
tensors, `CPU_PROCESS_IMAGE_MIB` / `CPU_RUNTIME_GROWTH_MIB`, and the freed tensors glibc keeps at the peak,
`CPU_ALLOCATOR_SLACK`), and a colocated rollout engine's share (`EngineShare`:
its weights and KV cache, `rollout.sglang.mem_fraction_static` of the GPU).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Protocol

from mcore_rl.parallel.layout import ParallelLayout

GIB = 1024**3
MIB = 1024**2
#: The CPU runtime's counterpart of the CUDA context + NCCL allowance, per rank: what a rank's process holds besides the
#: tensors of the other terms, measured by `python tools/bench_memory_estimate.py [--preset wide]` (its "process"
#: rows; harness ranks: forked, gloo; a Ray actor's worker adds Ray's own, not measured), Python 3.11, torch 2.13 CPU,
#: megatron-core 0.16.1. Both parts are fixed: the same on the default job (0.08 M parameters per rank) and on the
#: wide preset (60 M).
#: - the process image, the RSS after imports (interpreter, torch, megatron-core, the actor's modules): 236.8 MiB;
CPU_PROCESS_IMAGE_MIB = 237
#: - what building the model, a logprob pass and the first update add, beyond the tensors held and the bytes glibc
#:   holds free: 64 MiB (default job) and 70 MiB (wide), of it 35 MiB file-backed (library code and data first
#:   touched: torch's CPU kernels, oneDNN, gloo) and the rest anonymous (the modules' Python objects, the process
#:   groups, the stacks of 54 gloo threads).
CPU_RUNTIME_GROWTH_MIB = 67
#: - what glibc keeps of an update's freed tensors at the RSS peak, as a fraction of the update's working set: a
#:   pass frees activations below glibc's mmap threshold (which its first large free raises to 32 MiB) into its
#:   arenas, and the next allocations of other sizes do not fill them. Measured by the bench's "allocator free bytes
#:   at the peak" row against the estimated working set: 287/752 MiB on the default job (fp32), 255/698 MiB in
#:   bf16 with the distributed optimizer. (The wide preset holds 159 MiB free at the peak from building, where the
#:   weights' terms dominate; not modelled.) `--mmap-threshold 1048576` returns it (11 MiB free at the peak) but made
#:   the update 10-30% slower here, so the ranks keep glibc's default and the estimate counts it.
CPU_ALLOCATOR_SLACK = 0.37
#: the CUDA context + NCCL buffers (not measured here: no GPU)
CUDA_OVERHEAD_GIB = 4.0
#: bytes of an activation element: activations are in the model's dtype (model.dtype)
ACTIVATION_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
METRIC_CHUNK = 1024  #: positions per chunk of the entropy metric: actor/logprobs.py's LOGPROB_CHUNK (a test checks)


class OptimizerPlan(Protocol):
    """What the estimate reads of the actor's optimizer plan (mcore_rl/actor/optimizer.py: OptimizerPlan)."""

    dtype: str

    def rank_bytes(self, params: float, dp: int) -> Any:
        """weights / grads / optimizer_device / optimizer_host bytes of `params` parameters sharded over `dp`."""
        ...

    def describe(self) -> str: ...


class Recompute(Protocol):
    """What the estimate reads of `actor.recompute` (mcore_rl/config/model.py: RecomputeConfig)."""

    granularity: str | None
    method: str | None
    num_layers: int | None


@dataclass(frozen=True)
class ParamCounts:
    """Parameters of a model split by how a layout shards them."""

    dense: int  #: attention, dense MLPs, shared experts, routers, norms, embeddings and output head (tp x pp sharded)
    expert: int  #: routed experts (ep x etp x pp sharded)

    @property
    def total(self) -> int:
        return self.dense + self.expert


def _moe_layers(hf: Mapping[str, Any], num_layers: int) -> list[bool]:
    """Which layers are MoE: DeepSeek's first_k_dense_replace, Qwen's mlp_only_layers / decoder_sparse_step."""
    experts = hf.get("n_routed_experts") or hf.get("num_experts") or hf.get("num_local_experts") or 0
    if not experts:
        return [False] * num_layers
    if "first_k_dense_replace" in hf:
        k = int(hf.get("first_k_dense_replace") or 0)
        return [i >= k for i in range(num_layers)]
    only_dense = set(hf.get("mlp_only_layers") or [])
    step = int(hf.get("decoder_sparse_step") or 1)
    return [i not in only_dense and (i + 1) % step == 0 for i in range(num_layers)]


def count_params(hf: Mapping[str, Any]) -> ParamCounts:
    """Dense and routed-expert parameter counts of the decoder described by an HF config dict (MTP layers excluded)."""
    h = int(hf["hidden_size"])
    layers = int(hf["num_hidden_layers"])
    heads = int(hf["num_attention_heads"])
    vocab = int(hf["vocab_size"])
    if hf.get("kv_lora_rank"):
        # MLA (DeepSeek-V2/V3): queries through an optional low-rank q_a/q_b, keys/values through a shared latent.
        nope, rope = int(hf["qk_nope_head_dim"]), int(hf["qk_rope_head_dim"])
        v_dim, kv_rank = int(hf["v_head_dim"]), int(hf["kv_lora_rank"])
        q_rank = hf.get("q_lora_rank")
        q_head = nope + rope
        q = (h * q_rank + q_rank + q_rank * heads * q_head) if q_rank else h * heads * q_head
        kv = h * (kv_rank + rope) + kv_rank + kv_rank * heads * (nope + v_dim)
        attn = q + kv + heads * v_dim * h
    else:
        head_dim = int(hf.get("head_dim") or h // heads)
        kv_heads = int(hf.get("num_key_value_heads") or heads)
        attn = h * heads * head_dim + 2 * h * kv_heads * head_dim + heads * head_dim * h
    experts = int(hf.get("n_routed_experts") or hf.get("num_experts") or hf.get("num_local_experts") or 0)
    moe_ffn = int(hf.get("moe_intermediate_size") or 0)
    shared = int(hf.get("n_shared_experts") or 0) * moe_ffn + int(hf.get("shared_expert_intermediate_size") or 0)
    dense_ffn = int(hf.get("intermediate_size") or 0)
    dense = expert = 0
    for is_moe in _moe_layers(hf, layers):
        dense += attn + 2 * h  # two RMSNorms
        if is_moe:
            expert += experts * 3 * h * moe_ffn
            dense += experts * h + 3 * h * shared  # router + shared experts (replicated over ep, split by tp)
        else:
            dense += 3 * h * dense_ffn
    embeddings = vocab * h * (1 if hf.get("tie_word_embeddings") else 2)
    return ParamCounts(dense=dense + embeddings + h, expert=expert)


@dataclass(frozen=True)
class RankParams:
    """Parameters held by one actor rank, split by the data-parallel group their optimizer state is sharded over."""

    dense: float  #: optimised over dp (x cp)
    expert: float  #: routed experts, optimised over expert dp

    @property
    def total(self) -> float:
        return self.dense + self.expert


@dataclass(frozen=True)
class EngineShare:
    """A rollout engine colocated on the actor's GPUs: its weights and its static pool (weights + KV cache)."""

    weights: float  #: bytes of engine weights per GPU
    static: float  #: mem_fraction_static x GPU memory: weights + KV cache while it holds them
    releases: bool  #: enable_memory_saver: weights and KV cache released while the actor trains


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-GPU figures of one actor rank, in bytes, and the assumptions they were made under."""

    dense_params_per_rank: float
    expert_params_per_rank: float
    weights: float
    grads: float
    optimizer: float  #: on the GPU
    optimizer_host: float  #: offloaded to host memory (not in `total`)
    reference: float  #: on the GPU (ref_placement=resident)
    activations: float
    overhead: float
    dp: int
    expert_dp: int
    plan: OptimizerPlan
    engine: EngineShare | None = None
    reference_host: float = 0.0  #: ref_placement=host: the reference's weights + the parked policy's, host memory
    buffers: float = 0.0  #: Megatron's attention scores buffer (local spec on CUDA), kept between passes
    grad_reduce_copy: float = 0.0  #: gloo's copy of a gradient bucket in the reduce-scatter (CPU runtime)
    allocator_slack: float = 0.0  #: CPU runtime: freed tensors glibc keeps at the peak (CPU_ALLOCATOR_SLACK x working)
    runtime: str = "cuda"  #: which runtime's allowance `overhead` is (cuda: context + NCCL; cpu: the rank's process)

    @property
    def params_per_rank(self) -> float:
        return self.dense_params_per_rank + self.expert_params_per_rank

    @property
    def resident(self) -> float:
        """What the actor holds between updates (weights, grads, optimizer, reference, buffers, the runtime's
        allowance)."""
        return self.weights + self.grads + self.optimizer + self.reference + self.buffers + self.overhead

    @property
    def training(self) -> float:
        """Peak while training: resident + activations + (CPU) the allocator's slack (+ the engine's pool if it does
        not release it)."""
        engine = self.engine.static if self.engine is not None and not self.engine.releases else 0.0
        return self.resident + self.working + self.allocator_slack + engine

    @property
    def working(self) -> float:
        """An update's working set: its activations, or the gradient reduce's copy where that is larger (it runs
        after the backward has freed them)."""
        return max(self.activations, self.grad_reduce_copy)

    @property
    def generating(self) -> float:
        """Peak while a colocated engine generates: resident + the engine's weights and KV cache."""
        return self.resident + (self.engine.static if self.engine is not None else 0.0)

    @property
    def total(self) -> float:
        return max(self.training, self.generating)

    def _overhead_line(self, g: Any) -> str:
        if self.runtime == "cuda":
            return f"  CUDA ctx + NCCL:     {g(self.overhead)}"
        return (
            f"  CPU rank process:    {g(self.overhead)} (host memory: the image after imports "
            f"{CPU_PROCESS_IMAGE_MIB} MiB + what the build and first step add, {CPU_RUNTIME_GROWTH_MIB} MiB)"
        )

    def describe(self) -> str:
        """One line per figure, in GiB."""
        g = lambda b: f"{b / GIB:.1f} GiB"  # noqa: E731
        lines = [
            f"  params per rank: {self.params_per_rank / 1e9:.2f} B "
            f"(dense {self.dense_params_per_rank / 1e9:.2f} B, experts {self.expert_params_per_rank / 1e9:.2f} B)",
            f"  {self.plan.describe()} (dp={self.dp}, expert dp={self.expert_dp})",
            f"  weights {self.plan.dtype}:    {g(self.weights)}",
            f"  main grads fp32:     {g(self.grads)}",
            f"  optimizer on {'GPU:   ' if self.runtime == 'cuda' else 'device:'} {g(self.optimizer)}"
            + (f"  (host: {g(self.optimizer_host)})" if self.optimizer_host else ""),
            f"  reference:           {g(self.reference)}"
            + (f"  (host: {g(self.reference_host)}, swapped in per pass)" if self.reference_host else ""),
            f"  activations:         {g(self.activations)}",
            *(
                [f"  attention buffer:    {g(self.buffers)} (local spec: b x heads x s^2 scores)"]
                if self.buffers
                else []
            ),
            *(
                [
                    f"  grad reduce copy:    {g(self.grad_reduce_copy)} (gloo's reduce-scatter clones the bucket, "
                    "after the backward: the larger of it and the activations counts)"
                ]
                if self.grad_reduce_copy
                else []
            ),
            self._overhead_line(g),
            *(
                [
                    f"  allocator slack:     {g(self.allocator_slack)} (host memory: freed tensors glibc keeps, "
                    f"{CPU_ALLOCATOR_SLACK:.2f} x the working set)"
                ]
                if self.allocator_slack
                else []
            ),
            f"  training peak:       {g(self.training)}",
        ]
        if self.engine is not None:
            lines += [
                f"  colocated engine:    {g(self.engine.static)} (weights {g(self.engine.weights)} + KV cache "
                f"{g(self.engine.static - self.engine.weights)}; "
                f"{'released' if self.engine.releases else 'kept'} while training)",
                f"  generation peak:     {g(self.generating)}",
            ]
        lines.append(f"  total per {'GPU:      ' if self.runtime == 'cuda' else 'rank:     '} {g(self.total)}")
        return "\n".join(lines)


def rank_params(
    hf: Mapping[str, Any], layout: ParallelLayout, divisible_by: int, dtype: str, fold_layers: bool = True
) -> RankParams:
    """Parameters of the fullest actor rank at `layout`, counted from the model built on the meta device (the same
    builder and weight map the ranks use: padded vocabulary, norms, MTP layers included; no memory, no ranks).

    `fold_layers`: build one decoder layer of each kind (dense, MoE; the last layer's kind last, as MTP layers copy
    it) and count every other layer as its kind's representative, as resharding/dist_ckpt.py's checkpoint plan does:
    layers of one kind hold the same parameters. Megatron builds ~0.5 ms per expert, so DeepSeek-V3's 58 x 256 experts
    took ~26 s of a 37 s dry run; folded, a few. `fold_layers=False` builds every layer
    (tests/test_dist_ckpt_plan.py compares the two)."""
    import dataclasses
    import math

    import torch
    import torch.distributed as dist

    from mcore_rl.models.base import HFConfig
    from mcore_rl.models.builder import ModelSpec, build_gpt_chunks
    from mcore_rl.parallel.cpu_runtime import enable_cpu_runtime
    from mcore_rl.parallel.groups import free_port, init_distributed, initialize_model_parallel
    from mcore_rl.resharding.dist_ckpt import layer_kinds, representative_layers
    from mcore_rl.resharding.sync.inventory import meta_sources

    if not dist.is_initialized():
        enable_cpu_runtime(allow_with_gpu=True)  # meta tensors only: nothing runs, so a GPU here is no concern
        init_distributed("cpu", 0, 1, "127.0.0.1", free_port())
    pg = initialize_model_parallel(ParallelLayout())
    spec = ModelSpec(
        HFConfig(dict(hf)),
        ParallelLayout(),
        dtype=getattr(torch, dtype),
        make_vocab_size_divisible_by=divisible_by * layout.tp,
        config_overrides={"perform_initialization": False},
    )
    shape = spec.family.shape(spec.hf)
    kinds = layer_kinds(spec.transformer_config())
    keep = representative_layers(kinds) if fold_layers else list(range(len(kinds)))
    if len(keep) < len(kinds):
        overrides = dict(spec.config_overrides, num_layers=len(keep), moe_layer_freq=[kinds[i] for i in keep])
        spec = dataclasses.replace(spec, config_overrides=overrides)
    built = dataclasses.replace(layout, pp=1, vpp=None, first_stage_layers=None, last_stage_layers=None)
    sources = meta_sources(
        lambda: build_gpt_chunks(spec, pg, meta=True), spec.weight_map(), built, len(keep), shape.num_experts
    )
    # Per built layer (its index in `keep`) or "head" (embedding: first stage) / "tail" (final norm, output layer,
    # MTP layers: last stage): dense parameters and expert parameters per EP rank.
    weight_map = spec.weight_map()
    dense: dict[Any, int] = {}
    expert: dict[tuple[Any, int], int] = {}
    for source in sources:
        _, local = weight_map.match(source.mcore)
        if "layer" in local and source.mcore.startswith("decoder."):
            where: Any = local["layer"]
        else:
            where = "head" if source.mcore.startswith("embedding.") else "tail"
        n = math.prod(source.shard_shape)
        if source.ep_rank is None:
            dense[where] = dense.get(where, 0) + n
        else:
            expert[(where, source.ep_rank)] = expert.get((where, source.ep_rank), 0) + n
    built_of = {kinds[j]: i for i, j in enumerate(keep)}  # kind -> a built layer of that kind
    built_layer = [built_of[kind] for kind in kinds] if len(keep) < len(kinds) else list(range(len(kinds)))
    stages = layout.pp_stage_layers(len(kinds))
    vpp = layout.virtual_stages
    ranks = []
    for pp in range(layout.pp):
        layers = [built_layer[layer] for v in range(vpp) for layer in stages[pp * vpp + v]]
        ends = (["head"] if pp == 0 else []) + (["tail"] if pp == layout.pp - 1 else [])
        d = sum(dense.get(w, 0) for w in layers + ends)
        for ep in range(layout.ep):
            ranks.append((d, sum(expert.get((w, ep), 0) for w in layers + ends)))
    d, e = max(ranks, key=sum)
    return RankParams(dense=d, expert=e)


def stage_pp_divisor(
    num_layers: int,
    pp: int,
    vpp: int | None = None,
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
) -> float:
    """num_layers / (layers on the largest pipeline stage): pp with even stages, less with uneven first/last stages.

    Per-rank shares of layer-proportional quantities divide by this instead of pp. LayoutError if the uneven stages
    do not split num_layers the way Megatron requires.
    """
    if first_stage_layers is None and last_stage_layers is None:
        return pp
    layout = ParallelLayout(pp=pp, vpp=vpp, first_stage_layers=first_stage_layers, last_stage_layers=last_stage_layers)
    return num_layers / max(layout.layers_per_pp_rank(num_layers))


def activation_bytes(
    hf: Mapping[str, Any],
    tp: int,
    pp: int,
    cp: int,
    micro_batch: int,
    seq_len: int,
    vpp: int = 1,
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
    recompute: Recompute | None = None,
    dtype_bytes: int = 2,
    fused_attention: bool = True,
) -> float:
    """Activation allowance of one rank under `recompute` (None: Megatron's default, every activation kept), for
    activations of `dtype_bytes` (the model's dtype: 4 for fp32 runs) and attention fused (Transformer Engine's flash
    attention) or not (Megatron's local spec: the CPU runtime, a GPU without TE).

    A layer's activations are ~34 s b h bytes / tp (Korthikanti et al., bf16, sequence parallelism, flash attention:
    no s^2 term, so selective recompute of the core attention saves nothing here); its input alone is 2 s b h / tp.
    Full recompute keeps the input of each recompute unit (uniform: every num_layers layers; block: the first
    num_layers layers of the stage, the rest keep everything) and rebuilds one unit's activations in the backward.
    Layers of the largest stage, times the pp micro-batches in flight on the first stage under 1F1B (interleaving adds
    ~1/vpp more); plus the loss's logits (below; vocab split by tp).

    Unfused attention (`fused_attention=False`) keeps what Megatron 0.16.1's local spec saves for the backward
    (`unfused_layer_elements` per token, counted with saved_tensors_hooks by tools/bench_memory_estimate.py) and, per
    layer, the attention probabilities b x heads x s^2 (fp32 softmax output, + its 16-bit copy in a 16-bit model); the
    backward adds two s^2 blocks (the grads of one layer's probabilities, in the model's dtype, and of its scores, in
    fp32); selective recompute (of the core attention) keeps no probabilities but rebuilds one layer's. Measured
    against the profiler's peak of a real update (tests/test_memory_estimate.py, tools/bench_memory_estimate.py):
    0.90-1.14 over Qwen3-MoE and DeepSeek-V3 shapes, fp32 and bf16, 64-512 tokens; the recompute paths are not measured
    (Megatron's recompute needs CUDA's RNG state: the CPU runtime refuses it).
    """
    import math

    h = int(hf["hidden_size"])
    layers = int(hf["num_hidden_layers"])
    tokens = micro_batch * seq_len / cp
    stage_layers = layers / stage_pp_divisor(layers, pp, vpp, first_stage_layers, last_stage_layers)
    in_flight = pp * (1 + (1 / vpp if vpp > 1 else 0))
    # Korthikanti's 34 bytes are 17 bf16 elements per token x h; activations are in the model's dtype
    full_layer, layer_input = 17 * dtype_bytes * tokens * h / tp, dtype_bytes * tokens * h / tp
    backward = 0.0  # what one layer's backward holds beside the stored activations
    if not fused_attention:
        heads = int(hf["num_attention_heads"])
        scores = tokens * seq_len * heads / tp  # b x heads x s x s, over tp
        per_token = sum(unfused_layer_elements(hf, i) for i in range(layers)) / layers
        layer_tokens = per_token * dtype_bytes * tokens / tp
        probabilities = scores * (4 + (dtype_bytes if dtype_bytes < 4 else 0))
        full_layer = layer_tokens + probabilities
        # the backward frees each layer's saved tensors as it goes; its peak is one attention's two s^2 grads: of the
        # probabilities (model dtype) and of the scores (fp32, as Megatron's softmax runs)
        backward = (dtype_bytes + 4) * scores
    granularity = recompute.granularity if recompute is not None else None
    if granularity == "full":
        unit = recompute.num_layers or 1
        if recompute.method == "block":
            kept = max(0.0, stage_layers - unit)
            stored = in_flight * (min(unit, stage_layers) * layer_input + kept * full_layer)
            working = full_layer + backward
        else:  # uniform
            stored = in_flight * math.ceil(stage_layers / unit) * layer_input
            working = unit * full_layer + backward
    elif granularity == "selective" and not fused_attention:
        # Megatron recomputes the core attention (its s^2 probabilities) of one layer at a time in the backward
        stored = in_flight * stage_layers * (full_layer - probabilities)
        working = probabilities + backward
    else:
        stored, working = in_flight * stage_layers * full_layer, backward
    # The loss reads the logits at response positions (at most every position, the bound taken here), all at once
    # in a training pass (actor/logprobs.py, actor/step_losses.py): the output layer's logits and the gathered rows in
    # the model dtype and their fp32 softmax stay for the backward; the entropy metric (no graph) gathers its own rows
    # in the model dtype and its fp32 temporaries (the cast of 16-bit rows, masked, shifted, exp, exp x shifted and
    # its where) come and go METRIC_CHUNK positions at a time before it, so the larger of them and the backward's
    # working set counts. Measured with a 32k vocabulary (tests/test_memory_estimate.py).
    vocab_entries = int(hf["vocab_size"]) / tp
    logit_entries = tokens * vocab_entries
    held = logit_entries * (2 * dtype_bytes + 4)
    entropy_metric = logit_entries * dtype_bytes + min(tokens, METRIC_CHUNK) * vocab_entries * (
        20 + (4 if dtype_bytes < 4 else 0)
    )
    return stored + held + max(working, entropy_metric)


def attention_buffer_bytes(
    hf: Mapping[str, Any],
    tp: int,
    micro_batch: int,
    seq_len: int,
    dtype_bytes: int,
    fused_attention: bool,
    runtime: str,
) -> float:
    """Megatron's attention scores buffer on the local spec (0.16.1 DotProductAttention: `baddbmm` into a
    [b x heads/tp, s, s] tensor of the model's dtype from the global memory buffer, kept between passes and grown to
    the largest micro-batch of any pass: `micro_batch` is the larger of the update's and the logprob passes'). With
    beta=0 `baddbmm` never reads it and nothing writes it: CUDA commits the bytes at allocation, the CPU on first touch,
    so on the CPU runtime it takes no resident memory of its own (tools/bench_memory_estimate.py counts its resident
    pages: none on the default job's 256 MiB buffer; a small one, 1 MiB on the wide preset, shares heap pages that
    other tensors touched)."""
    if fused_attention or runtime != "cuda":
        return 0.0
    return float(micro_batch * int(hf["num_attention_heads"]) / tp * seq_len * seq_len * dtype_bytes)


def grad_reduce_copy_bytes(
    plan: OptimizerPlan, grads: tuple[float, float], dps: tuple[int, int], runtime: str
) -> float:
    """The gradient reduce's working copy on the CPU runtime: with the distributed optimizer Megatron reduce-scatters
    each gradient bucket, and gloo (torch 2.13's reduce_scatter_tensor_coalesced) clones its input first: a bucket's
    fp32 grads, the whole buffer without `overlap_grad_reduce` (one bucket), else Megatron's bucket of
    max(40 M, 1 M x dp) parameters; dense and expert buffers one after the other, so the larger counts. `grads`:
    their grad bytes, `dps`: the groups they reduce over. Measured on the wide preset, bf16 + distributed optimizer:
    a 192 MiB clone of the expert grads (over an expert-dp group of one rank), the update's peak (the profiler's
    largest live allocation; tools/bench_memory_estimate.py --preset wide -- model.dtype=bfloat16
    actor.optim.distributed=true). NCCL reduces in place: 0 on CUDA; the replicated optimizer all-reduces in place."""
    if runtime != "cpu" or not getattr(plan, "distributed", False):
        return 0.0
    copies = []
    for grad_bytes, dp in zip(grads, dps):
        if not grad_bytes:  # a group of one rank still runs the collective (Megatron 0.16.1 does not skip it)
            continue
        if getattr(plan, "overlap_grad_reduce", False):
            grad_bytes = min(grad_bytes, max(40_000_000, 1_000_000 * dp) * 4.0)  # fp32 main grads
        copies.append(grad_bytes)
    return max(copies, default=0.0)


def unfused_layer_elements(hf: Mapping[str, Any], layer: int) -> float:
    """Elements per token that decoder layer `layer` saves for its backward on Megatron's local spec, at tp=1 (the
    s^2 probabilities aside). Attribution of what tools/bench_memory_estimate.py counts on the default job's
    Qwen3-MoE shape (28.6 h per token per layer): attention 3 h (the norm's input, the QKV and projection inputs)
    + the QKV output (q + 2 kv) + q twice and kv once (q/k norms, RoPE) + q, k, v reshaped for the batched matmuls
    (3 q, keys and values expanded to every head); SwiGLU MLP: 2 h + 4 f (norm and fc1 inputs, fc1's 2 f output, the
    activation and the product); MoE: 4 h + the router's probabilities + per routed token 3 h + 4 f (the dispatched
    copy, the expert's input and output, its SwiGLU), shared experts as a dense MLP. q = heads x head dim; kv = the
    keys' width (GQA: kv heads x head dim; MLA: the per-head key and value widths)."""
    h = int(hf["hidden_size"])
    heads = int(hf["num_attention_heads"])
    if hf.get("kv_lora_rank"):
        q_head = int(hf["qk_nope_head_dim"]) + int(hf["qk_rope_head_dim"])
        q, kv = heads * q_head, heads * (q_head + int(hf["v_head_dim"])) / 2
    else:
        head_dim = int(hf.get("head_dim") or h // heads)
        q, kv = heads * head_dim, int(hf.get("num_key_value_heads") or heads) * head_dim
    attention = 3 * h + (q + 2 * kv) + (2 * q + kv) + 3 * q
    if _moe_layers(hf, int(hf["num_hidden_layers"]))[layer]:
        experts = int(hf.get("n_routed_experts") or hf.get("num_experts") or hf.get("num_local_experts") or 0)
        top_k = int(hf.get("num_experts_per_tok") or 1)
        f = int(hf.get("moe_intermediate_size") or 0)
        shared = int(hf.get("n_shared_experts") or 0) * f + int(hf.get("shared_expert_intermediate_size") or 0)
        mlp = 4 * h + experts + top_k * (3 * h + 4 * f) + (2 * h + 4 * shared if shared else 0)
    else:
        mlp = 2 * h + 4 * int(hf.get("intermediate_size") or 0)
    return attention + mlp


def estimate_memory(
    hf: Mapping[str, Any],
    world_size: int,
    tp: int,
    pp: int,
    cp: int = 1,
    ep: int = 1,
    etp: int | None = None,
    vpp: int | None = None,
    micro_batch: int = 1,
    seq_len: int = 4096,
    *,
    plan: OptimizerPlan,
    recompute: Recompute | None = None,
    use_ref: bool = True,
    ref_placement: str = "resident",
    overhead_gib: float | None = None,
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
    params: RankParams | None = None,
    engine: EngineShare | None = None,
    fused_attention: bool = True,
    runtime: str = "cuda",
    logprob_micro_batch: int | None = None,
) -> MemoryEstimate:
    """Per-GPU memory of one actor rank (see the module doc); bytes per parameter from `plan` (the run's
    `optimizer_plan`), activations under `recompute` (the run's `actor.recompute`), the reference's weights on the GPU
    or the host by `ref_placement` (the run's resolved `actor.ref_placement`: actor/reference.py's
    resolve_placement), parameters per rank from `params`
    (`rank_params`; without it, the closed-form count of `count_params`: dense / (tp*pp) + experts / (ep*etp*pp), pp
    being num_layers / layers on the largest stage). `fused_attention`: the ranks run Transformer Engine's flash
    attention (no s^2 scores kept); False for Megatron's local spec (the CPU runtime, a GPU without TE). `runtime`
    (the run's trainer.runtime) picks the fixed allowance, unless `overhead_gib` gives one: CUDA_OVERHEAD_GIB for the
    CUDA context and NCCL, or the CPU rank's process (CPU_PROCESS_IMAGE_MIB + CPU_RUNTIME_GROWTH_MIB) and its
    allocator's slack (CPU_ALLOCATOR_SLACK).
    `logprob_micro_batch`: samples per micro-batch of the logprob passes (actor.logprob_micro_batch_size; None: as the
    update's), which size the attention buffer when larger."""
    if runtime not in ("cuda", "cpu"):
        raise ValueError(f"runtime={runtime!r}: expected 'cuda' or 'cpu' (trainer.runtime)")
    cpu_process = (CPU_PROCESS_IMAGE_MIB + CPU_RUNTIME_GROWTH_MIB) * MIB
    if overhead_gib is not None:
        overhead = overhead_gib * GIB
    else:
        overhead = CUDA_OVERHEAD_GIB * GIB if runtime == "cuda" else cpu_process
    etp = tp if etp is None else etp
    if params is None:
        counts = count_params(hf)
        stage_pp = stage_pp_divisor(int(hf["num_hidden_layers"]), pp, vpp, first_stage_layers, last_stage_layers)
        params = RankParams(dense=counts.dense / (tp * stage_pp), expert=counts.expert / (ep * etp * stage_pp))
    dp = max(1, world_size // (tp * cp * pp))
    edp = max(1, world_size // (etp * ep * pp))
    # the distributed optimizer shards dense parameters over dp x cp (Megatron's data-parallel-with-cp group)
    dense, expert = plan.rank_bytes(params.dense, dp * cp), plan.rank_bytes(params.expert, edp)
    dtype_bytes = ACTIVATION_BYTES.get(plan.dtype, 2)
    buffer_batch = max(micro_batch, logprob_micro_batch or micro_batch)
    est = MemoryEstimate(
        dense_params_per_rank=params.dense,
        expert_params_per_rank=params.expert,
        weights=dense.weights + expert.weights,
        grads=dense.grads + expert.grads,
        optimizer=dense.optimizer_device + expert.optimizer_device,
        optimizer_host=dense.optimizer_host + expert.optimizer_host,
        reference=dense.weights + expert.weights if use_ref and ref_placement == "resident" else 0.0,
        reference_host=2 * (dense.weights + expert.weights) if use_ref and ref_placement == "host" else 0.0,
        activations=activation_bytes(
            hf,
            tp,
            pp,
            cp,
            micro_batch,
            seq_len,
            vpp or 1,
            first_stage_layers,
            last_stage_layers,
            recompute,
            dtype_bytes=dtype_bytes,
            fused_attention=fused_attention,
        ),
        buffers=attention_buffer_bytes(hf, tp, buffer_batch, seq_len, dtype_bytes, fused_attention, runtime),
        grad_reduce_copy=grad_reduce_copy_bytes(plan, (dense.grads, expert.grads), (dp * cp, edp), runtime),
        overhead=overhead,
        dp=dp,
        expert_dp=edp,
        plan=plan,
        engine=engine,
        runtime=runtime,
    )
    if runtime == "cpu" and overhead_gib is None:  # an explicit overhead_gib replaces the runtime's allowances
        est = replace(est, allocator_slack=CPU_ALLOCATOR_SLACK * est.working)
    return est
