"""The rollout reward split by origin of each response (n: rejection index): ``reused_whole``, ``partly_reused`` (0 < n
< draft length), ``fresh`` (no draft or n = 0). Under lenient reuse, drafts the policy still likes survive more often,
so the mean rollout reward is biased: compare runs on held-out fresh samples (``evaluate_heldout``)."""

from __future__ import annotations

import math
from collections.abc import Sequence

ORIGINS = ("reused_whole", "partly_reused", "fresh")


def response_origins(result) -> list[str]:
    """The origin of each response of a :class:`~spec_rl.rollout.types.RolloutResult`."""
    return [
        "fresh" if not found or n == 0 else "reused_whole" if n == len(resp) else "partly_reused"
        for found, n, resp in zip(result.draft_found, result.verified_prefix_len, result.response_ids)
    ]


def origin_sums(origins: Sequence[str], rewards: Sequence[float]) -> dict[str, float | int]:
    """``reward_sum_<origin>``, ``count_<origin>``, NaN skipped; ValueError for unequal lengths or an unknown origin."""
    if len(origins) != len(rewards):
        raise ValueError(f"{len(origins)} origins but {len(rewards)} rewards; pass one of each per response")
    sums: dict[str, float | int] = {}
    for name in ORIGINS:
        sums[f"reward_sum_{name}"], sums[f"count_{name}"] = 0.0, 0
    for origin, reward in zip(origins, rewards):
        if origin not in ORIGINS:
            raise ValueError(f"unknown origin {origin!r}; expected one of {ORIGINS}")
        if not math.isnan(float(reward)):
            sums[f"reward_sum_{origin}"] += float(reward)
            sums[f"count_{origin}"] += 1
    return sums


def origin_means(sums: dict) -> dict[str, float | int | None]:
    """``reward_<origin>`` (None without responses) and ``count_<origin>`` from :func:`origin_sums`' keys."""
    out: dict[str, float | int | None] = {}
    for name in ORIGINS:
        count = int(sums.get(f"count_{name}", 0))
        out[f"reward_{name}"] = float(sums.get(f"reward_sum_{name}", 0.0)) / count if count else None
        out[f"count_{name}"] = count
    return out
