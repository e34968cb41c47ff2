"""The rollout reward split by where each response came from: reused whole, partly reused, fresh.

Under lenient reuse the mean rollout reward is not the reward of fresh samples of the policy: a draft
survives the acceptance test more often when the policy still likes it, and the policy has learnt to
like responses that were rewarded, so responses reused whole lean towards ones that were already
correct (measured with TRL: the logged reward exceeded a fresh-sample reward by ~0.07 under SPEC-RL,
~0.01 for vanilla; on the demo at epoch 5, rollout vs held-out reward: SPEC-RL 0.430 vs 0.363, vanilla
0.398 vs 0.410). Reporting the reward per origin shows that bias; the number to compare runs on is the
held-out reward of fresh samples (:func:`spec_rl.tasks.evaluation.evaluate_heldout`). Under exact acceptance
every response is distributed as a fresh sample, so the mean is unbiased though the origins differ.

Origins (n = rejection index, the verified-prefix length; docs/design.md "The rule"):

* ``reused_whole``: the whole draft was accepted (n equals the response length, nothing generated);
* ``partly_reused``: 0 < n < the draft length (a verified prefix, then generation);
* ``fresh``: no draft, or n = 0 (everything generated).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["ORIGINS", "origin_means", "origin_sums", "response_origins"]

ORIGINS = ("reused_whole", "partly_reused", "fresh")


def response_origins(result) -> list[str]:
    """The origin of each response of a :class:`~spec_rl.rollout.types.RolloutResult` (one of :data:`ORIGINS`).

    A response is reused whole exactly when nothing follows its verified prefix: at a rejection the
    token at n is appended, so a partly reused response is longer than n.
    """
    out = []
    for found, n, resp in zip(result.draft_found, result.verified_prefix_len, result.response_ids):
        if not found or n == 0:
            out.append("fresh")
        else:
            out.append("reused_whole" if n == len(resp) else "partly_reused")
    return out


def origin_sums(origins: Sequence[str], rewards: Sequence[float]) -> dict[str, float | int]:
    """``reward_sum_<origin>`` (float) and ``count_<origin>`` (int) for every origin; NaN rewards are skipped.

    Sums add up over steps and processes; :func:`origin_means` turns them into means.

    Raises:
        ValueError: ``origins`` and ``rewards`` differ in length, or an unknown origin.
    """
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
    """``reward_<origin>`` (mean reward, None without a response of that origin) and ``count_<origin>``.

    ``sums`` holds the keys of :func:`origin_sums` (missing keys count as 0). Weighted by the counts,
    the three means give back the mean rollout reward.
    """
    out: dict[str, float | int | None] = {}
    for name in ORIGINS:
        count = int(sums.get(f"count_{name}", 0))
        out[f"reward_{name}"] = float(sums.get(f"reward_sum_{name}", 0.0)) / count if count else None
        out[f"count_{name}"] = count
    return out
