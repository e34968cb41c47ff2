"""Exact (lossless) acceptance of a point-mass draft (docs/design.md "Exact acceptance"): accept y_i with probability
pi_t(y_i | x, y_<i) (``log u_i <= lp_new_i``), and on rejection draw from pi_t without y_i. Every position's marginal
is then pi_t, so every response is a fresh sample of the current policy whatever the drafts, even drafts the policy
was trained on.

In spec-rl's own rollout the same rule runs as a walk of the policy's keyed samples down the trie of the group's drafts
(:mod:`spec_rl.acceptance.exact_walk`): the response is token for token what fresh keyed decoding gives, so scoring may
stop where it does not pay and be scored only where walks may go."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import Rule


@dataclass(frozen=True)
class Exact(Rule):
    name: ClassVar[str] = "exact"
    lossless: ClassVar[bool] = True
    excludes_rejected: ClassVar[bool] = True
    keyed_walk: ClassVar[bool] = True
    samples_policy: ClassVar[bool] = True

    def test(self, lp_new: torch.Tensor, lp_old: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        return torch.log(u.double()) <= lp_new.double()

    def kernel_switch(self) -> tuple[float, bool]:
        return 0.0, False
