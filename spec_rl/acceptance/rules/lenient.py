"""The paper's lenient rule (SPEC-RL Sec. 3, Eq. 4; docs/design.md "The rule"): accept draft token i iff
``log u_i <= log l + lp_new_i - lp_old_i``. l = 1 is speculative decoding with the old policy as the proposal; l > 1
accepts more (the paper's defaults, App. A.1: e^0.5 GRPO, e^0.3 PPO, e^0.15 DAPO); inf keeps every draft, 0 none.

The token at a rejection comes from pi_t ("policy", the paper), from pi_t without the rejected draft token,
renormalised ("without-draft"; needs l >= 1: below it the residual keeps the rejected token), or from the residual
max(0, pi_t - q) renormalised, q the draft's own policy at that position ("residual"; l = 1 only: speculative
sampling, so a response is distributed as pi_t when the draft did not shape pi_t; the rollout keeps q's weights,
:mod:`spec_rl.rollout.old_policy`)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from ...util.validation import check_choice, check_real
from .base import Rule

#: The paper's lenience per RL algorithm (App. A.1); GRPO's is the default.
LENIENCE_DEFAULTS = {"grpo": math.exp(0.5), "ppo": math.exp(0.3), "dapo": math.exp(0.15)}
LENIENCE = LENIENCE_DEFAULTS["grpo"]
REJECTION_DRAWS = ("policy", "without-draft", "residual")


@dataclass(frozen=True)
class Lenient(Rule):
    """``lenience``: l >= 0 (inf allowed); ``rejection_draw``: one of :data:`REJECTION_DRAWS`. TypeError for a
    non-number l; ValueError for l < 0 or NaN, an unknown draw, the without-draft draw with l < 1 or the residual draw
    with l != 1."""

    name: ClassVar[str] = "lenient"
    lenience: float = LENIENCE
    rejection_draw: str = "policy"

    def __post_init__(self) -> None:
        hint = " (1 is vanilla speculative decoding, inf reuses every draft, 0 none)"
        object.__setattr__(self, "lenience", check_real("lenience", self.lenience, low=0.0, finite=False, hint=hint))
        check_choice("rejection_draw", self.rejection_draw, REJECTION_DRAWS)
        if self.rejection_draw == "without-draft" and self.lenience < 1:
            raise ValueError(
                f"rejection_draw 'without-draft' needs lenience >= 1, got {self.lenience:g}: "
                "below 1 the residual keeps the rejected token"
            )
        if self.rejection_draw == "residual" and self.lenience != 1:
            raise ValueError(
                f"rejection_draw 'residual' needs lenience 1, got {self.lenience:g}: the residual max(0, p - q) "
                "completes speculative sampling's test min(1, p/q) only (use the policy or without-draft draw)"
            )

    @property
    def excludes_rejected(self) -> bool:  # type: ignore[override]
        return self.rejection_draw == "without-draft"

    @property
    def needs_old_policy(self) -> bool:  # type: ignore[override]
        return self.rejection_draw == "residual"

    @property
    def samples_policy(self) -> bool:  # type: ignore[override]
        return self.needs_old_policy

    @property
    def log_lenience(self) -> float:
        return math.log(self.lenience) if self.lenience > 0 else -math.inf

    def verified_by(self) -> Lenient:
        return dataclasses.replace(self, rejection_draw="policy") if self.needs_old_policy else self

    def log_keep(self, lp_new, lp_old, lengths) -> torch.Tensor:
        """log min(1, l p / q): the test keeps y with that probability."""
        if self.log_lenience == math.inf:
            return torch.zeros_like(lp_new)
        return (self.log_lenience + lp_new - lp_old).clamp(max=0.0)

    def test(self, lp_new: torch.Tensor, lp_old: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        return lenient_test(lp_new, lp_old, u, self.log_lenience)

    def kernel_switch(self) -> tuple[float, bool]:
        return self.log_lenience, True

    def describe(self) -> str:
        return f"lenient acceptance at l = {self.lenience:.4g}, rejection draw {self.rejection_draw}"

    def note(self) -> str:
        if self.needs_old_policy:
            how = (
                "from the residual max(0, p - q) of the draft's own policy q (exact speculative sampling: a response "
                "is a sample of the current policy when its draft did not shape that policy)"
            )
        elif self.excludes_rejected:
            how = (
                "from the current policy without the rejected draft token (renormalised): at l = 1 exact speculative "
                "sampling when a choice has two tokens, not exactly on-policy in general "
                "(the draft's whole old distribution is not stored)"
            )
        else:
            how = (
                "from the current policy (the paper's rule), not from the residual of exact speculative sampling, so "
                "even l = 1 is not exactly on-policy"
            )
        return (
            f"Lenient acceptance draws the token at a rejection {how}; exact acceptance is on-policy (paper Sec. 3; "
            "docs/design.md, 'The rule' and 'Exact acceptance')."
        )


def lenient_test(lp_new: torch.Tensor, lp_old: torch.Tensor, u: torch.Tensor, log_lenience: float) -> torch.Tensor:
    """``log u <= log l + lp_new - lp_old`` in float64, never exponentiating the ratio; log l = +inf accepts all, -inf
    rejects all; lp_new = -inf is rejected for any finite l (a NaN margin compares False)."""
    if log_lenience == math.inf:
        return torch.ones_like(lp_new, dtype=torch.bool)
    if log_lenience == -math.inf:
        return torch.zeros_like(lp_new, dtype=torch.bool)
    return torch.log(u.double()) <= lp_new.double() - lp_old.double() + log_lenience
