"""The RL loop's state: everything that must survive a restart for the run to continue as if it never stopped.

    state = LoopState()                  # a new run
    state.step, state.weight_version     # last completed step, the engines' weight version
    state.to_dict() / LoopState.from_dict(d)   # plain JSON-able data, stored in the training checkpoint

Model, optimizer and RNG states live with the workers (they are saved through Megatron's dist_checkpointing); this
object holds what the single controller owns: the step, the data position, the weight version, controller states
(e.g. an adaptive KL controller) and the metric history the closing summary is computed from.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class LoopState:
    """The controller's part of a training checkpoint."""

    step: int = 0  #: last completed RL step (0 before the first)
    weight_version: int = 1  #: the version the engines serve (1 = the initial weights)
    loader: dict[str, Any] = field(default_factory=dict)  #: PromptLoader.state_dict() after the last step's batch
    controllers: dict[str, Any] = field(default_factory=dict)  #: named controller states (KL controller ...)
    rewards: list[float] = field(default_factory=list)  #: critic/score/mean per completed step (the summary's history)
    seconds: float = 0.0  #: wall-clock seconds of the completed steps (a resumed run keeps counting)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LoopState:
        """Refuses unknown or missing keys by name (a state written by another version of this code)."""
        names = set(cls.__dataclass_fields__)
        unknown, missing = set(data) - names, names - set(data)
        if unknown or missing:
            raise ValueError(f"loop state: unknown keys {sorted(unknown)}, missing keys {sorted(missing)}")
        return cls(**data)
