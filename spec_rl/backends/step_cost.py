"""How long a decode step takes, and how many drafted tokens each step should verify.

A decode step that verifies drafted tokens feeds more positions per sequence; whether that pays depends
on the device. On a CPU a forward costs about what its positions cost, so feeding every live row the
longest proposal of the step (a padded batch) can cost more than the accepted tokens save; on a GPU a
decode step is memory-bound and extra positions are nearly free until compute binds (DAS, arXiv
2511.13841, sizes the draft budget the same way). So the width is chosen from a measured cost curve:

* :class:`StepCost` holds forward seconds t(rows, fed tokens, cached positions) measured once per model shape,
  dtype and device (a few forwards at start, cached on disk under ``$SPEC_RL_CACHE``; :func:`measured_cost`).
  The grid is timed at a short and a long context and is linear in between and beyond: attention reads every
  cached position of every row once per step, however many tokens the row feeds, so at long contexts a wider
  step costs relatively less (the demo's CPU: 5 fed tokens per row of 128 rows cost 2.5x a one-token step
  at 64 cached positions, 2.1x at 320; docs/design.md);
* :func:`plan_proposals` takes each row's proposal and its estimated per-token acceptance probability
  a_r (the proposer's ``acceptance()``, e.g. :class:`~spec_rl.drafts.siblings.DraftSources`) and keeps, per
  row, the prefix that maximises the expected tokens emitted per second:
  a step emits 1 + sum_j prod_{i<=j} a_r tokens for row r (a proposal is accepted token by token
  until the first miss, then the policy's own sample follows), and costs t(rows, fed tokens, context).

Padded backends (the transformers decode loop) feed every row the same width w, so the plan picks one
w; packed backends (the paged engine) feed each row its own length, so the plan adds tokens in order of
their acceptance probability. With no proposal anywhere, or when speculation does not pay (by at least
:data:`MIN_GAIN` over plain decoding), every row is fed one token: the step costs what plain decoding
costs. The choice changes how many steps a response takes, never a token (acceptance is "sample ==
proposal", docs/design.md "Speculation past the first rejection").
"""

from __future__ import annotations

import bisect
import hashlib
import json
import numbers
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..util.atomic import atomic_write_text
from .step_correction import StepCorrection, correction_requested

__all__ = ["CostSizedBackend", "ProposalBackoff", "StepCost", "acceptance_of", "cost_key", "fastest_run", "measured_contexts",
           "measured_cost", "monotone_fit", "plan_proposals"]

#: Rows and widths (fed tokens per row) timed by :func:`measured_cost`.
MEASURED_ROWS = (1, 8, 32, 128, 256)
MEASURED_WIDTHS = (1, 2, 3, 5, 9)
#: Cached positions per row at which the grid is timed (:func:`measured_contexts` keeps those a model can hold).
MEASURED_CONTEXTS = (64, 320)
#: A plan feeds proposals only when its expected tokens per second beat plain decoding's by this fraction: the
#: table's own error. On the demo's CPU, eleven measurements of one point (2 fed tokens x 256 rows) read
#: 1.34-1.53x a one-token step, about +-7% around their middle; a plan expected to gain less than that may
#: as well lose (benchmarks/RESULTS.md, "The step-cost model on the CPU").
MIN_GAIN = 0.10
#: Rounds over the whole grid in :func:`measured_cost`; each point keeps its fastest round.
MEASURE_ROUNDS = 3
#: Timed runs per point and round (the backends' ``time_forward``), after one untimed run.
MEASURE_REPEATS = 2
# 2: the fastest run of each point, not the median; 3: in-place KV appends; 4: interleaved rounds, monotone fit;
# 5: a context axis (seconds per cached position)
_FORMAT = "spec-rl-step-cost-5"


@dataclass(frozen=True)
class StepCost:
    """Forward seconds of a decode step on a grid of (rows, fed tokens per row), interpolated in between, and
    linear in the cached positions per row.

    Attributes:
        rows: ascending row counts of the grid.
        widths: ascending fed tokens per row (1 = plain decoding).
        seconds: [len(rows)][len(widths)] measured seconds per forward with ``context`` cached positions per row.
        source: where the numbers come from (a measurement's cache key, or "flat").
        context: cached positions per row at which ``seconds`` was measured.
        per_position: [len(rows)][len(widths)] seconds each further cached position adds to a step (>= 0,
            non-decreasing in rows and widths), or () when only one context was measured (the cost then
            ignores the context).
        wide_factor: multiplies what a step feeding more tokens than rows costs beyond its one-token version
            (>= 0; learned by :class:`~spec_rl.backends.step_correction.StepCorrection`; not stored with the table).
    """

    rows: tuple[int, ...]
    widths: tuple[int, ...]
    seconds: tuple[tuple[float, ...], ...]
    source: str = field(default="given", compare=False)
    context: int = 64
    per_position: tuple[tuple[float, ...], ...] = ()
    wide_factor: float = field(default=1.0, compare=False)

    def __post_init__(self):
        factor = self.wide_factor
        try:
            value = float(factor) if isinstance(factor, numbers.Real) and not isinstance(factor, bool) else -1.0
        except OverflowError:  # an int too large for a float
            value = -1.0
        if not 0.0 <= value < float("inf"):
            raise ValueError(f"wide_factor must be a finite number >= 0, got {factor!r}")
        object.__setattr__(self, "wide_factor", value)

    @classmethod
    def flat(cls) -> "StepCost":
        """A cost that does not grow with the width: every step verifies all it can (tests, a GPU's ideal)."""
        return cls((1,), (1, 2), ((1.0, 1.0),), source="flat")

    def __call__(self, rows: int, tokens: int, context: float | None = None) -> float:
        """Seconds of one forward over ``rows`` sequences feeding ``tokens`` positions in all, each row holding
        ``context`` cached positions (None, or fewer than :attr:`context`: as measured at :attr:`context`)."""
        seconds = self._table(rows, tokens, context)
        if tokens > rows:  # never below the one-token step (past the grid a table may extrapolate lower)
            one = self._table(rows, rows, context)
            seconds = one + self.wide_factor * max(seconds - one, 0.0)  # the correction prices what the width adds
        return seconds

    def _table(self, rows: int, tokens: int, context: float | None) -> float:
        width = tokens / max(rows, 1)
        seconds = self._at(self.seconds, rows, width)
        if context is not None and self.per_position and context > self.context:
            seconds += (context - self.context) * self._at(self.per_position, rows, width)
        return seconds

    def _at(self, table: tuple[tuple[float, ...], ...], rows: int, width: float) -> float:
        return _interp(self.rows, [_interp(self.widths, row, width) for row in table], rows)

    def to_dict(self) -> dict:
        return {"format": _FORMAT, "rows": list(self.rows), "widths": list(self.widths),
                "seconds": [list(r) for r in self.seconds], "source": self.source, "context": self.context,
                "per_position": [list(r) for r in self.per_position]}  # fmt: skip

    @classmethod
    def from_dict(cls, data: dict) -> "StepCost":
        if data.get("format") != _FORMAT:
            raise ValueError(f"not a step-cost table (format {data.get('format')!r})")
        return cls(tuple(data["rows"]), tuple(data["widths"]), tuple(tuple(r) for r in data["seconds"]), data["source"],
                   int(data["context"]), tuple(tuple(r) for r in data["per_position"]))  # fmt: skip


def _interp(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear y(x) through the points; linear extrapolation past the ends, never below 0."""
    if len(xs) == 1:
        return float(ys[0])
    i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


def acceptance_of(proposer) -> float:
    """A proposer's estimated per-token acceptance probability (its ``acceptance()``; 1/2 when it has none)."""
    estimate = getattr(proposer, "acceptance", None)
    return float(estimate()) if estimate is not None else 0.5


def _widths_cost(cost: StepCost, rows: int, widths: np.ndarray, context: float | None) -> np.ndarray:
    """Seconds of a step of ``rows`` sequences at each fed-tokens-per-row value in ``widths`` (vectorised)."""
    at_rows = [cost(rows, rows * w, context) for w in cost.widths]
    seconds = np.interp(widths, cost.widths, at_rows)
    if len(cost.widths) > 1:  # past the widest measured step: extend its last slope (np.interp would hold it flat)
        slope = (at_rows[-1] - at_rows[-2]) / (cost.widths[-1] - cost.widths[-2])
        seconds = np.where(widths > cost.widths[-1], at_rows[-1] + slope * (widths - cost.widths[-1]), seconds)
    return np.maximum(seconds, 1e-12)


def _gains(lengths: np.ndarray, probs: np.ndarray) -> np.ndarray:
    """[rows, longest] p_r^j for j = 1..longest where j <= len_r, else 0: token j's chance to be kept."""
    j = np.arange(1, int(lengths.max()) + 1)
    return np.where(j[None, :] <= lengths[:, None], probs[:, None] ** j[None, :], 0.0)


def _best(rates: np.ndarray) -> int:
    """Index of the best rate, or 0 (feed no proposal) unless it beats index 0's rate by :data:`MIN_GAIN`."""
    best = int(np.argmax(rates))
    return best if rates[best] >= (1.0 + MIN_GAIN) * rates[0] else 0


def _padded_plan(lengths: np.ndarray, probs: np.ndarray, rows: int, cost: StepCost, context: float | None) -> list[int]:
    # width w feeds min(w - 1, len_r) proposed tokens of every row: expected gain = sum over j < w of column sums
    gain = np.concatenate([[0.0], np.cumsum(_gains(lengths, probs).sum(0))])
    widths = np.arange(1, len(gain) + 1, dtype=float)
    best = _best((rows + gain) / _widths_cost(cost, rows, widths, context))
    return np.minimum(best, lengths).tolist()


def _packed_plan(lengths: np.ndarray, probs: np.ndarray, rows: int, cost: StepCost, context: float | None) -> list[int]:
    # Every extra token adds its acceptance probability p^j; take them best first (a row's j-th token
    # never comes before its (j-1)-th: p^j falls with j) and keep the prefix of choices with the best rate.
    g = _gains(lengths, probs)
    row_of = np.repeat(np.arange(rows)[:, None], g.shape[1], 1)[g > 0]
    order = np.argsort(-g[g > 0], kind="stable")
    gain = np.concatenate([[0.0], np.cumsum(g[g > 0][order])])
    widths = (rows + np.arange(len(gain))) / rows
    best = _best((rows + gain) / _widths_cost(cost, rows, widths, context))
    return np.bincount(row_of[order][:best], minlength=rows).tolist()


def plan_proposals(
    proposals: Sequence[Sequence[int]], probs: Sequence[float], cost: StepCost, padded: bool,
    context: float | None = None,
) -> list[list[int]]:
    """The prefix of each row's proposal to feed this step (see the module docstring).

    Args:
        proposals: per live row, the tokens its proposer offers (maybe none).
        probs: per row, the estimated per-token acceptance probability in [0, 1].
        cost: the backend's :class:`StepCost`.
        padded: True for a backend that feeds every row the same width.
        context: cached positions per row that attention reads this step (the padded cache width; the
            mean context of a packed batch); None: the cost's own context.

    Returns:
        per row, a prefix of its proposal (all empty when speculation does not pay).
    """
    lengths = np.array([len(p) for p in proposals], dtype=np.int64)
    if not lengths.any():
        return [[] for _ in proposals]
    probs = np.clip(np.asarray(probs, dtype=float), 0.0, 1.0)
    plan = (_padded_plan if padded else _packed_plan)(lengths, probs, len(proposals), cost, context)
    return [list(p[:k]) for p, k in zip(proposals, plan)]


class ProposalBackoff:
    """When a decode loop asks its rows' proposers for drafts: each ask costs host time per row (the history
    automaton's and the siblings' lookups), which only pays when the plan then feeds a proposal.

    After a step whose plan fed nothing although proposals were offered (speculation does not pay at
    this batch size), the next ``wait`` steps ask nobody; ``wait`` doubles (1, 2, 4, ... ``max_wait``) while
    plans keep refusing and returns to 0 once a plan feeds a proposal. When the live rows fall to 3/4 of
    the count the wait began with, the loop asks again at once: a step of fewer rows is cheaper, so
    speculation may pay now (the tail). Skipping asks changes how many steps a response takes, never a
    token (a proposal is kept only where it equals the keyed sample).
    """

    def __init__(self, max_wait: int = 16):
        if isinstance(max_wait, bool) or not isinstance(max_wait, int) or max_wait < 1:
            raise ValueError(f"max_wait must be an integer >= 1 (steps), got {max_wait!r}")
        self.max_wait = max_wait
        self.wait = 0  # steps skipped after the latest refusal
        self.skip = 0  # steps still to skip
        self.rows = 0  # live rows when the skipping began
        self.explored = False  # whether this decode loop has fed a proposal (planned or exploring)

    def explore(self, plan: list[list[int]], offered: Sequence[Sequence[int]], cost: StepCost, padded: bool,
                context: float | None = None) -> list[list[int]]:  # fmt: skip
        """``plan``, or, the first time in a decode loop that it feeds nothing, every offering row's first proposed
        token (one step one token wider).

        A refusal rests on acceptance estimates, and a row starts from a prior of 1/2: a row never fed a proposal
        never gets a record of its own, so a prior below the true rate (history drafts are often kept 3 times in
        4) would keep speculation off for the whole loop. The exploring step gives every offering row a record.
        It is skipped where even proposals that are always kept would not pay at this batch (nothing to learn).
        Like every plan it changes how many steps a response takes, never a token.
        """
        if any(plan):
            self.explored = True
            return plan
        if self.explored or not any(plan_proposals(offered, [1.0] * len(offered), cost, padded, context)):
            return plan
        self.explored = True
        return [list(p[:1]) for p in offered]

    def ask(self, live_rows: int) -> bool:
        """Whether to ask the proposers this step (call once per step)."""
        if self.skip and 4 * live_rows <= 3 * self.rows:
            self.skip = self.wait = 0
        if self.skip:
            self.skip -= 1
            return False
        return True

    def planned(self, live_rows: int, fed: bool) -> None:
        """Record a plan made over offered proposals: ``fed`` whether it feeds any of them."""
        if fed:
            self.wait = 0
        else:
            self.wait = min(self.max_wait, 2 * self.wait or 1)
            self.skip, self.rows = self.wait, live_rows


def fastest_run(
    step: Callable[[int], None], device: torch.device, repeats: int = 5, after: Callable[[], None] | None = None
) -> float:
    """Seconds of the fastest of ``repeats`` timed calls ``step(i)`` after one untimed warm-up (``i`` = 0),
    synchronizing a CUDA device around each; ``after()`` (untimed) undoes what a call changed. The minimum, not the median: another process on the machine
    only ever adds time, and a slow point cached here would make speculation look dear for as long as the
    cache lives."""
    times = []
    for i in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        step(i)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
        if after is not None:
            after()
    return min(times[1:])


def _cache_file(key: str) -> Path:
    root = os.environ.get("SPEC_RL_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "spec-rl")
    return Path(root) / "step-cost" / f"{key}.json"


def cost_key(kind: str, model, device: torch.device) -> str:
    """What the cost curve depends on: backend kind, model shape and dtype, device, torch and its threads."""
    cfg = model.config.to_dict() if hasattr(model.config, "to_dict") else {}
    shape = {k: cfg.get(k) for k in ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
                                     "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size")}  # fmt: skip
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu-{torch.get_num_threads()}threads"
    dtype = str(next(model.parameters()).dtype)
    blob = json.dumps([kind, shape, dtype, name, torch.__version__], sort_keys=True).encode()
    return f"{kind}-{hashlib.sha256(blob).hexdigest()[:12]}"


def monotone_fit(seconds: Sequence[Sequence[float]]) -> tuple[tuple[float, ...], ...]:
    """The table made non-decreasing in width (least squares per row, pool-adjacent-violators) and then in rows
    (running maximum, which keeps each row non-decreasing): a forward over more positions never costs less,
    so a point that reads below a narrower or smaller one was measured in a quieter moment."""
    rows = []
    for row in seconds:
        blocks: list[list[float]] = []  # [sum, count] of pooled runs, each mean above the previous one
        for value in row:
            blocks.append([float(value), 1.0])
            while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
                total, count = blocks.pop()
                blocks[-1][0] += total
                blocks[-1][1] += count
        rows.append([b[0] / b[1] for b in blocks for _ in range(int(b[1]))])
    for i in range(1, len(rows)):
        rows[i] = [max(a, b) for a, b in zip(rows[i - 1], rows[i])]
    return tuple(tuple(row) for row in rows)


def measured_contexts(max_positions: int | None) -> tuple[int, ...]:
    """The :data:`MEASURED_CONTEXTS` a model of ``max_positions`` positions can hold with the widest step fed
    (the long one cut down to fit; dropped when it is no longer well past the short one). None: no limit."""
    room = (max_positions if max_positions is not None else 10**9) - max(MEASURED_WIDTHS) - 1
    short, long = MEASURED_CONTEXTS
    long = min(long, room)
    return (short, long) if long >= 2 * short else (min(short, max(room, 1)),)


def measured_cost(
    key: str, time_forward: Callable[[int, int, int], float], max_rows: int, contexts: Sequence[int] = MEASURED_CONTEXTS
) -> StepCost:
    """The cost table under ``key``: read from the cache, else measured with ``time_forward`` and saved.

    ``time_forward(rows, width, context)`` returns the seconds of one decode forward (the fastest of a few runs)
    over ``rows`` sequences of ``context`` cached positions feeding ``width`` tokens each. Rows past
    ``max_rows`` are not measured. The grid, at each of ``contexts`` (one or two, ascending), is timed
    :data:`MEASURE_ROUNDS` times over, point after point, and each point keeps its fastest round: on a shared
    machine a slow spell then slows one round of every point rather than every run of a few points (which made
    widths look cheap or dear next to their neighbours: plans that do not pay). Each context's table is made
    monotone (:func:`monotone_fit`); with two, the seconds per cached position are their difference over the
    context difference, clipped at 0 and made monotone too. ``SPEC_RL_STEP_COST=flat`` skips the measurement
    and uses :meth:`StepCost.flat`.

    Raises:
        ValueError: ``contexts`` not one or two ascending positive counts.
    """
    contexts = tuple(int(c) for c in contexts)
    if not 1 <= len(contexts) <= 2 or contexts[0] < 1 or (len(contexts) == 2 and contexts[1] <= contexts[0]):
        raise ValueError(f"contexts must be one or two ascending positive counts of cached positions, got {contexts}")
    if os.environ.get("SPEC_RL_STEP_COST") == "flat":
        return StepCost.flat()
    path = _cache_file(key)
    try:
        return StepCost.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        pass  # absent or unreadable: measure again
    rows = tuple(r for r in MEASURED_ROWS if r <= max_rows) or (1,)
    t0 = time.perf_counter()
    best = [[[float("inf")] * len(MEASURED_WIDTHS) for _ in rows] for _ in contexts]
    for _ in range(MEASURE_ROUNDS):
        for c, context in enumerate(contexts):
            for i, r in enumerate(rows):
                for j, w in enumerate(MEASURED_WIDTHS):
                    best[c][i][j] = min(best[c][i][j], time_forward(r, w, context))
    tables = [monotone_fit(table) for table in best]
    per_position = ()
    if len(contexts) == 2:
        span = contexts[1] - contexts[0]
        per_position = monotone_fit([[max(0.0, b - a) / span for a, b in zip(short, long)]
                                     for short, long in zip(*tables)])  # fmt: skip
    source = f"{key} (measured in {time.perf_counter() - t0:.1f} s)"
    cost = StepCost(rows, MEASURED_WIDTHS, tables[0], source, contexts[0], per_position)
    try:
        atomic_write_text(path, json.dumps(cost.to_dict()))
    except OSError:
        pass  # a read-only cache folder only costs a measurement next time
    return cost


class CostSizedBackend:
    """Mixin of a decoding backend whose speculation is sized by a :class:`StepCost`: the one given (at
    construction or by :meth:`set_step_cost`), else measured once by the backend's ``_measure_step_cost()``;
    optionally corrected by the decode loops' own steps (:meth:`step_correction`)."""

    _step_cost: StepCost | None = None
    _corrected: bool | None = None  # correct the table by the loops' steps: None = as SPEC_RL_STEP_CORRECTION says
    _correction: StepCorrection | None = None  # made on first use

    def _measure_step_cost(self) -> StepCost:
        raise NotImplementedError

    def step_cost(self) -> StepCost:
        """The decode-step cost curve that sizes speculation (module docstring): the one given, else measured
        once for this model shape, dtype and device (a few seconds) and cached on disk (:func:`measured_cost`)."""
        if self._step_cost is None:
            self._step_cost = self._measure_step_cost()
        return self._step_cost

    def step_correction(self) -> StepCorrection | None:
        """The :class:`~spec_rl.backends.step_correction.StepCorrection` that the decode loops time their steps for
        and price wide steps by (one per backend), or None: off unless asked for, by ``set_step_cost(...,
        corrected=True)`` or, for a measured table, ``SPEC_RL_STEP_CORRECTION=1``. Off, a table gives the same
        decode steps in every run; on, the steps depend on the times the loops read (tokens never do). On the
        demo's CPU it found no price the table gets wrong beyond the machine's noise (benchmarks/RESULTS.md).

        Raises:
            ValueError: ``SPEC_RL_STEP_CORRECTION`` set to something other than 1/0, true/false, yes/no, on/off.
        """
        on = self._corrected if self._corrected is not None else correction_requested()
        if not on:
            return None
        if self._correction is None:
            self._correction = StepCorrection()
        return self._correction

    def set_step_cost(self, cost: StepCost | None, corrected: bool | None = None) -> None:
        """Size speculation by ``cost`` from the next decode on (None: measure, or read the disk cache, on next
        use). :meth:`StepCost.flat` verifies every proposed token; compare policies on one backend this way.
        ``corrected``: whether the decode loops correct the table by their own steps (:meth:`step_correction`;
        a fresh correction either way); None: as ``SPEC_RL_STEP_CORRECTION`` says for a measured table (``cost``
        None), off for a table given here.

        Raises:
            TypeError: ``cost`` is neither a StepCost nor None, or ``corrected`` neither a bool nor None.
        """
        if cost is not None and not isinstance(cost, StepCost):
            raise TypeError(f"cost must be a StepCost or None (measure on next use), got {type(cost).__name__}")
        if corrected is not None and not isinstance(corrected, bool):
            raise TypeError(f"corrected must be True, False or None (as SPEC_RL_STEP_CORRECTION says), got {corrected!r}")
        if corrected is None and cost is not None:
            corrected = False
        self._step_cost, self._corrected, self._correction = cost, corrected, None
