"""Routing replay for MoE training forwards, on megatron-core's own mechanism (transformer/moe/router_replay.py).

Modes (verl's `router_replay.mode` names; `actor.router_replay_mode`):

    disabled   every forward routes by its own router logits
    R3         rollout routing replay: each token goes to the experts the rollout engine routed it to
               (SGLang's `return_routed_experts`, int32 [tokens, num_hidden_layers, top_k]) in every policy forward
               (old logprobs and the update), so training computes the gradient of the policy that sampled
    R2         the step's first training forward (the old-logprob pass) records its routing on each rank; the
               update's forwards replay it, so the update's ratio is not moved by expert flips of its own making

Data path (R3):  engine -> Sample.routed_experts [P+R-1, L, k] -> TrainBatch "routed_experts" [B, T, L, k]
                 (controller/samples.py, -1 where nothing was routed) -> per micro-batch [b, s, L, k]
                 -> this rank's layers, Megatron's token order (s-major, [s*b, k]; with sequence parallelism this
                 TP rank's s-slice) -> `RouterReplay.set_target_indices` + REPLAY_FORWARD on each of its routers.
Positions the engine never fed (the last response token, padding) get experts 0..k-1: their outputs are never read
(causal attention, right padding), so any valid choice leaves the used logprobs unchanged.

Models are built with `TransformerConfig.moe_enable_routing_replay` (`config_overrides`) when a mode is on; only
decoder-layer routers are driven (MTP layers route by their own logits). The frozen reference always routes itself.
"""

from __future__ import annotations

from typing import Any

import torch

ROUTER_REPLAY_MODES = ("disabled", "R2", "R3")
"""The registry `actor.router_replay_mode` is validated against."""

ROUTED_EXPERTS = "routed_experts"
"""TrainBatch tensor of the rollout's routing: int [B, T, num_hidden_layers, top_k], token-position aligned."""


def _unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def decoder_routers(chunk: torch.nn.Module) -> list[tuple[int, Any]]:
    """(global 0-based layer index, TopKRouter) of each MoE decoder layer of a model chunk, in layer order."""
    model = _unwrap(chunk)
    decoder = getattr(model, "decoder", None)
    out = []
    for layer in getattr(decoder, "layers", []):
        router = getattr(getattr(layer, "mlp", None), "router", None)
        if router is not None:
            out.append((layer.layer_number - 1, router))
    return out


def fill_unrouted(routing: torch.Tensor) -> torch.Tensor:
    """-1 entries (positions the engine did not route, padding) -> experts 0..k-1 of that position (never read)."""
    k = routing.shape[-1]
    default = torch.arange(k, dtype=routing.dtype).expand_as(routing)
    return torch.where(routing < 0, default, routing)


def fit_length(routing: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[b, T, L, k] -> [b, seq_len, L, k]: cut, or pad with -1 (unrouted)."""
    b, t = routing.shape[:2]
    if t >= seq_len:
        return routing[:, :seq_len]
    pad = routing.new_full((b, seq_len - t, *routing.shape[2:]), -1)
    return torch.cat([routing, pad], dim=1)


class RouterReplayDriver:
    """Sets record / replay on the routers of one rank's model chunks, per micro-batch forward."""

    def __init__(self, chunks: list[torch.nn.Module], tp_group: Any, sequence_parallel: bool) -> None:
        self.routers = {id(chunk): decoder_routers(chunk) for chunk in chunks}
        for routers in self.routers.values():
            for _, router in routers:
                if router.router_replay is None:
                    raise RuntimeError("routing replay needs models built with moe_enable_routing_replay=True")
        self.tp_group = tp_group
        self.sequence_parallel = sequence_parallel

    def _local_tokens(self, routing: torch.Tensor) -> torch.Tensor:
        """[b, s, k] -> Megatron's router input order [s_local * b, k] (s-major; this TP rank's slice under SP)."""
        tokens = routing.transpose(0, 1)
        if self.sequence_parallel:
            tp, rank = self.tp_group.size(), self.tp_group.rank()
            tokens = tokens.chunk(tp, dim=0)[rank]
        return tokens.reshape(-1, routing.shape[-1]).long()

    def replay(self, chunk: torch.nn.Module, routing: torch.Tensor) -> None:
        """Make `chunk`'s next forward route by `routing` [b, s, num_layers, k] (global layer index)."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        routing = fill_unrouted(routing)
        for layer, router in self.routers[id(chunk)]:
            replay = router.router_replay
            replay.clear_indices()  # set_target_indices also queues for backward recompute: keep one entry
            replay.set_target_indices(self._local_tokens(routing[:, :, layer]))
            replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    def record(self, chunk: torch.nn.Module) -> None:
        """Make `chunk`'s next forward record the routing it computes."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        for _, router in self.routers[id(chunk)]:
            router.router_replay.clear_indices()
            router.router_replay.set_router_replay_action(RouterReplayAction.RECORD)

    def recorded(self, chunk: torch.nn.Module, batch: int, num_layers: int) -> torch.Tensor | None:
        """The routing `chunk`'s last forward recorded, as [b, s, num_layers, k] (-1 in layers not on this chunk),
        full sequence (gathered over TP under SP); None when the chunk has no MoE layer."""
        routers = self.routers[id(chunk)]
        if not routers:
            return None
        out = None
        for layer, router in routers:
            local = router.router_replay.get_recorded_indices()  # [s_local * b, k]
            k = local.shape[-1]
            local = local.reshape(-1, batch, k)  # [s_local, b, k]
            if self.sequence_parallel and self.tp_group.size() > 1:
                parts = [torch.empty_like(local) for _ in range(self.tp_group.size())]
                torch.distributed.all_gather(parts, local.contiguous(), group=self.tp_group)
                local = torch.cat(parts, dim=0)
            if out is None:
                out = torch.full((batch, local.shape[0], num_layers, k), -1, dtype=torch.int32)
            out[:, :, layer] = local.transpose(0, 1).to(torch.int32).cpu()
        return out

    def off(self) -> None:
        """Back to plain routing on every router of this rank (and drop held indices)."""
        for routers in self.routers.values():
            for _, router in routers:
                router.router_replay.clear_router_replay_action()
                router.router_replay.clear_indices()


def routing_tensor(routed: list[Any], lengths: list[int], num_layers: int, top_k: int) -> torch.Tensor:
    """Per-sample engine routing ([n_i, L, k] arrays, n_i <= length_i) -> int32 [B, max length, L, k], -1 padded."""
    out = torch.full((len(routed), max(lengths), num_layers, top_k), -1, dtype=torch.int32)
    for i, r in enumerate(routed):
        t = torch.tensor(r, dtype=torch.int32).reshape(-1, num_layers, top_k)  # a copy: engine arrays are read-only
        out[i, : t.shape[0]] = t
    return out


class ActorRouting:
    """A rank's routing-replay state across the calls of one RL step (see the module docstring for the modes).

    The actor brackets each policy forward pass with `begin(phase)` / `end()`, where phase is "logprobs" (the old-
    logprob pass) or "update"; its forward step calls `before(chunk, mb)` and `after(chunk, mb)` around each
    micro-batch forward. Samples are known by "sample_index" (their position in the controller's batch), which the
    actor adds before sharding, so R2 finds a sample's recorded routing whatever mini/micro-batch it lands in (the
    recorded routing is all-gathered over dp after the old-logprob pass: memory grows with the batch, int32 per token
    per local layer per k).
    """

    def __init__(self, mode: str, driver: RouterReplayDriver, num_layers: int, dp_group: Any) -> None:
        self.mode, self.driver, self.num_layers, self.dp_group = mode, driver, num_layers, dp_group
        self.action: str | None = None  # "replay" | "record" | None for the forward pass under way
        self.recorded: dict[int, torch.Tensor] = {}  # R2: sample index -> [s, L, k] (this rank's layers filled)

    def begin(self, phase: str) -> None:
        if self.mode == "R3":
            self.action = "replay"
        elif self.mode == "R2":
            self.action = "record" if phase == "logprobs" else "replay"
            if phase == "logprobs":
                self.recorded = {}

    def end(self) -> None:
        if self.action == "record" and self.dp_group.size() > 1:
            # The update shards each mini-batch over dp, so a sample may land on another dp rank than the one that
            # recorded it: every dp rank keeps the whole batch's routing (of its own layers: same pp/tp coordinates).
            parts: list[Any] = [None] * self.dp_group.size()
            torch.distributed.all_gather_object(parts, self.recorded, group=self.dp_group)
            self.recorded = {k: v for part in parts for k, v in part.items()}
        self.action = None
        self.driver.off()

    def before(self, chunk: torch.nn.Module, mb: Any) -> None:
        if self.action == "record":
            self.driver.record(chunk)
        elif self.action == "replay":
            self.driver.replay(chunk, self._target(mb))

    def after(self, chunk: torch.nn.Module, mb: Any) -> None:
        if self.action != "record":
            return
        got = self.driver.recorded(chunk, mb.tokens.shape[0], self.num_layers)
        if got is None:
            return
        for row, index in enumerate(mb.tensors["sample_index"].tolist()):
            held = self.recorded.get(index)
            # virtual stages of one rank hold different layers: merge them
            self.recorded[index] = got[row] if held is None else torch.where(got[row] >= 0, got[row], held)

    def _target(self, mb: Any) -> torch.Tensor:
        seq_len = mb.tokens.shape[1]
        if self.mode == "R3":
            if ROUTED_EXPERTS not in mb.tensors:
                raise ValueError(
                    "actor.router_replay_mode=R3: the batch carries no rollout routing ('routed_experts'); the "
                    "engines must be asked for return_routed_experts"
                )
            return fit_length(mb.tensors[ROUTED_EXPERTS], seq_len)
        missing = [i for i in mb.tensors["sample_index"].tolist() if i not in self.recorded]
        if missing:
            raise RuntimeError(f"actor.router_replay_mode=R2: no recorded routing for samples {missing[:5]}")
        rows = [self.recorded[i][None] for i in mb.tensors["sample_index"].tolist()]
        return torch.cat([fit_length(r, seq_len) for r in rows])


def capture_router_choices(chunks: list[torch.nn.Module], batch: int, num_layers: int) -> tuple[list[Any], dict]:
    """Forward hooks that record the experts each decoder router actually dispatched to (its routing_map output,
    after any replay), as int32 [b, s, num_layers, k] sorted ascending per token; for checks, not for training.
    Returns (hook handles, {layer: [s*b, k]}) - remove the handles when done."""
    captured: dict[int, torch.Tensor] = {}
    handles = []
    for chunk in chunks:
        for layer, router in decoder_routers(chunk):

            def hook(_module: Any, _inputs: Any, output: Any, layer: int = layer) -> None:
                routing_map = output[1]  # [tokens, experts] bool
                k = int(routing_map[0].sum())
                captured[layer] = routing_map.nonzero()[:, 1].reshape(-1, k).sort(dim=-1).values

            handles.append(router.register_forward_hook(hook))
    return handles, captured
