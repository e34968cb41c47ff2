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


def _feed(corr: StepCorrection, rows: int, narrow: float, wide: float, steps: int = 5) -> None:
    """``steps`` one-token and 2-wide steps that took ``narrow`` / ``wide`` times the table's prediction."""
    for _ in range(steps):
        corr.record(rows, rows, narrow * TABLE(rows, rows), TABLE(rows, rows))
        corr.record(rows, 2 * rows, wide * TABLE(rows, 2 * rows), TABLE(rows, 2 * rows))


def test_the_factor_is_the_ratio_of_the_two_kinds_ratios_and_a_common_slowdown_cancels():
    corr = StepCorrection(min_steps=3)
    assert corr.factor(64) == 1.0
    _feed(corr, 64, narrow=1.0, wide=1.3, steps=2)
    assert corr.factor(64) == 1.0  # two of each: not enough yet
    _feed(corr, 64, narrow=1.0, wide=1.3, steps=1)
    assert corr.factor(64) == pytest.approx(1.3)
    slow = StepCorrection()
    _feed(slow, 64, narrow=2.0, wide=2.6)  # the whole machine twice as slow: only the relative price counts
    assert slow.factor(64) == pytest.approx(1.3)
    cheap = StepCorrection()
    _feed(cheap, 64, narrow=1.2, wide=0.9)
    assert cheap.factor(64) == pytest.approx(0.75)


def test_buckets_keep_batch_sizes_apart_and_the_factor_is_clipped():
    corr = StepCorrection(bounds=(0.5, 2.0))
    _feed(corr, 200, narrow=1.0, wide=5.0)
    assert corr.factor(200) == 2.0 and corr.factor(256) == 2.0  # same bucket (128-511), clipped at 2
    assert corr.factor(1) == 1.0 and corr.factor(40) == 1.0  # other buckets: nothing seen
    _feed(corr, 1, narrow=1.0, wide=0.1)
    assert corr.factor(1) == 0.5 and corr.factors() == {0: 0.5, 4: 2.0}
    assert [StepCorrection.bucket(r) for r in (1, 2, 7, 8, 31, 32, 127, 128, 511, 512)] == [0, 1, 1, 2, 2, 3, 3, 4, 4, 5]


def test_older_steps_fade_so_the_factor_follows_a_change():
    corr = StepCorrection(decay=0.8)
    _feed(corr, 64, narrow=1.0, wide=1.5, steps=20)
    assert corr.factor(64) == pytest.approx(1.5)
    _feed(corr, 64, narrow=1.0, wide=1.0, steps=30)
    assert corr.factor(64) == pytest.approx(1.0, abs=0.01)
    exact = StepCorrection(decay=0.8)  # the weighted ratio, computed here from its definition on random steps
    rng = random.Random(0)
    steps = [(rng.random() < 0.5, rng.uniform(0.5, 2.0)) for _ in range(40)]
    for wide, ratio in steps:
        tokens = 128 if wide else 64
        exact.record(64, tokens, ratio * TABLE(64, tokens), TABLE(64, tokens))

    def weighted(kind):
        seen = [(TABLE(64, 128 if kind else 64), r) for w, r in steps if w == kind]
        weights = [0.8 ** (len(seen) - 1 - i) for i in range(len(seen))]
        return sum(w * p * r for w, (p, r) in zip(weights, seen)) / sum(w * p for w, (p, _) in zip(weights, seen))

    expected = min(max(weighted(True) / weighted(False), 0.5), 2.0)
    assert exact.factor(64) == pytest.approx(expected, rel=1e-12)


def test_bad_steps_are_ignored_and_bad_arguments_are_refused():
    corr = StepCorrection()
    for seconds, predicted in ((0.0, 1.0), (1.0, 0.0), (float("nan"), 1.0), (float("inf"), 1.0), (1.0, float("inf"))):
        corr.record(8, 16, seconds, predicted)
    assert corr._sums == {}
    with pytest.raises(ValueError, match="decay"):
        StepCorrection(decay=0.0)
    with pytest.raises(ValueError, match="min_steps"):
        StepCorrection(min_steps=0)
    with pytest.raises(ValueError, match="bounds"):
        StepCorrection(bounds=(1.5, 2.0))


def test_the_factor_prices_wide_steps_only_and_can_turn_a_plan_off():
    corr = StepCorrection()
    _feed(corr, 64, narrow=1.0, wide=1.6)
    priced = corr.apply(TABLE, 64)
    assert priced.wide_factor == pytest.approx(1.6) and priced == TABLE  # same table, corrected prices
    assert priced(64, 64) == TABLE(64, 64) and priced(64, 128) == pytest.approx(1.6 * TABLE(64, 128))
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
    for bucket in range(3):  # now make wide steps look three times as dear as the table says, at 1-31 rows
        corr._sums[bucket] = {False: [1.0, 1.0, 10.0], True: [3.0, 1.0, 10.0]}
    assert corr.factor(1) == corr.factor(3) == 2.0
    assert run() == plain_steps  # every plan refused, exploring too: plain decoding's steps
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
    _feed(corr, 8, narrow=1.0, wide=2.0)
    assert corr.apply(backend.step_cost(), 8) is backend.step_cost()  # an instruction, not a measurement
    assert dataclasses.replace(TABLE, wide_factor=3.0) == TABLE  # the factor is not part of the table
    assert "wide_factor" not in TABLE.to_dict()
