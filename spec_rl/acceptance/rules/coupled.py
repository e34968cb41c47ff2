"""Coupled keys (docs/design.md "Coupled keys"): the exact walk of :mod:`.exact` with sampling keys that stay the same
from step to step. A slot's token at position i is the Gumbel-max sample argmax_y(log p(y) + G(uid, i, y)) with one
noise G for the whole run, so its draft is last epoch's policy decoded under the very noise the current policy is
decoded with now: where the policy's choice did not change, the walk keeps the draft token.

Each response is still an exact sample of the current policy (the noise is Gumbel whatever the policy), so no old
weights, stored distribution or correction is needed; what it shares with every reuse is that an epoch's response is
not independent of the last one (speculative sampling's residual draw couples them maximally, accepting 1 - TV(p, q)
of a position's mass; the Gumbel coupling accepts at least (1 - TV) / (1 + TV)). It is not vanilla's response
token for token: vanilla draws new keys every step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .exact import Exact


@dataclass(frozen=True)
class Coupled(Exact):
    name: ClassVar[str] = "coupled"
    lossless: ClassVar[bool] = False  # a sample of the policy, not vanilla's (its keys change every step)
    shared_keys: ClassVar[bool] = True
