"""The correction of the step-cost table by the decode loop's own steps (spec_rl.backends.step_correction)."""

from __future__ import annotations

import dataclasses
import random

import pytest
from tiny_models import tiny_model

from spec_rl.backends.step_correction import StepCorrection
from spec_rl.backends.step_cost import StepCost, plan_proposals
from spec_rl.backends.transformers_backend import TransformersBackend
from spec_rl.sampling.distribution import SamplingSettings

# one more fed token costs 1.4x a step: pays from acceptance 0.54 (the 10% margin), not when 1.4x costs twice that
TABLE = StepCost((1, 64), (1, 2, 3), ((1.0, 1.4, 1.8), (64.0, 89.6, 115.2)), source="measured here")


def _feed(corr: StepCorrection, rows: int, scale: float, factor: float, steps: int = 5, width: int = 2) -> None:
    """``steps`` one-token steps taking ``scale`` x the table, and ``width``-wide ones whose extra positions cost
    ``factor`` x the table's price of them (on the same scale)."""
    one, wide = TABLE(rows, rows), TABLE(rows, width * rows)
    for _ in range(steps):
        corr.record(rows, rows, scale * one, one)
        corr.record(rows, width * rows, scale * (one + factor * (wide - one)), wide, one)


def test_the_factor_prices_the_extra_positions_and_a_common_slowdown_cancels():
    corr = StepCorrection(min_steps=3)
    assert corr.factor(64) == 1.0
    _feed(corr, 64, scale=1.0, factor=1.3, steps=2)
    assert corr.factor(64) == 1.0 and corr.factors() == {}  # two of each: not enough yet
    _feed(corr, 64, scale=1.0, factor=1.3, steps=1)
    assert corr.factor(64) == pytest.approx(1.3) and corr.factors() == {3: pytest.approx(1.3)}
    slow = StepCorrection()
    _feed(slow, 64, scale=2.0, factor=1.3, width=3)  # every step twice as slow: only the relative price counts
    assert slow.factor(64) == pytest.approx(1.3)
    cheap = StepCorrection()
    _feed(cheap, 64, scale=1.7, factor=0.75)
    assert cheap.factor(64) == pytest.approx(0.75)


def test_buckets_keep_batch_sizes_apart_and_the_factor_is_clipped():
    corr = StepCorrection(bounds=(0.5, 2.0))
    _feed(corr, 200, scale=1.0, factor=5.0)
    assert corr.factor(200) == 2.0 and corr.factor(256) == 2.0  # same bucket (128-511), clipped at 2
    assert corr.factor(1) == 1.0 and corr.factor(40) == 1.0  # other buckets: nothing seen
    _feed(corr, 1, scale=1.0, factor=0.1)
    assert corr.factor(1) == 0.5 and corr.factors() == {0: 0.5, 4: 2.0}
    assert [StepCorrection.bucket(r) for r in (1, 2, 7, 8, 31, 32, 127, 128, 511, 512)] == [0, 1, 1, 2, 2, 3, 3, 4, 4, 5]


def test_older_steps_fade_and_the_factor_is_its_formula_over_decayed_sums():
    corr = StepCorrection(decay=0.8)
    _feed(corr, 64, scale=1.0, factor=1.5, steps=20)
    assert corr.factor(64) == pytest.approx(1.5)
    _feed(corr, 64, scale=1.0, factor=1.0, steps=30)
    assert corr.factor(64) == pytest.approx(1.0, abs=0.01)
    rng = random.Random(0)
    steps = [(rng.choice((1, 2, 3)), rng.uniform(0.5, 2.0)) for _ in range(40)]  # (width, actual / predicted)
    exact = StepCorrection(decay=0.8, bounds=(0.0, 100.0))
    for width, ratio in steps:
        exact.record(64, 64 * width, ratio * TABLE(64, 64 * width), TABLE(64, 64 * width), TABLE(64, 64))

    def decayed(kind, term):  # sum over the steps of one kind, the newest weighted 1, older ones 0.8 per step
        seen = [term(w, r) for w, r in steps if (w > 1) == kind]
        return sum(0.8 ** (len(seen) - 1 - i) * v for i, v in enumerate(seen))

    scale = decayed(False, lambda w, r: r * TABLE(64, 64)) / decayed(False, lambda w, r: TABLE(64, 64))
    actual = decayed(True, lambda w, r: r * TABLE(64, 64 * w))
    extra = decayed(True, lambda w, r: TABLE(64, 64 * w) - TABLE(64, 64))
    expected = (actual - scale * decayed(True, lambda w, r: TABLE(64, 64))) / (scale * extra)
    assert exact.factor(64) == pytest.approx(expected, rel=1e-12)


def test_steps_without_finite_times_are_ignored_and_no_sums_give_a_nan_factor():
    corr = StepCorrection()
    for seconds, predicted in ((0.0, 1.0), (1.0, 0.0), (float("nan"), 1.0), (float("inf"), 1.0), (1.0, float("inf")), (-1.0, 1.0)):
        corr.record(8, 16, seconds, predicted, 0.5)
    assert corr._sums == {}
    for _ in range(5):  # sums that overflow, or a one-token ratio that underflows: the factor stays 1, never NaN
        corr.record(8, 8, 1e308, 1e308)
        corr.record(8, 16, 1e308, 1e308, 1e307)
        corr.record(300, 300, 1e-320, 1e10)
        corr.record(300, 600, 1.0, 2.0, 1.0)
    assert corr.factor(8) == 1.0 and corr.factor(300) == 1.0 and corr.factors() == {}


def test_bad_arguments_are_refused_with_their_names():
    for kwargs, error, match in (
        ({"decay": 0.0}, ValueError, "decay"), ({"decay": float("nan")}, ValueError, "decay"),
        ({"decay": "0.9"}, TypeError, "decay"), ({"decay": True}, TypeError, "decay"),
        ({"min_steps": 0}, ValueError, "min_steps"), ({"min_steps": float("inf")}, ValueError, "min_steps"),
        ({"min_steps": "3"}, TypeError, "min_steps"), ({"bounds": (1.5, 2.0)}, ValueError, "bounds"),
        ({"bounds": (0.5, float("inf"))}, ValueError, "bounds"), ({"bounds": 0.5}, TypeError, "bounds"),
        ({"bounds": (0.5, 1.0, 2.0)}, TypeError, "bounds"), ({"bounds": (True, 2.0)}, TypeError, "bounds"),
    ):  # fmt: skip
        with pytest.raises(error, match=match):
            StepCorrection(**kwargs)
    corr = StepCorrection()
    for rows, tokens, error in ((0, 0, ValueError), (-2, 4, ValueError), (4, 3, ValueError), ("3", 10, TypeError),
                                (None, 4, TypeError), (True, 2, TypeError), (4, 8.0, TypeError)):  # fmt: skip
        with pytest.raises(error, match="rows|tokens"):
            corr.record(rows, tokens, 1.0, 1.0)
    with pytest.raises(ValueError, match="wide_factor"):
        dataclasses.replace(TABLE, wide_factor=-1.0)
    with pytest.raises(ValueError, match="wide_factor"):
        dataclasses.replace(TABLE, wide_factor=float("nan"))


def test_the_factor_prices_what_the_width_adds_and_can_turn_a_plan_off():
    corr = StepCorrection()
    _feed(corr, 64, scale=1.0, factor=1.6)
    priced = corr.apply(TABLE, 64)
    assert priced.wide_factor == pytest.approx(1.6) and priced == TABLE  # same table, corrected prices
    one, wide = TABLE(64, 64), TABLE(64, 128)
    assert priced(64, 64) == one and priced(64, 128) == pytest.approx(one + 1.6 * (wide - one))
    assert priced(64, 65) == pytest.approx(one + 1.6 * (TABLE(64, 65) - one))  # one extra packed token: a little more
    for factor in (0.0, 0.5):  # a cheap correction never prices a wide step below its one-token version
        cheap = dataclasses.replace(TABLE, wide_factor=factor)
        assert all(cheap(r, t) >= cheap(r, r) for r in (1, 3, 64, 100) for t in (r, r + 1, 2 * r, 9 * r))
    assert corr.apply(TABLE, 3) is TABLE  # nothing seen at 3 rows
    offered, probs = [[5, 6]] * 64, [0.8] * 64
    assert all(plan_proposals(offered, probs, TABLE, padded=True))
    assert not any(plan_proposals(offered, probs, priced, padded=True))
    assert corr.apply(StepCost.flat(), 64) == StepCost.flat() and corr.apply(StepCost.flat(), 64).wide_factor == 1.0


class _Kept:
    """Proposes what a plain run emitted next (always kept); reports a fixed acceptance."""

    def __init__(self, tokens, rate=0.8):
        self.tokens, self.done, self.rate = list(tokens), 0, rate

    def propose(self, limit, fill=0):
        return self.tokens[self.done : self.done + limit]

    def update(self, proposal, emitted):
        self.done += len(emitted)

    def acceptance(self):
        return self.rate


@pytest.mark.parametrize("kind", ["transformers", "paged"])
def test_loops_time_their_steps_for_a_measured_table_and_a_dear_correction_turns_speculation_off(kind):
    model = tiny_model(seed=3)
    if kind == "paged":
        from spec_rl.engine import PagedEngine

        backend = PagedEngine(model, eos_ids={1}, pad_id=0, block_size=4, num_blocks=256)
    else:
        backend = TransformersBackend(model.double(), eos_ids=[1], pad_id=0)
    assert backend.step_correction() is None  # off unless asked for
    backend.set_step_cost(TABLE)
    contexts, settings = [[2, 3, 4], [5, 6], [7, 8, 9, 10]], SamplingSettings(max_tokens=16)
    plain = backend.generate(contexts, [16] * 3, settings, seed=5)
    plain_steps = backend.stats.decode_steps

    def run():
        before = backend.stats.decode_steps
        out = backend.generate(contexts, [16] * 3, settings, seed=5, proposers=[_Kept(c.token_ids) for c in plain])
        assert [c.token_ids for c in out] == [c.token_ids for c in plain]  # the price changes steps, never a token
        return backend.stats.decode_steps - before

    assert run() < plain_steps / 2  # the table alone: speculates
    backend.set_step_cost(TABLE, corrected=True)
    corr = backend.step_correction()
    assert corr is not None and backend.step_correction() is corr
    run()  # steps depend on the times read: only the tokens are asserted
    assert any(True in sums for sums in corr._sums.values())  # the loop timed its wide steps
    dear = backend._correction = StepCorrection(bounds=(0.5, 10.0))  # wide steps' extra positions 10x the table's
    for rows in (1, 3):
        _feed(dear, rows, scale=1.0, factor=10.0)
    assert backend.step_correction() is dear and dear.factor(1) == dear.factor(3) == 10.0
    assert run() == plain_steps  # every plan refused, exploring too: plain decoding's steps
    assert dear.factor(3) == 10.0  # the run's own one-token steps only shrank the scale: still dear
    backend.set_step_cost(TABLE, corrected=True)  # a fresh correction: factor 1 again
    assert backend.step_correction().factor(3) == 1.0


def test_the_correction_is_off_by_default_on_by_request_and_never_corrects_the_flat_cost(monkeypatch):
    monkeypatch.delenv("SPEC_RL_STEP_CORRECTION", raising=False)
    backend = TransformersBackend(tiny_model(seed=0), eos_ids=[1], pad_id=0)
    assert backend.step_correction() is None
    monkeypatch.setenv("SPEC_RL_STEP_CORRECTION", "1")
    corr = backend.step_correction()
    assert corr is not None and backend.step_correction() is corr  # one per backend, for a table it measures
    assert TransformersBackend(tiny_model(seed=0), eos_ids=[1], pad_id=0, step_cost=TABLE).step_correction() is None
    assert backend.step_cost().source == "flat"  # SPEC_RL_STEP_COST=flat (tests/conftest.py)
    _feed(corr, 8, scale=1.0, factor=2.0)
    assert corr.apply(backend.step_cost(), 8) is backend.step_cost()  # an instruction, not a measurement
    assert dataclasses.replace(TABLE, wide_factor=3.0) == TABLE  # the factor is not part of the table
    assert "wide_factor" not in TABLE.to_dict()
    for value, on in (("true", True), ("ON", True), ("0", False), ("off", False), ("", False)):
        monkeypatch.setenv("SPEC_RL_STEP_CORRECTION", value)
        backend.set_step_cost(None)
        assert (backend.step_correction() is not None) is on
    monkeypatch.setenv("SPEC_RL_STEP_CORRECTION", "maybe")
    with pytest.raises(ValueError, match="SPEC_RL_STEP_CORRECTION must be 1 or 0"):
        backend.step_correction()
    for bad in ("0", "false", 1, 2.5):
        with pytest.raises(TypeError, match="corrected must be True, False or None"):
            backend.set_step_cost(TABLE, corrected=bad)


def test_wide_factor_is_checked_and_a_wide_step_never_costs_less_than_a_one_token_step():
    import numpy as np

    for good in (2, np.float32(1.5), np.int64(2), 0):
        factor = dataclasses.replace(TABLE, wide_factor=good).wide_factor
        assert type(factor) is float and factor == float(good)
    for bad in (True, -0.5, float("inf"), float("nan"), 2**1100, "2"):
        with pytest.raises(ValueError, match="wide_factor must be a finite number >= 0"):
            dataclasses.replace(TABLE, wide_factor=bad)
    falling = StepCost((1, 8), (1, 2, 3), ((1.0, 2.0, 3.0), (8.0, 8.5, 9.0)))  # past 8 rows it extrapolates lower
    for factor in (1.0, 0.5, 1.5):
        cost = dataclasses.replace(falling, wide_factor=factor)
        assert all(cost(64, w * 64) >= cost(64, 64) for w in (2, 3, 9))


def test_a_bad_switch_fails_before_any_forward(monkeypatch):
    monkeypatch.setenv("SPEC_RL_STEP_CORRECTION", "maybe")
    backend = TransformersBackend(tiny_model(seed=0), eos_ids=[1], pad_id=0)
    with pytest.raises(ValueError, match="SPEC_RL_STEP_CORRECTION"):
        backend.generate([[2, 3, 4]], [4], SamplingSettings(max_tokens=4), seed=0)
    assert backend.stats.prefill_tokens == 0 and backend.stats.decode_steps == 0
