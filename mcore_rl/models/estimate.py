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

Memory per GPU (bytes), mixed-precision Adam as Megatron runs it:
    weights bf16 (2) + main grads fp32 (4) + optimizer fp32 master + m + v (12, divided by the data-parallel size of
    that parameter when the distributed optimizer is on: dense / dp, experts / expert-dp)
    + a frozen bf16 reference copy (2) when actor.use_ref
    + an activation allowance (see `activation_bytes`) + a fixed allowance for the CUDA context and NCCL buffers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mcore_rl.parallel.layout import ParallelLayout

GIB = 1024**3


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
class MemoryEstimate:
    """Per-GPU figures of one actor rank, in bytes, and the assumptions they were made under."""

    dense_params_per_rank: float
    expert_params_per_rank: float
    weights: float
    grads: float
    optimizer: float
    reference: float
    activations: float
    overhead: float
    dp: int
    expert_dp: int
    distributed_optimizer: bool

    @property
    def params_per_rank(self) -> float:
        return self.dense_params_per_rank + self.expert_params_per_rank

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.reference + self.activations + self.overhead

    def describe(self) -> str:
        """One line per figure, in GiB."""
        g = lambda b: f"{b / GIB:.1f} GiB"  # noqa: E731
        return "\n".join(
            [
                f"  params per rank: {self.params_per_rank / 1e9:.2f} B "
                f"(dense {self.dense_params_per_rank / 1e9:.2f} B, experts {self.expert_params_per_rank / 1e9:.2f} B)",
                f"  weights bf16:        {g(self.weights)}",
                f"  main grads fp32:     {g(self.grads)}",
                f"  Adam fp32 (master+m+v){' / dp' if self.distributed_optimizer else ''}: {g(self.optimizer)}"
                f"  (dp={self.dp}, expert dp={self.expert_dp}, "
                f"distributed optimizer {'on' if self.distributed_optimizer else 'off'})",
                f"  reference bf16:      {g(self.reference)}",
                f"  activations:         {g(self.activations)}",
                f"  CUDA ctx + NCCL:     {g(self.overhead)}",
                f"  total per GPU:       {g(self.total)}",
            ]
        )


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
) -> float:
    """Activation allowance of one rank, assuming full activation recomputation (what large-MoE RL recipes use).

    Stored: each layer's bf16 input, for the layers of the largest stage, for the pp micro-batches in flight under
    1F1B (the first stage holds pp of them); plus one layer's working set during recompute (~34 s b h bytes / tp,
    Korthikanti et al., with sequence parallelism) and the fp32 logits of the output layer (vocab split by tp).
    """
    h = int(hf["hidden_size"])
    layers = int(hf["num_hidden_layers"])
    tokens = micro_batch * seq_len / cp
    stage_layers = layers / stage_pp_divisor(layers, pp, vpp, first_stage_layers, last_stage_layers)
    # stage layers x pp micro-batches in flight on the first stage (interleaving adds ~1/vpp more)
    stored = stage_layers * pp * (1 + (1 / vpp if vpp > 1 else 0)) * tokens * h * 2 / tp
    working = 34 * tokens * h / tp
    logits = tokens * int(hf["vocab_size"]) * 4 * 2 / tp  # logits + their softmax grad
    return stored + working + logits


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
    distributed_optimizer: bool = True,
    use_ref: bool = True,
    overhead_gib: float = 4.0,
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
) -> MemoryEstimate:
    """Per-GPU memory of one actor rank: params per rank = dense / (tp*pp) + experts / (ep*etp*pp), see module doc.

    With uneven first/last stages pp in those divisions becomes num_layers / (layers on the largest stage).
    """
    counts = count_params(hf)
    etp = tp if etp is None else etp
    stage_pp = stage_pp_divisor(int(hf["num_hidden_layers"]), pp, vpp, first_stage_layers, last_stage_layers)
    dense = counts.dense / (tp * stage_pp)
    expert = counts.expert / (ep * etp * stage_pp)
    dp = max(1, world_size // (tp * cp * pp))
    edp = max(1, world_size // (etp * ep * pp))
    optimizer = 12 * (dense / dp + expert / edp) if distributed_optimizer else 12 * (dense + expert)
    return MemoryEstimate(
        dense_params_per_rank=dense,
        expert_params_per_rank=expert,
        weights=2 * (dense + expert),
        grads=4 * (dense + expert),
        optimizer=optimizer,
        reference=2 * (dense + expert) if use_ref else 0.0,
        activations=activation_bytes(
            hf, tp, pp, cp, micro_batch, seq_len, vpp or 1, first_stage_layers, last_stage_layers
        ),
        overhead=overhead_gib * GIB,
        dp=dp,
        expert_dp=edp,
        distributed_optimizer=distributed_optimizer,
    )
