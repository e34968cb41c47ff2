"""The trainer's records: one per training step (metrics.jsonl) and one per epoch (summary.json).

An epoch record sums its steps' counters and derives rates from the sums; held-out fields: :mod:`.heldout`."""

from __future__ import annotations

import json
from pathlib import Path

from ..acceptance.mode import RolloutMode
from ..rollout.reward_split import ORIGINS, origin_means
from .correction import WEIGHT_SUMS, weight_stats

#: One JSON line per training step, in each mode's folder of a run directory.
METRICS_FILE = "metrics.jsonl"

# Step fields summed into an epoch record: the rollout's counters and timings, then the trainer's.
SUMMED = (
    *("num_samples", "drafts_found", "draft_tokens", "accepted_tokens", "full_reuse_count", "tokens_generated"),
    *("drafts_dropped", "vanilla_tokens", "decode_steps", "tail_proposed", "tail_accepted", "decode_rows"),
    *("decode_positions",),
    *("scoring_seconds", "generation_seconds", "assembly_seconds"),
    *("reward_sum", "truncated", "train_seconds", "groups", "flat_groups"),
    *WEIGHT_SUMS,
    *(f"{kind}_{origin}" for origin in ORIGINS for kind in ("reward_sum", "count")),
)
# Step sums an epoch record keeps under their own name.
_KEPT = (
    *("vanilla_tokens", "draft_tokens", "drafts_found", "drafts_dropped", "scoring_seconds", "generation_seconds"),
    *("decode_steps",),
    *("tail_proposed", "tail_accepted", "decode_positions", "train_seconds", "groups", "flat_groups"),
    *WEIGHT_SUMS,
)


def mean_or_none(values: list) -> float | None:
    """The mean of the values that are not None; None if there is none."""
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def epoch_record(epoch: int, steps: list[dict], label: str, mode: RolloutMode) -> dict:
    """The record of one finished epoch (1-based) of run ``label`` from its step records."""
    tot = {k: sum(s.get(k, 0) for s in steps) for k in SUMMED}
    n = max(tot["num_samples"], 1)
    return {
        **mode.to_dict(),
        "mode": label,
        "epoch": epoch,
        "steps": len(steps),
        "samples": tot["num_samples"],
        "mean_reward": tot["reward_sum"] / n,
        **origin_means(tot),
        "generated_tokens": tot["tokens_generated"],
        "reused_tokens": tot["accepted_tokens"],
        **{k: tot[k] for k in _KEPT},
        "full_reuse_ratio": tot["full_reuse_count"] / n,
        "mean_verified_prefix": tot["accepted_tokens"] / tot["drafts_found"] if tot["drafts_found"] else 0.0,
        "mean_response_len": tot["vanilla_tokens"] / n,
        "truncated_frac": tot["truncated"] / n,
        "rollout_seconds": tot["scoring_seconds"] + tot["generation_seconds"] + tot["assembly_seconds"],
        "other_seconds": tot["assembly_seconds"],
        "longest_continuation": max((s.get("longest_continuation", 0) for s in steps), default=0),
        "mean_step_width": tot["decode_positions"] / tot["decode_rows"] if tot["decode_rows"] else None,
        # how far the policy moved on the tokens it reused (mean |lp_new - lp_old|, nats); None where the rule does
        # not measure it (the exact walk)
        "reused_drift": mean_or_none([s.get("reused_drift") for s in steps if s.get("drafts_found")]),
        # every group's rewards equal: every advantage is 0 and the policy did not change this epoch
        "no_signal": tot["groups"] > 0 and tot["flat_groups"] == tot["groups"],
        # importance weights pi_old / pi_behaviour of the response tokens (docs/design.md "Rollout correction")
        **weight_stats(steps),
    }


def no_signal_warning(label: str, record: dict) -> str:
    """The loud log line of an epoch without learning signal."""
    return (
        f"WARNING [{label}] epoch {record['epoch']}: no learning signal - all {record['groups']} groups have equal "
        f"rewards (mean reward {record['mean_reward']:.3f}), so every advantage is 0 and the policy did not change. "
        "Check the reward against the responses (prompt format, chat template, answer extraction) or use a reward "
        "the model can earn (--reward format or math+format)"
    )


def read_step_metrics(run_dir: str | Path, mode: str) -> list[dict]:
    """The step records of ``run_dir/mode/metrics.jsonl`` in order ([] without the file); a torn line is skipped."""
    path = Path(run_dir) / mode / METRICS_FILE
    if not path.is_file():
        return []
    steps = []
    for line in path.read_text().splitlines():
        try:
            steps.append(json.loads(line))
        except ValueError:
            continue
    return steps
