"""What a decode loop's own steps say about the step-cost table: a correction for speculative steps.

The :class:`~spec_rl.backends.step_cost.StepCost` table is timed on a freshly prefilled batch that feeds every
row the same number of random tokens: a bare forward and its samples. A speculative step of the real loop
costs more than that: it builds the proposal ids, rolls rejected positions back (holes in the cache that widen
later steps until a compaction gathers them out), and reports every proposal to its proposer. On the demo's
CPU the loop's wide steps cost about a fifth more than the table's price while its one-token steps cost what
the table says (benchmarks/RESULTS.md, "The step cost's context axis and its 10% margin"), so plans expected to
gain 10-15% lost a few percent.

:class:`StepCorrection` times the loop's steps against the table's prediction and learns, per batch size, the
ratio (wide steps' actual / predicted) / (one-token steps' actual / predicted): how much dearer speculation
is than the table thinks, relative to plain decoding in the same loop (a common factor, such as a slow spell
of the machine, cancels). The plan then prices wide steps with that factor
(:attr:`StepCost.wide_factor <spec_rl.backends.step_cost.StepCost>`). Like every plan, it changes how many
steps a response takes, never a token.
"""

from __future__ import annotations

import dataclasses
import time

__all__ = ["StepCorrection", "StepTimer"]


class StepCorrection:
    """The factor by which the loop's speculative steps cost more than the table predicts, per batch size.

    Steps are grouped by live rows (buckets 1, 2-7, 8-31, 32-127, 128-511, ...: a factor of 4 each, since the
    fixed host work of a step weighs more in a small batch). In each bucket it keeps decayed sums of actual and
    predicted seconds for one-token steps and for wider ones; the factor is the ratio of their ratios, clipped
    to ``bounds``, and 1 until both kinds were seen at least ``min_steps`` times in that bucket.

    Args:
        decay: weight kept by the older steps of a kind at each new one (0.95: about the last 20 count).
        min_steps: steps of each kind a bucket needs before its factor departs from 1.
        bounds: (lowest, highest) factor.

    Raises:
        ValueError: ``decay`` not in (0, 1], ``min_steps`` < 1, or ``bounds`` not 0 < lowest <= 1 <= highest.
    """

    def __init__(self, decay: float = 0.95, min_steps: float = 3.0, bounds: tuple[float, float] = (0.5, 2.0)):
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1] (weight kept per step), got {decay!r}")
        if not min_steps >= 1:
            raise ValueError(f"min_steps must be >= 1 (steps of each kind), got {min_steps!r}")
        low, high = bounds
        if not 0.0 < low <= 1.0 <= high:
            raise ValueError(f"bounds must satisfy 0 < lowest <= 1 <= highest, got {bounds!r}")
        self.decay, self.min_steps, self.bounds = float(decay), float(min_steps), (float(low), float(high))
        # bucket -> {wide: [decayed actual seconds, decayed predicted seconds, steps seen]}
        self._sums: dict[int, dict[bool, list[float]]] = {}

    @staticmethod
    def bucket(rows: int) -> int:
        """The batch-size bucket of ``rows`` live rows (0 for 1 row, then one per factor of 4)."""
        return max(int(rows), 1).bit_length() // 2

    def record(self, rows: int, tokens: int, seconds: float, predicted: float) -> None:
        """One step of ``rows`` rows feeding ``tokens`` positions in all took ``seconds``; the table (without
        correction) predicted ``predicted``. Steps with a non-positive or non-finite time are ignored."""
        if not (seconds > 0.0 and predicted > 0.0) or seconds == float("inf") or predicted == float("inf"):
            return
        kind = self._sums.setdefault(self.bucket(rows), {}).setdefault(tokens > rows, [0.0, 0.0, 0.0])
        kind[0] = kind[0] * self.decay + seconds
        kind[1] = kind[1] * self.decay + predicted
        kind[2] += 1.0

    def factor(self, rows: int) -> float:
        """How many times dearer (relative to one-token steps) the loop's wide steps are than the table says,
        for a batch of ``rows`` rows; 1 until both kinds of step have been seen enough in its bucket."""
        sums = self._sums.get(self.bucket(rows), {})
        narrow, wide = sums.get(False), sums.get(True)
        if narrow is None or wide is None or min(narrow[2], wide[2]) < self.min_steps:
            return 1.0
        ratio = (wide[0] / wide[1]) / (narrow[0] / narrow[1])
        return min(max(ratio, self.bounds[0]), self.bounds[1])

    def apply(self, cost, rows: int):
        """``cost`` (a :class:`~spec_rl.backends.step_cost.StepCost`, which builds on this module) with its wide steps priced by :meth:`factor` for ``rows`` rows (a flat cost is an instruction
        to verify every proposal, not a measurement: returned as it is)."""
        if cost.source == "flat":
            return cost
        factor = self.factor(rows)
        return cost if factor == cost.wide_factor else dataclasses.replace(cost, wide_factor=factor)

    def factors(self) -> dict[int, float]:
        """Bucket -> current factor, for the buckets where both kinds of step were seen (reports)."""
        return {b: self.factor(4**b) for b, sums in sorted(self._sums.items()) if len(sums) == 2}


class StepTimer:
    """Times one decode step of a loop for a :class:`StepCorrection` (or for nobody: ``correction`` None).

    ``start()`` when the step's inputs are planned, ``stop(cost, rows, tokens, context)`` when its outputs are
    applied (``cost``: the uncorrected :class:`~spec_rl.backends.step_cost.StepCost`, or None before the loop asked
    for it) (a cuda device has synchronised by then: the samples were read on the host).
    """

    def __init__(self, correction: StepCorrection | None):
        self.correction = correction
        self._t0: float | None = None

    def start(self) -> None:
        self._t0 = time.perf_counter() if self.correction is not None else None

    def stop(self, cost, rows: int, tokens: int, context: float | None) -> None:
        if self._t0 is None or cost is None or cost.source == "flat":
            return
        seconds = time.perf_counter() - self._t0
        self._t0 = None
        raw = dataclasses.replace(cost, wide_factor=1.0) if cost.wide_factor != 1.0 else cost
        self.correction.record(rows, tokens, seconds, raw(rows, tokens, context))
