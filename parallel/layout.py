"""The 5D parallel layout: sizes, validation, and rank <-> coordinates in Megatron's order.

A `ParallelLayout` names tp/pp/cp/ep/etp/vpp (and, optionally, uneven first/last pipeline stages); dp is derived
from the world size. Dense layers live on the grid
tp x cp x dp x pp and expert layers on etp x ep x edp x pp (the same ranks, folded differently; Megatron's
"MoE parallel folding"). Ranks are numbered in Megatron's default order "tp-cp-ep-dp-pp": tp varies fastest, pp
slowest, so that a TP group sits inside one node.

Everything here is pure arithmetic: a 32-node layout can be checked on a laptop.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


class LayoutError(ValueError):
    """A layout that cannot run: the message names the sizes that disagree."""


@dataclass(frozen=True)
class ModelShape:
    """The model sizes a layout must divide."""

    num_layers: int
    num_attention_heads: int
    num_query_groups: int
    vocab_size: int = 0
    num_experts: int = 0
    ffn_hidden_size: int = 0
    moe_ffn_hidden_size: int = 0


@dataclass(frozen=True)
class RankCoords:
    """Where one rank sits on the dense grid and on the expert grid."""

    rank: int
    tp_rank: int
    cp_rank: int
    dp_rank: int
    pp_rank: int
    etp_rank: int
    ep_rank: int
    edp_rank: int


@dataclass(frozen=True)
class ParallelLayout:
    """Parallel sizes of one Megatron model (actor, ref or critic).

    Attributes:
        tp: tensor-parallel size (attention and dense MLP weights split across ranks).
        pp: pipeline-parallel size (layers split into stages).
        cp: context-parallel size (sequence split across ranks; GPU only, it lives in TE's attention).
        ep: expert-parallel size (experts distributed across ranks).
        etp: expert tensor-parallel size (each expert's weights split); None means equal to tp, as in Megatron.
        vpp: virtual pipeline stages per pipeline rank (interleaved schedule); None or 1 means off.
        sequence_parallel: shard activations along the sequence inside TP regions (required for MoE with tp > 1).
        first_stage_layers: decoder layers on pipeline rank 0, all its virtual stages together (Megatron's
            num_layers_in_first_pipeline_stage); None splits evenly. The other stages share what is left equally.
        last_stage_layers: decoder layers on the last pipeline rank (num_layers_in_last_pipeline_stage); None splits
            evenly. MTP layers, when the model has them, sit on the last stage on top of these.
    """

    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int | None = None
    vpp: int | None = None
    sequence_parallel: bool = False
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "cp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise LayoutError(f"layout.{name} must be a positive integer, got {value!r}")
        for name in ("etp", "vpp", "first_stage_layers", "last_stage_layers"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise LayoutError(f"layout.{name} must be a positive integer or null, got {value!r}")
        if self.vpp is not None and self.vpp > 1 and self.pp == 1:
            raise LayoutError(f"layout.vpp={self.vpp} needs pp > 1 (virtual stages interleave pipeline ranks)")
        for name in ("first_stage_layers", "last_stage_layers"):
            value = getattr(self, name)
            if value is not None and self.pp == 1:
                raise LayoutError(f"layout.{name}={value} needs pp > 1 (it sizes one of several pipeline stages)")

    @property
    def uneven_stages(self) -> bool:
        """Whether the first or the last pipeline stage has its own layer count."""
        return self.first_stage_layers is not None or self.last_stage_layers is not None

    @property
    def expert_tp(self) -> int:
        """Expert tensor-parallel size (etp, defaulting to tp)."""
        return self.tp if self.etp is None else self.etp

    @property
    def virtual_stages(self) -> int:
        """Virtual pipeline stages per pipeline rank (1 when interleaving is off)."""
        return self.vpp or 1

    @property
    def model_parallel_size(self) -> int:
        """Ranks holding one copy of the dense weights: tp x cp x pp."""
        return self.tp * self.cp * self.pp

    def dp(self, world_size: int) -> int:
        """Data-parallel size for the dense layers on `world_size` ranks."""
        self.check_world_size(world_size)
        return world_size // self.model_parallel_size

    def expert_dp(self, world_size: int) -> int:
        """Data-parallel size of the expert layers: world / (etp x ep x pp)."""
        self.check_world_size(world_size)
        return world_size // (self.expert_tp * self.ep * self.pp)

    def check_world_size(self, world_size: int) -> None:
        """Refuse a world size the dense or the expert grid does not divide."""
        if world_size < 1:
            raise LayoutError(f"world size must be >= 1, got {world_size}")
        if world_size % self.model_parallel_size:
            raise LayoutError(
                f"world size {world_size} is not divisible by tp*cp*pp = {self.tp}*{self.cp}*{self.pp} "
                f"= {self.model_parallel_size}"
            )
        expert_mp = self.expert_tp * self.ep * self.pp
        if world_size % expert_mp:
            raise LayoutError(
                f"world size {world_size} is not divisible by etp*ep*pp = {self.expert_tp}*{self.ep}*{self.pp} "
                f"= {expert_mp}"
            )

    def validate(self, world_size: int, shape: ModelShape | None = None) -> None:
        """Check the layout against the world size and the model's shape; raise LayoutError naming the sizes."""
        self.check_world_size(world_size)
        if shape is None:
            return
        problems: list[str] = []
        if shape.num_attention_heads % self.tp:
            problems.append(f"num_attention_heads={shape.num_attention_heads} is not divisible by tp={self.tp}")
        if shape.num_query_groups % self.tp:
            problems.append(f"num_query_groups (KV heads)={shape.num_query_groups} is not divisible by tp={self.tp}")
        if shape.ffn_hidden_size and shape.ffn_hidden_size % self.tp:
            problems.append(f"ffn_hidden_size={shape.ffn_hidden_size} is not divisible by tp={self.tp}")
        problems += self.stage_split_problems(shape.num_layers)
        if shape.num_experts:
            if shape.num_experts % self.ep:
                problems.append(f"num_experts={shape.num_experts} is not divisible by ep={self.ep}")
            if shape.moe_ffn_hidden_size and shape.moe_ffn_hidden_size % self.expert_tp:
                problems.append(
                    f"moe_ffn_hidden_size={shape.moe_ffn_hidden_size} is not divisible by etp={self.expert_tp}"
                )
            if self.tp > 1 and not self.sequence_parallel:
                problems.append(f"MoE with tp={self.tp} needs sequence_parallel=true (Megatron requires it)")
        elif self.ep > 1:
            problems.append(f"ep={self.ep} but the model has no experts")
        if self.cp > 1 and self.tp > 1 and not self.sequence_parallel and shape.num_experts:
            problems.append("cp > 1 with MoE and tp > 1 needs sequence_parallel=true")
        if problems:
            raise LayoutError(f"layout {self.describe()} does not fit the model: " + "; ".join(problems))

    def stage_split_problems(self, num_layers: int) -> list[str]:
        """Why `num_layers` decoder layers cannot be split over this layout's pipeline stages (empty when they can).

        Even stages: num_layers divisible by pp*vpp. Uneven stages follow TransformerConfig.__post_init__ of
        megatron-core 0.16.1: the first/last counts are positive and divisible by vpp; the layers left over are
        divisible by the middle stages (pp minus the stages given a count), each middle stage's share is divisible
        by vpp, and there are middle layers exactly when there are middle stages (pp=2 with both counts set: they
        must add up to num_layers). Refused here although Megatron's config accepts them: first+last > num_layers
        when the negative remainder happens to divide, and pp=2 with both counts under vpp (its layer-offset
        arithmetic then divides by zero middle stages).
        """
        vpp = self.virtual_stages
        if not self.uneven_stages:
            stages = self.pp * vpp
            problems = []
            if num_layers % stages:
                problems.append(
                    f"num_layers={num_layers} is not divisible by pp*vpp = {self.pp}*{vpp} = {stages} "
                    "(first_stage_layers / last_stage_layers can give the outer stages their own counts)"
                )
            if num_layers < stages:
                problems.append(f"num_layers={num_layers} is smaller than pp*vpp={stages}")
            return problems
        given = {"first_stage_layers": self.first_stage_layers, "last_stage_layers": self.last_stage_layers}
        given = {name: value for name, value in given.items() if value is not None}
        named = " + ".join(f"{name}={value}" for name, value in given.items())
        problems = [
            f"{name}={value} is not divisible by vpp={vpp} (each virtual stage of that pipeline rank gets an equal "
            "share)"
            for name, value in given.items()
            if value % vpp
        ]
        middle_layers = num_layers - sum(given.values())
        middle_stages = self.pp - len(given)
        if middle_stages == 0:
            if middle_layers:
                problems.append(f"{named} = {sum(given.values())} must equal num_layers={num_layers} with pp=2")
            if vpp > 1:
                # megatron-core 0.16.1's get_transformer_layer_offset divides by the middle stage count under vpp.
                problems.append(
                    f"{named} with pp=2 and vpp={vpp} leaves no middle stage, which Megatron cannot place (its layer "
                    "offset divides by the middle stage count); give first_stage_layers only"
                )
        elif middle_layers < middle_stages:
            problems.append(
                f"num_layers={num_layers} minus {named} leaves {middle_layers} layers for {middle_stages} middle "
                f"pipeline stage(s) of pp={self.pp}; each stage needs at least one"
            )
        elif middle_layers % middle_stages:
            problems.append(
                f"num_layers={num_layers} minus {named} leaves {middle_layers} layers, not divisible by the "
                f"{middle_stages} middle pipeline stage(s) of pp={self.pp}"
            )
        elif (middle_layers // middle_stages) % vpp:
            problems.append(
                f"each of the {middle_stages} middle pipeline stage(s) of pp={self.pp} gets "
                f"{middle_layers // middle_stages} layers (num_layers={num_layers} minus {named}), not divisible by "
                f"vpp={vpp}"
            )
        return problems

    def layers_per_pp_rank(self, num_layers: int) -> list[int]:
        """Decoder layers held by each pipeline rank (its virtual stages together); LayoutError if they do not split."""
        if not self.uneven_stages:
            return [num_layers // (self.pp * self.virtual_stages) * self.virtual_stages] * self.pp
        problems = self.stage_split_problems(num_layers)
        if problems:
            raise LayoutError(f"layout {self.describe()} cannot split {num_layers} layers: " + "; ".join(problems))
        counted = (self.first_stage_layers is not None) + (self.last_stage_layers is not None)
        middle = num_layers - (self.first_stage_layers or 0) - (self.last_stage_layers or 0)
        per_rank = [middle // (self.pp - counted) if self.pp > counted else 0] * self.pp
        if self.first_stage_layers is not None:
            per_rank[0] = self.first_stage_layers
        if self.last_stage_layers is not None:
            per_rank[-1] = self.last_stage_layers
        return per_rank

    def coords(self, rank: int, world_size: int) -> RankCoords:
        """The coordinates of `rank`, in Megatron's order tp-cp-ep-dp-pp (tp fastest)."""
        if not 0 <= rank < world_size:
            raise LayoutError(f"rank {rank} is outside world size {world_size}")
        dp, edp = self.dp(world_size), self.expert_dp(world_size)
        tp_rank, rest = rank % self.tp, rank // self.tp
        cp_rank, rest = rest % self.cp, rest // self.cp
        dp_rank, pp_rank = rest % dp, rest // dp
        etp_rank, rest = rank % self.expert_tp, rank // self.expert_tp
        ep_rank, rest = rest % self.ep, rest // self.ep
        edp_rank = rest % edp
        return RankCoords(rank, tp_rank, cp_rank, dp_rank, pp_rank, etp_rank, ep_rank, edp_rank)

    def rank_of(
        self, world_size: int, *, tp_rank: int = 0, cp_rank: int = 0, dp_rank: int = 0, pp_rank: int = 0
    ) -> int:
        """The dense-grid rank at the given coordinates (inverse of `coords`)."""
        dp = self.dp(world_size)
        return tp_rank + self.tp * (cp_rank + self.cp * (dp_rank + dp * pp_rank))

    def group_ranks(self, axis: str, world_size: int) -> list[list[int]]:
        """All groups along one mesh axis: lists of ranks that differ only in that coordinate.

        `axis` is one of tp, cp, dp, pp (dense grid) or etp, ep, edp (expert grid).
        """
        dense = {"tp", "cp", "dp", "pp"}
        expert = {"etp", "ep", "edp"}
        if axis not in dense | expert:
            raise LayoutError(f"unknown axis {axis!r}; expected one of {sorted(dense | expert)}")
        grid = ("tp", "cp", "dp", "pp") if axis in dense else ("etp", "ep", "edp", "pp")
        names = [f"{name}_rank" for name in grid]
        keyed: dict[tuple, list[int]] = {}
        for rank in range(world_size):
            c = dataclasses.asdict(self.coords(rank, world_size))
            key = tuple(c[n] for n in names if n != f"{axis}_rank")
            keyed.setdefault(key, []).append(rank)
        return sorted(keyed.values())

    def pp_stage_layers(self, num_layers: int) -> list[list[int]]:
        """Global layer ids held by each (pp_rank, virtual stage), in Megatron's interleaved assignment.

        Returns a list indexed by pp_rank * vpp + vstage. Layers are dealt out in rounds, one round per virtual stage:
        round v gives pp rank 0, 1, ..., pp-1 in turn its share for virtual stage v (its layer count / vpp), so with
        even stages virtual stage v of pp rank p holds chunk v * pp + p. This is the order of megatron-core's
        get_transformer_layer_offset, uneven first/last stages included.
        """
        vpp = self.virtual_stages
        per_vstage = [count // vpp for count in self.layers_per_pp_rank(num_layers)]
        out: list[list[int]] = [[] for _ in range(self.pp * vpp)]
        next_layer = 0
        for vstage in range(vpp):
            for pp_rank, count in enumerate(per_vstage):
                out[pp_rank * vpp + vstage] = list(range(next_layer, next_layer + count))
                next_layer += count
        return out

    def describe(self) -> str:
        """Short human form, e.g. 'tp2 pp1 cp1 ep2 etp1', or 'tp1 pp4 cp1 ep8 etp1 first16 last15' (layers on the
        first and last pipeline stages) with uneven stages."""
        vpp = f" vpp{self.vpp}" if self.vpp else ""
        first = f" first{self.first_stage_layers}" if self.first_stage_layers is not None else ""
        last = f" last{self.last_stage_layers}" if self.last_stage_layers is not None else ""
        return f"tp{self.tp} pp{self.pp} cp{self.cp} ep{self.ep} etp{self.expert_tp}{vpp}{first}{last}"
