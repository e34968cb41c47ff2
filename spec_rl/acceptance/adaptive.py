"""Adaptive lenience (``lenience="auto"``): choose l every step from how far the policy drifted.

The paper fixes l per run (e^0.5 for GRPO) and names choosing it adaptively as future work
(Sec. 5). A larger l reuses more, but the tokens it additionally accepts are those whose log-prob
moved most since they were sampled, i.e. the reused part of the batch becomes more off-policy.
``--lenience auto`` bounds exactly that: each step it picks the largest log l on a grid (0 .. 2 in
steps of 0.05) for which the mean drift |lp_new - lp_old| over the tokens that would be accepted
stays within ``target_drift`` nats. Early in training, when the policy barely moves, that allows a
lenient l; when an update changes the policy a lot, l falls back towards 1.

The decisions are the lenient rule's at the chosen l, with the same keyed uniforms (the uniforms do
not depend on l), so for a given l they equal what a fixed-l run would decide.
"""

from __future__ import annotations

import torch

from ..sampling.philox import STREAM_ACCEPT, philox_uniform
from .reference import lengths_mask

#: log l candidates: 0 (vanilla speculative decoding) to 2, in steps of 0.05.
AUTO_GRID = tuple(round(0.05 * i, 2) for i in range(41))
#: Default bound on the mean |lp_new - lp_old| (nats) of the accepted draft tokens. Calibrated on the
#: embedded task's sweep (benchmarks/RESULTS.md, "Learning"): there fixed l gave a drift of 0.009-0.011
#: (l=1), 0.013-0.014 (e^0.5), 0.017 (e^1), 0.022-0.024 (e^2), so 0.014 starts near the paper's GRPO
#: setting and lowers l when an update moves the policy more. The first default, 0.1, never bound: auto
#: ran at the grid's top (e^2) and lost 0.105 held-out reward.
DEFAULT_TARGET_DRIFT = 0.014


def accepted_drift(lp_new: torch.Tensor, lp_old: torch.Tensor, lengths: torch.Tensor, accepted_len: torch.Tensor) -> float:
    """Mean |lp_new - lp_old| (nats) over the accepted tokens (0 when none): [B, R], [B, R], [B], [B]."""
    mask = lengths_mask(torch.minimum(accepted_len, lengths), lp_new.shape[1])
    if not bool(mask.any()):
        return 0.0
    return float((lp_new.double() - lp_old.double()).abs()[mask].mean())


def choose_log_lenience(
    lp_new: torch.Tensor,
    lp_old: torch.Tensor,
    lengths: torch.Tensor,
    uids: torch.Tensor,
    seed: int,
    target_drift: float = DEFAULT_TARGET_DRIFT,
    grid: tuple[float, ...] = AUTO_GRID,
) -> float:
    """The largest log l in ``grid`` whose accepted tokens drift by at most ``target_drift`` nats on average.

    Parameters
    ----------
    lp_new, lp_old : [B, R] float tensors
        The drafts' log-probs under the current policy and when they were stored (valid up to lengths).
    lengths : [B] int64
    uids : [B] int64 (the uniforms' keys) and ``seed``: the step's acceptance seed.
    target_drift : float, > 0
    grid : increasing log l candidates (the first is returned when none qualifies).

    Returns
    -------
    float: the chosen log l.

    Raises
    ------
    ValueError: ``target_drift`` not a finite number > 0, or an empty grid.
    """
    if not (isinstance(target_drift, (int, float)) and 0 < float(target_drift) < float("inf")):
        raise ValueError(f"target_drift must be a finite number > 0 (nats), got {target_drift!r}")
    if not grid:
        raise ValueError("grid must hold at least one log-lenience value")
    max_len = lp_new.shape[1]
    if max_len == 0:
        return float(grid[0])
    valid = lengths_mask(lengths, max_len)
    margin = lp_new.double() - lp_old.double()
    u = philox_uniform(seed, uids.unsqueeze(1), torch.arange(max_len, device=uids.device).unsqueeze(0), stream=STREAM_ACCEPT)
    # Token i is accepted at log l iff log u_i - margin_i <= log l for it and every token before it.
    need = torch.where(valid, torch.log(u.double()) - margin, torch.full_like(margin, float("inf")))
    need = torch.nan_to_num(need, nan=float("inf"))
    reach = torch.cummax(need, dim=1).values
    drift = torch.where(valid, margin.abs(), torch.zeros_like(margin))
    drift = torch.nan_to_num(drift, nan=0.0, posinf=0.0)
    chosen = float(grid[0])
    for log_l in grid:
        accepted = reach <= log_l
        count = int(accepted.sum())
        if count and float(drift[accepted].sum()) / count > target_drift:
            break
        chosen = float(log_l)
    return chosen
