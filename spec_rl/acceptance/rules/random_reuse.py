"""The random-reuse ablation (SPEC-RL Table 2): the rejection index is uniform over {0, .., R} whatever the scores;
the token at n comes from pi_t (it is not a rejection)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ...sampling.philox import STREAM_RANDOM_REUSE, philox_uniform
from ..reference import lengths_mask
from .base import Rule


@dataclass(frozen=True)
class RandomReuse(Rule):
    name: ClassVar[str] = "random"

    def decide(self, lp_new, lp_old, lengths, seed, uids) -> tuple[torch.Tensor, torch.Tensor]:
        n = random_reuse_index(seed, uids, lengths)
        return lengths_mask(n, lp_new.shape[1]), n

    def log_keep(self, lp_new, lp_old, lengths) -> torch.Tensor:
        """log P(n > i | n > i - 1) = log((R - i) / (R - i + 1)) for n uniform over {0, .., R}."""
        left = lengths.to(lp_new.device).unsqueeze(1).double() - torch.arange(lp_new.shape[1], device=lp_new.device)
        return torch.log(left.clamp(min=0) / (left + 1).clamp(min=1))


def random_reuse_index(seed: int, uids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """n = min(floor(u * (length + 1)), length) with one u per sample from stream 1."""
    u = philox_uniform(seed, uids, torch.zeros_like(uids), stream=STREAM_RANDOM_REUSE).double()
    lengths = lengths.to(torch.int64)
    return torch.minimum(torch.floor(u * (lengths.double() + 1)).to(torch.int64), lengths)
