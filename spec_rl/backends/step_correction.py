"""What a decode loop's own steps say about the step-cost table: a correction for speculative steps.

The :class:`~spec_rl.backends.step_cost.StepCost` table is timed on a freshly prefilled batch that feeds every
row the same number of random tokens: a bare forward and its samples. A speculative step of the real loop
does more: it builds the proposal ids, rolls rejected positions back (holes in the cache that widen later
steps until a compaction gathers them out), and reports every proposal to its proposer. One pair of rollouts
on the demo's CPU read the loop's wide steps a fifth dearer than the table's price (benchmarks/RESULTS.md,
"The step cost's context axis and its 10% margin"); later ones read them cheaper.

:class:`StepCorrection` times the loop's steps against the table and learns, per batch size, the price of the
positions a wide step adds beyond one token per row, relative to the table's: a step of ``rows`` rows feeding
``tokens`` positions is modelled as ``s * (t1 + f * (t - t1))``, with ``t`` and ``t1`` the table's seconds for
the step and for its one-token version, ``s`` the loop's actual/predicted ratio of one-token steps (whatever
slows every step alike: the loop's host work, a slow spell of the machine) and ``f`` the factor learned. The
plan then prices wide steps as ``t1 + f * (t - t1)`` (:attr:`StepCost.wide_factor
<spec_rl.backends.step_cost.StepCost>`), so a wide step never costs less than a one-token step. Like every
plan, this changes how many steps a response takes, never a token.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
import time

__all__ = ["StepCorrection", "StepTimer", "correction_requested"]


def correction_requested() -> bool:
    """Whether ``SPEC_RL_STEP_CORRECTION`` turns the correction on for measured tables: unset or empty, 0, false,
    no, off -> False; 1, true, yes, on -> True (any case).

    Raises:
        ValueError: any other value.
    """
    raw = os.environ.get("SPEC_RL_STEP_CORRECTION", "")
    value = raw.strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"SPEC_RL_STEP_CORRECTION must be 1 or 0 (true/false, yes/no, on/off), got {raw!r}")


def _real(value, name: str) -> float:
    """``value`` as a finite float; TypeError/ValueError naming ``name`` otherwise (bools refused)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return float(value)


def _count(value, name: str) -> int:
    """``value`` as an int; TypeError naming ``name`` for anything that is not an integer (bools refused)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    return int(value)


class StepCorrection:
    """The price of a wide step's extra positions in the loop, relative to the table's, per batch size.

    Steps are grouped by live rows into buckets ``rows.bit_length() // 2``: 0 = 1 row, 1 = 2-7, 2 = 8-31,
    3 = 32-127, 4 = 128-511, ... (a factor of 4 each, since the fixed host work of a step weighs more in a
    small batch). A step is wide when it feeds more positions than it has rows (in the paged engine: any
    step with a proposal). Per bucket it keeps decayed sums of the actual and predicted seconds of one-token
    steps, and of the actual, predicted and predicted-one-token seconds of wide steps; the factor (module
    docstring) is ``(A_w - s * P1_w) / (s * (P_w - P1_w))`` with ``s = A_1 / P_1``, clipped to ``bounds``, and 1
    until both kinds were seen at least ``min_steps`` times in the bucket (or when the sums say nothing finite).

    Args:
        decay: weight kept by the older steps of a kind at each new one, in (0, 1] (0.95: about the last 20).
        min_steps: steps of each kind a bucket needs before its factor departs from 1 (finite, >= 1).
        bounds: (lowest, highest) factor, finite, 0 <= lowest <= 1 <= highest.

    Raises:
        TypeError: an argument that is not a number (a bool, a string), or ``bounds`` not a pair.
        ValueError: a number outside the ranges above, or not finite.
    """

    def __init__(self, decay: float = 0.95, min_steps: float = 3.0, bounds: tuple[float, float] = (0.5, 2.0)):
        decay, min_steps = _real(decay, "decay"), _real(min_steps, "min_steps")
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1] (weight kept per step), got {decay!r}")
        if not min_steps >= 1:
            raise ValueError(f"min_steps must be >= 1 (steps of each kind), got {min_steps!r}")
        if not isinstance(bounds, (tuple, list)) or len(bounds) != 2:
            raise TypeError(f"bounds must be a pair (lowest, highest) of factors, got {bounds!r}")
        low, high = _real(bounds[0], "bounds[0]"), _real(bounds[1], "bounds[1]")
        if not 0.0 <= low <= 1.0 <= high:
            raise ValueError(f"bounds must satisfy 0 <= lowest <= 1 <= highest, got {tuple(bounds)!r}")
        self.decay, self.min_steps, self.bounds = decay, min_steps, (low, high)
        # bucket -> {False: [A_1, P_1, steps], True: [A_w, P_w, P1_w, steps]} (decayed sums, raw step counts)
        self._sums: dict[int, dict[bool, list[float]]] = {}

    @staticmethod
    def bucket(rows: int) -> int:
        """The batch-size bucket of ``rows`` >= 1 live rows (class docstring)."""
        return int(rows).bit_length() // 2

    def record(self, rows: int, tokens: int, seconds: float, predicted: float, predicted_one: float | None = None) -> None:
        """One step of ``rows`` rows feeding ``tokens`` positions in all took ``seconds``; the table (uncorrected)
        predicted ``predicted`` for it and ``predicted_one`` for its one-token version (``rows`` positions; None:
        ``predicted``, for a one-token step). A step whose seconds are not all finite and positive is ignored.

        Raises:
            TypeError: ``rows`` or ``tokens`` not an integer.
            ValueError: ``rows`` < 1, or ``tokens`` < ``rows`` (every row feeds at least its pending token).
        """
        rows, tokens = _count(rows, "rows"), _count(tokens, "tokens")
        if rows < 1 or tokens < rows:
            raise ValueError(f"a step feeds rows >= 1 and tokens >= rows positions, got rows={rows}, tokens={tokens}")
        predicted_one = predicted if predicted_one is None else predicted_one
        times = (seconds, predicted, predicted_one)
        if not all(isinstance(t, numbers.Real) and not isinstance(t, bool) and math.isfinite(t) and t > 0 for t in times):
            return
        wide = tokens > rows
        sums = self._sums.setdefault(self.bucket(rows), {}).setdefault(wide, [0.0] * (4 if wide else 3))
        for i, value in enumerate((seconds, predicted, predicted_one) if wide else (seconds, predicted)):
            sums[i] = sums[i] * self.decay + float(value)
        sums[-1] += 1.0

    def _learned(self, bucket: int) -> float | None:
        """The bucket's clipped factor, or None while it says nothing (too few steps, or no finite answer)."""
        sums = self._sums.get(bucket, {})
        one, wide = sums.get(False), sums.get(True)
        if one is None or wide is None or min(one[-1], wide[-1]) < self.min_steps:
            return None
        actual_one, predicted_one, _ = one
        actual, predicted, predicted_narrow, _ = wide
        scale = actual_one / predicted_one
        extra = scale * (predicted - predicted_narrow)
        if not (math.isfinite(scale) and math.isfinite(extra) and extra > 0):
            return None
        factor = (actual - scale * predicted_narrow) / extra
        if not math.isfinite(factor):
            return None
        return min(max(factor, self.bounds[0]), self.bounds[1])

    def factor(self, rows: int) -> float:
        """The learned factor for a batch of ``rows`` rows; 1 until its bucket has seen enough of both kinds."""
        learned = self._learned(self.bucket(max(int(rows), 1)))
        return 1.0 if learned is None else learned

    def apply(self, cost, rows: int):
        """``cost`` (a :class:`~spec_rl.backends.step_cost.StepCost`, which builds on this module) with its wide
        steps priced by :meth:`factor` for ``rows`` rows (a flat cost is an instruction to verify every
        proposal, not a measurement: returned as it is)."""
        if cost.source == "flat":
            return cost
        factor = self.factor(rows)
        return cost if factor == cost.wide_factor else dataclasses.replace(cost, wide_factor=factor)

    def factors(self) -> dict[int, float]:
        """Bucket index (class docstring) -> learned factor, for the buckets that have one (reports)."""
        out = {b: self._learned(b) for b in sorted(self._sums)}
        return {b: f for b, f in out.items() if f is not None}


class StepTimer:
    """One decode loop's side of a :class:`StepCorrection` (or of none: ``correction`` None, and nothing is timed).

    ``price(table, rows)`` when a step is planned (the table to plan with), ``start()`` once its inputs are
    built, ``stop(rows, tokens, context)`` once its outputs are applied (a cuda device has synchronised by then:
    the samples were read on the host). Steps before the loop first asked for its table are not timed.
    """

    def __init__(self, correction: StepCorrection | None):
        self.correction = correction
        self.table = None  # the loop's uncorrected StepCost, once a proposal made it ask for it
        self._t0: float | None = None

    def price(self, table, rows: int):
        """``table`` (a :class:`~spec_rl.backends.step_cost.StepCost`, kept as the loop's uncorrected table) as
        corrected for ``rows`` rows."""
        self.table = table
        return table if self.correction is None else self.correction.apply(table, rows)

    def start(self) -> None:
        self._t0 = time.perf_counter() if self.correction is not None else None

    def stop(self, rows: int, tokens: int, context: float | None) -> None:
        if self._t0 is None or self.table is None or self.table.source == "flat":
            return
        seconds = time.perf_counter() - self._t0
        self._t0 = None
        self.correction.record(rows, tokens, seconds, self.table(rows, tokens, context), self.table(rows, rows, context))
