"""The step-cost model and the width plan (spec_rl.backends.step_cost) against brute force."""

from __future__ import annotations

import itertools
import json
import random

import pytest
import torch
from tiny_models import tiny_model

from spec_rl.backends.hf_decode import time_decode_step
from spec_rl.backends.step_cost import ProposalBackoff, StepCost, cost_key, measured_cost, plan_proposals
from spec_rl.backends.transformers_backend import TransformersBackend


def linear_cost(per_token: float, per_step: float = 1.0) -> StepCost:
    """A CPU-like cost: a fixed part per step plus a part per fed token (exactly linear on the grid)."""
    rows, widths = (1, 8, 64, 256), (1, 2, 4, 9)
    return StepCost(rows, widths, tuple(tuple(per_step + per_token * r * w for w in widths) for r in rows))


def _rate(lengths, probs, rows, cost) -> float:
    gain = sum(sum(p**j for j in range(1, n + 1)) for n, p in zip(lengths, probs))
    return (rows + gain) / cost(rows, rows + sum(lengths))


def test_interpolation_is_exact_on_a_linear_grid_and_round_trips():
    cost = linear_cost(0.01, 2.0)
    for rows, tokens in ((1, 1), (3, 7), (100, 500), (256, 2304), (300, 300)):
        assert cost(rows, tokens) == pytest.approx(2.0 + 0.01 * tokens)
    assert StepCost.from_dict(json.loads(json.dumps(cost.to_dict()))) == cost
    with pytest.raises(ValueError, match="not a step-cost table"):
        StepCost.from_dict({"format": "x"})


@pytest.mark.parametrize("padded", [True, False])
def test_plans_match_brute_force_on_random_rows(padded):
    rng = random.Random(3)
    for _ in range(60):
        rows = rng.randint(1, 4)
        lengths = [rng.randint(0, 12 if padded else 3) for _ in range(rows)]  # 12: past the widest measured step
        probs = [rng.random() for _ in range(rows)]
        cost = linear_cost(rng.choice([0.0, 0.01, 0.2, 1.0]), rng.choice([0.1, 1.0]))
        proposals = [list(range(10, 10 + n)) for n in lengths]
        plan = plan_proposals(proposals, probs, cost, padded=padded)
        assert all(p == prop[: len(p)] for p, prop in zip(plan, proposals))  # prefixes of the proposals
        if padded:  # one width for all: row r gets min(w - 1, len_r)
            candidates = [[min(w - 1, n) for n in lengths] for w in range(1, max(lengths) + 2)]
            cost_of = lambda fed: cost(rows, rows * (1 + max(fed)))  # noqa: E731
            best = max((rows + sum(sum(p**j for j in range(1, f + 1)) for f, p in zip(fed, probs))) / cost_of(fed)
                       for fed in candidates)  # fmt: skip
            got = [len(p) for p in plan]
            assert (rows + sum(sum(p**j for j in range(1, f + 1)) for f, p in zip(got, probs))) / cost_of(got) \
                == pytest.approx(best)
        else:  # any per-row lengths
            best = max(_rate(fed, probs, rows, cost) for fed in itertools.product(*[range(n + 1) for n in lengths]))
            assert _rate([len(p) for p in plan], probs, rows, cost) == pytest.approx(best)


def test_width_one_when_speculation_does_not_pay_and_wide_steps_in_the_tail():
    proposals, probs = [[1, 2, 3, 4, 5, 6, 7, 8]] * 256, [0.3] * 256
    cpu = linear_cost(per_token=1e-4, per_step=1e-3)  # a forward costs what its positions cost
    assert all(p == [] for p in plan_proposals(proposals, probs, cpu, padded=True))  # 256 rows, weak drafts: no
    assert all(len(p) == 8 for p in plan_proposals(proposals[:2], [0.99] * 2, cpu, padded=True))  # tail: all of it
    assert all(len(p) == 8 for p in plan_proposals(proposals, [0.3] * 256, StepCost.flat(), padded=True))
    assert plan_proposals([[], []], [0.9, 0.9], cpu, padded=False) == [[], []]


def test_backoff_waits_longer_after_each_refused_plan_and_asks_again_when_one_pays_or_rows_leave():
    backoff = ProposalBackoff(max_wait=8)
    asked = []
    for _ in range(40):  # every plan refuses: asks at steps 0, 2, 5, 10, 19, 28, 37 (waits 1, 2, 4, 8, 8, 8)
        asked.append(backoff.ask(256))
        if asked[-1]:
            backoff.planned(256, fed=False)
    assert [i for i, a in enumerate(asked) if a] == [0, 2, 5, 10, 19, 28, 37]
    backoff = ProposalBackoff(max_wait=8)
    backoff.planned(256, fed=False)
    backoff.planned(256, fed=False)  # waiting 2 steps
    assert not backoff.ask(250)  # a few rows left: still waiting
    assert backoff.ask(192)  # a quarter of the rows left: the cost changed, ask at once
    backoff.planned(192, fed=True)
    assert backoff.wait == 0 and all(backoff.ask(192) for _ in range(5))  # speculation pays: ask every step
    backoff.planned(192, fed=False)
    assert backoff.wait == 1 and not backoff.ask(192) and backoff.ask(192)  # a new refusal starts again at 1
    for bad in (0, -1, 2.5, None, True):
        with pytest.raises(ValueError, match="max_wait must be an integer >= 1"):
            ProposalBackoff(max_wait=bad)


def test_measured_cost_is_cached_per_key_and_flat_on_request(tmp_path, monkeypatch):
    monkeypatch.setenv("SPEC_RL_CACHE", str(tmp_path))
    monkeypatch.delenv("SPEC_RL_STEP_COST", raising=False)
    calls = []

    def timed(rows, width):
        calls.append((rows, width))
        return 0.001 * rows * width

    cost = measured_cost("k1", timed, max_rows=32)
    assert cost.rows == (1, 8, 32) and len(calls) == 3 * len(cost.widths)
    assert measured_cost("k1", timed, max_rows=32) == cost and len(calls) == 3 * len(cost.widths)  # from disk
    (tmp_path / "step-cost" / "k1.json").write_text("{broken")
    assert measured_cost("k1", timed, max_rows=32) == cost  # a damaged file is measured again
    monkeypatch.setenv("SPEC_RL_STEP_COST", "flat")
    assert measured_cost("k2", timed, max_rows=32).source == "flat"


def test_the_transformers_backend_measures_its_own_decode_step(tmp_path, monkeypatch):
    monkeypatch.setenv("SPEC_RL_CACHE", str(tmp_path))
    monkeypatch.delenv("SPEC_RL_STEP_COST", raising=False)
    model = tiny_model(seed=0)
    assert time_decode_step(model, 4, 3, pad_id=0, context=8, repeats=2) > 0
    backend = TransformersBackend(model, eos_ids=[1], pad_id=0, max_batch_size=8)
    cost = backend.step_cost()
    assert cost.rows == (1, 8) and all(s > 0 for row in cost.seconds for s in row)
    key = cost_key("transformers", model, torch.device("cpu"))
    assert (tmp_path / "step-cost" / f"{key}.json").is_file() and backend.step_cost() is cost
