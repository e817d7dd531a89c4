"""Direct preference optimisation: the pair losses as pure torch functions, and the registry the config checks.

    sequence logprobs (policy and frozen reference, chosen and rejected)
      -> implicit rewards  r = beta * (log pi(y|x) - log ref(y|x))
      -> logits = (log pi_c - log ref_c) - (log pi_r - log ref_r)
      -> sigmoid: -log sigmoid(beta * logits)               (DPO, Rafailov et al. 2023)
         ipo:     (logits - 1 / (2 * beta))^2               (IPO, Azar et al. 2023; on mean token logprobs)

Inputs are sequence-level [pairs]: the sum of a response's token logprobs, or for IPO their mean over the response
(the IPO paper's and TRL's choice: the squared target 1/(2*beta) then does not depend on the response length).
`DPO_LOSSES[name].length_normalized` says which one a loss wants; the actor computes it accordingly.

    out = dpo_loss("sigmoid", pc, pr, rc, rr, beta=0.1)      # out.losses [pairs], out.metrics
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class DPOOutput:
    """Per-pair losses and the implicit rewards behind them."""

    losses: torch.Tensor  # [pairs]
    chosen_rewards: torch.Tensor  # [pairs], detached: beta * (log pi_c - log ref_c)
    rejected_rewards: torch.Tensor  # [pairs], detached

    def metrics(self) -> dict[str, torch.Tensor]:
        """Sums over the pairs (the caller divides by the pair count): TRL's reward metric names."""
        margins = self.chosen_rewards - self.rejected_rewards
        return {
            "dpo/loss": self.losses.detach().sum(),
            "dpo/rewards_chosen": self.chosen_rewards.sum(),
            "dpo/rewards_rejected": self.rejected_rewards.sum(),
            "dpo/rewards_margin": margins.sum(),
            "dpo/rewards_accuracy": (margins > 0).float().sum(),
        }


def sigmoid_loss(logits: torch.Tensor, beta: float) -> torch.Tensor:
    """DPO: -log sigmoid(beta * logits), per pair."""
    return -F.logsigmoid(beta * logits)


def ipo_loss(logits: torch.Tensor, beta: float) -> torch.Tensor:
    """IPO: squared distance of the log-ratio margin from 1/(2*beta), per pair (beta plays the role of tau)."""
    return (logits - 1.0 / (2.0 * beta)) ** 2


@dataclass(frozen=True)
class DPOLoss:
    """A registered preference loss: the per-pair function of the log-ratio margin, and the logprob it expects."""

    fn: Callable[[torch.Tensor, float], torch.Tensor]
    length_normalized: bool  # True: sequence logprob = mean over response tokens; False: sum


DPO_LOSSES: dict[str, DPOLoss] = {
    "sigmoid": DPOLoss(sigmoid_loss, length_normalized=False),
    "ipo": DPOLoss(ipo_loss, length_normalized=True),
}
"""The registry `dpo.loss_type` is validated against."""


def get_dpo_loss(name: str) -> DPOLoss:
    """Look a loss up by name; the error lists the registered ones."""
    if name not in DPO_LOSSES:
        raise ValueError(f"unknown DPO loss {name!r}; expected one of {sorted(DPO_LOSSES)}")
    return DPO_LOSSES[name]


def dpo_loss(
    name: str,
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float,
) -> DPOOutput:
    """Per-pair preference loss `name` from sequence logprobs [pairs] (see the module docstring for which kind)."""
    chosen_ratio = policy_chosen - ref_chosen
    rejected_ratio = policy_rejected - ref_rejected
    losses = get_dpo_loss(name).fn(chosen_ratio - rejected_ratio, beta)
    return DPOOutput(
        losses=losses,
        chosen_rewards=(beta * chosen_ratio).detach(),
        rejected_rewards=(beta * rejected_ratio).detach(),
    )


def sequence_logprobs(token_logprobs: torch.Tensor, mask: torch.Tensor, length_normalized: bool) -> torch.Tensor:
    """[B, R] token logprobs -> [B]: their masked sum, or their masked mean when `length_normalized`."""
    total = (token_logprobs * mask).sum(-1)
    return total / mask.sum(-1).clamp(min=1.0) if length_normalized else total
