"""The step-cost model and the width plan (spec_rl.backends.step_cost) against brute force."""

from __future__ import annotations

import itertools
import json
import random

import pytest
import torch
from tiny_models import tiny_model

from spec_rl.backends.hf_decode import DecodeStepTimer, time_decode_step
from spec_rl.backends.step_cost import (
    MEASURE_ROUNDS,
    MEASURED_CONTEXTS,
    MIN_GAIN,
    ProposalBackoff,
    StepCost,
    cost_key,
    measured_contexts,
    measured_cost,
    monotone_fit,
    plan_proposals,
)
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
            rate = lambda fed: (rows + sum(sum(p**j for j in range(1, f + 1)) for f, p in zip(fed, probs))) / cost_of(fed)  # noqa: E731
        else:  # any per-row lengths
            candidates = list(itertools.product(*[range(n + 1) for n in lengths]))
            rate = lambda fed: _rate(fed, probs, rows, cost)  # noqa: E731
        plain, best = rate([0] * rows), max(rate(fed) for fed in candidates)
        got = [len(p) for p in plan]
        if best >= (1 + MIN_GAIN) * plain * (1 + 1e-9):  # the best plan, when it beats plain decoding by the margin
            assert rate(got) == pytest.approx(best)
        elif best < (1 + MIN_GAIN) * plain * (1 - 1e-9):  # else no proposal at all
            assert got == [0] * rows


def test_width_one_when_speculation_does_not_pay_and_wide_steps_in_the_tail():
    proposals, probs = [[1, 2, 3, 4, 5, 6, 7, 8]] * 256, [0.3] * 256
    cpu = linear_cost(per_token=1e-4, per_step=1e-3)  # a forward costs what its positions cost
    assert all(p == [] for p in plan_proposals(proposals, probs, cpu, padded=True))  # 256 rows, weak drafts: no
    assert all(len(p) == 8 for p in plan_proposals(proposals[:2], [0.99] * 2, cpu, padded=True))  # tail: all of it
    assert all(len(p) == 8 for p in plan_proposals(proposals, [0.3] * 256, StepCost.flat(), padded=True))
    assert plan_proposals([[], []], [0.9, 0.9], cpu, padded=False) == [[], []]


@pytest.mark.parametrize("padded", [True, False])
def test_a_plan_must_beat_plain_decoding_by_the_margin(padded):
    cost = StepCost((1,), (1, 2), ((1.0, 1.4),))  # one fed token more costs 1.4x
    assert plan_proposals([[7]], [0.45], cost, padded) == [[]]  # 1.45 / 1.4: 4% more tokens per second, within the error
    assert plan_proposals([[7]], [0.4 + 1.4 * MIN_GAIN - 0.01], cost, padded) == [[]]
    assert plan_proposals([[7]], [0.4 + 1.4 * MIN_GAIN + 0.01], cost, padded) == [[7]]
    assert plan_proposals([[7]], [0.6], cost, padded) == [[7]]  # 14% more: fed


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

    def timed(rows, width, context):
        calls.append((rows, width, context))
        return 0.001 * rows * width

    cost = measured_cost("k1", timed, max_rows=32, contexts=(64,))
    points = 3 * len(cost.widths)
    assert cost.rows == (1, 8, 32) and len(calls) == MEASURE_ROUNDS * points and {c for _, _, c in calls} == {64}
    assert calls[:points] == calls[points : 2 * points]  # whole rounds over the grid, not one point at a time
    assert cost.seconds == tuple(tuple(0.001 * r * w for w in cost.widths) for r in cost.rows)
    assert cost.context == 64 and cost.per_position == () and cost(8, 16, context=5000) == cost(8, 16)
    assert measured_cost("k1", timed, max_rows=32) == cost and len(calls) == MEASURE_ROUNDS * points  # from disk
    (tmp_path / "step-cost" / "k1.json").write_text("{broken")
    assert measured_cost("k1", timed, max_rows=32, contexts=(64,)) == cost  # a damaged file is measured again
    monkeypatch.setenv("SPEC_RL_STEP_COST", "flat")
    assert measured_cost("k2", timed, max_rows=32).source == "flat"
    for bad in ((), (0,), (64, 64), (320, 64), (1, 2, 3)):
        with pytest.raises(ValueError, match="contexts must be one or two ascending positive counts"):
            measured_cost("k4", timed, max_rows=32, contexts=bad)


def _attention_like(rows, width, context):
    """A step: a fixed part, a part per fed token, and a part per cached position read (once per row, however
    many tokens the row feeds: attention over the cache)."""
    return 1e-3 + 1e-4 * rows * width + 2e-6 * rows * context


def test_the_context_axis_is_linear_between_and_past_the_two_measured_contexts(tmp_path, monkeypatch):
    monkeypatch.setenv("SPEC_RL_CACHE", str(tmp_path))
    monkeypatch.delenv("SPEC_RL_STEP_COST", raising=False)
    contexts = []
    cost = measured_cost("ctx", lambda r, w, c: contexts.append(c) or _attention_like(r, w, c), max_rows=256)
    assert sorted(set(contexts)) == list(MEASURED_CONTEXTS) and cost.context == MEASURED_CONTEXTS[0]
    for rows, width in ((1, 1), (8, 2), (100, 4), (256, 9), (200, 7)):
        for context in (64, 100, 320, 700):
            assert cost(rows, rows * width, context) == pytest.approx(_attention_like(rows, width, context))
        assert cost(rows, rows * width, 10) == cost(rows, rows * width, None) == pytest.approx(_attention_like(rows, width, 64))
    assert StepCost.from_dict(json.loads(json.dumps(cost.to_dict()))) == cost


def test_noisy_context_readings_still_give_a_cost_that_never_falls_with_rows_width_or_context(tmp_path, monkeypatch):
    monkeypatch.setenv("SPEC_RL_CACHE", str(tmp_path))
    monkeypatch.delenv("SPEC_RL_STEP_COST", raising=False)
    rng = random.Random(5)
    cost = measured_cost("noisy", lambda r, w, c: _attention_like(r, w, c) * rng.uniform(0.5, 2.0), max_rows=256)
    assert all(x >= 0 for row in cost.per_position for x in row)
    grid = [(r, w, c) for r in (1, 5, 8, 60, 256) for w in (1, 2, 4, 9, 12) for c in (30, 64, 200, 320, 900)]
    for r, w, c in grid:
        here = cost(r, r * w, c)
        assert cost(r, r * (w + 1), c) >= here - 1e-12 and cost(r, r * w, c + 50) >= here - 1e-12
        assert cost(r + 1, (r + 1) * w, c) >= here - 1e-12


def test_at_long_contexts_the_plan_verifies_more():
    """Attention reads each row's cache once per step: the longer it is, the less an extra fed token adds."""
    cost = StepCost((1, 8, 64, 256), (1, 2, 4, 9),
                    tuple(tuple(_attention_like(r, w, 64) for w in (1, 2, 4, 9)) for r in (1, 8, 64, 256)),
                    context=64, per_position=tuple(tuple(2e-6 * r for _ in range(4)) for r in (1, 8, 64, 256)))  # fmt: skip
    widths = {}
    for context in (64, 300, 1000):
        for a in (0.3, 0.5, 0.7, 0.9):
            plan = plan_proposals([[1] * 8] * 256, [a] * 256, cost, padded=True, context=context)
            widths[context, a] = len(plan[0])
    for a in (0.3, 0.5, 0.7, 0.9):
        assert widths[64, a] <= widths[300, a] <= widths[1000, a]
    assert widths[64, 0.5] < widths[1000, 0.5]


def test_measured_contexts_fit_the_model():
    assert measured_contexts(None) == measured_contexts(4096) == MEASURED_CONTEXTS == (64, 320)
    assert measured_contexts(384) == (64, 320)
    assert measured_contexts(200) == (64, 190)  # the long context cut to fit the widest step
    assert measured_contexts(100) == (64,)  # no long context well past the short one
    assert measured_contexts(40) == (30,)


def test_each_point_keeps_its_fastest_round(tmp_path, monkeypatch):
    monkeypatch.setenv("SPEC_RL_CACHE", str(tmp_path))
    monkeypatch.delenv("SPEC_RL_STEP_COST", raising=False)
    rounds = iter(range(10**6))

    def timed(rows, width, context):  # a slow spell: the first round reads 3x, later ones 1x
        return 0.001 * rows * width * (3.0 if next(rounds) < 2 * 5 else 1.0)

    cost = measured_cost("k3", timed, max_rows=8, contexts=(64,))
    assert cost.seconds == tuple(tuple(0.001 * r * w for w in cost.widths) for r in cost.rows)


def _brute_isotonic(row):
    """The least-squares non-decreasing fit by brute force over pooled segmentations (small rows only)."""
    best, n = None, len(row)
    for cuts in itertools.product([0, 1], repeat=n - 1):
        fit, start = [], 0
        for i in range(n):
            if i == n - 1 or cuts[i]:
                seg = row[start : i + 1]
                fit += [sum(seg) / len(seg)] * len(seg)
                start = i + 1
        if all(a <= b + 1e-12 for a, b in zip(fit, fit[1:])):
            err = sum((a - b) ** 2 for a, b in zip(fit, row))
            if best is None or err < best[0] - 1e-12:
                best = (err, fit)
    return best[1]


def test_monotone_fit_is_the_isotonic_fit_per_row_then_non_decreasing_in_rows():
    rng = random.Random(4)
    for _ in range(200):
        n_rows, n_w = rng.randint(1, 4), rng.randint(1, 6)
        table = [[rng.uniform(0.5, 2.0) for _ in range(n_w)] for _ in range(n_rows)]
        fit = monotone_fit(table)
        widths_only = [_brute_isotonic(row) for row in table]
        assert fit[0] == pytest.approx(widths_only[0])
        for i in range(1, n_rows):
            assert fit[i] == pytest.approx([max(a, b) for a, b in zip(fit[i - 1], widths_only[i])])
        for row in fit:
            assert all(a <= b + 1e-12 for a, b in zip(row, row[1:]))
        for w in range(n_w):
            assert all(fit[i][w] <= fit[i + 1][w] + 1e-12 for i in range(n_rows - 1))
    assert monotone_fit([[1.0, 2.0, 3.0], [2.0, 3.0, 4.0]]) == ((1.0, 2.0, 3.0), (2.0, 3.0, 4.0))  # monotone: unchanged


def test_the_transformers_backend_measures_its_own_decode_step(tmp_path, monkeypatch):
    monkeypatch.setenv("SPEC_RL_CACHE", str(tmp_path))
    monkeypatch.delenv("SPEC_RL_STEP_COST", raising=False)
    model = tiny_model(seed=0)
    assert time_decode_step(model, 4, 3, pad_id=0, context=8, repeats=2) > 0
    fed = []
    hook = model.register_forward_hook(lambda mod, args, kwargs, out: fed.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)
    timer = DecodeStepTimer(model, pad_id=0, repeats=2)
    for context in (8, 8, 20):
        for width in (1, 2, 5):
            assert timer(4, width, context) > 0
    hook.remove()
    assert [f for f in fed if f[1] > 5] == [(4, 8), (4, 20)]  # one prefill per (rows, context), every width after it
    assert timer._batch[1].cache.get_seq_length() == 20 and timer._batch[1].width == 20  # cropped back after each run
    backend = TransformersBackend(model, eos_ids=[1], pad_id=0, max_batch_size=8)
    cost = backend.step_cost()
    assert cost.rows == (1, 8) and all(s > 0 for row in cost.seconds for s in row)
    key = cost_key("transformers", model, torch.device("cpu"))
    assert (tmp_path / "step-cost" / f"{key}.json").is_file() and backend.step_cost() is cost


class _Oracle:
    """Proposes the tokens a plain run emitted next (every proposal is kept): speculation always has drafts."""

    def __init__(self, tokens):
        self.tokens, self.done = list(tokens), 0

    def propose(self, limit, fill=0):
        return self.tokens[self.done : self.done + limit]  # what follows the last emitted token

    def update(self, proposal, emitted):
        self.done += len(emitted)

    def acceptance(self):
        return 0.9


def _backend(kind: str, model, cost):
    if kind == "paged":
        from spec_rl.engine import PagedEngine

        return PagedEngine(model, eos_ids={1}, pad_id=0, block_size=4, num_blocks=256, step_cost=cost)
    return TransformersBackend(model, eos_ids=[1], pad_id=0, step_cost=cost)


@pytest.mark.parametrize("kind", ["transformers", "paged"])
def test_set_step_cost_switches_the_width_policy_never_a_token(kind):
    from spec_rl.sampling.distribution import SamplingSettings

    model = tiny_model(seed=3)
    model = model.double() if kind == "transformers" else model  # the paged cache holds fp32 at most
    dear = linear_cost(per_token=10.0, per_step=0.0)  # every fed token costs a whole step: width 1 only
    backend = _backend(kind, model, dear)
    contexts, settings = [[2, 3, 4], [5, 6], [7, 8, 9, 10]], SamplingSettings(max_tokens=12)
    plain = backend.generate(contexts, [12] * 3, settings, seed=5)
    runs = {}
    for name, cost in (("dear", dear), ("flat", StepCost.flat())):
        backend.set_step_cost(cost)
        assert backend.step_cost() is cost
        before = backend.stats.decode_steps
        out = backend.generate(contexts, [12] * 3, settings, seed=5, proposers=[_Oracle(c.token_ids) for c in plain])
        assert [c.token_ids for c in out] == [c.token_ids for c in plain]  # the width changes steps, never a token
        runs[name] = backend.stats.decode_steps - before
    assert runs["flat"] < runs["dear"]
    with pytest.raises(TypeError, match="cost must be a StepCost or None"):
        backend.set_step_cost({"rows": [1]})


def test_a_loop_explores_once_where_proposals_that_are_kept_would_pay():
    cpu = linear_cost(per_token=1e-4, per_step=1e-3)
    offered = [[5, 6, 7]] * 8 + [[]] * 2
    refused = [[] for _ in offered]
    backoff = ProposalBackoff()
    assert backoff.explore(refused, offered, cpu, padded=True) == [[5]] * 8 + [[]] * 2  # first proposed token each
    assert backoff.explore(refused, offered, cpu, padded=False) == refused  # once per decode loop
    steep = StepCost((1, 64), (1, 9), ((1.0, 9.0), (64.0, 576.0)))  # a fed token costs a whole step: never pays
    assert ProposalBackoff().explore(refused, offered, steep, padded=True) == refused
    fed = ProposalBackoff()
    plan = [[5]] * 8 + [[]] * 2
    assert fed.explore(plan, offered, cpu, padded=True) is plan and fed.explored  # a plan that feeds: no exploring
    assert fed.explore(refused, offered, cpu, padded=True) == refused


class _Learner(_Oracle):
    """An oracle that estimates its acceptance from its record (uniform prior: 1/2 before any test)."""

    def __init__(self, tokens):
        super().__init__(tokens)
        self.kept = self.tested = 0

    def update(self, proposal, emitted):
        kept = next((i for i, (a, b) in enumerate(zip(proposal, emitted)) if a != b), min(len(proposal), len(emitted)))
        self.kept += kept
        self.tested += kept + (kept < len(proposal))
        super().update(proposal, emitted)

    def acceptance(self):
        return (self.kept + 1) / (self.tested + 2)


def test_exploring_starts_speculation_that_a_prior_of_one_half_would_never_try():
    from spec_rl.sampling.distribution import SamplingSettings

    model = tiny_model(seed=3).double()
    # one more fed token costs 1.4x a step: (1 + a) / 1.4 beats plain decoding by MIN_GAIN above a = 0.54, not at
    # the prior's 1/2
    cost = StepCost((1, 64), (1, 2, 3), ((1.0, 1.4, 1.8), (64.0, 89.6, 115.2)))
    assert not any(plan_proposals([[5, 6]] * 3, [0.5] * 3, cost, padded=True))
    assert all(plan_proposals([[5, 6]] * 3, [2 / 3] * 3, cost, padded=True))
    backend = TransformersBackend(model, eos_ids=[1], pad_id=0, step_cost=cost)
    contexts, settings = [[2, 3, 4], [5, 6], [7, 8, 9, 10]], SamplingSettings(max_tokens=16)
    plain = backend.generate(contexts, [16] * 3, settings, seed=5)
    steps = backend.stats.decode_steps
    out = backend.generate(contexts, [16] * 3, settings, seed=5, proposers=[_Learner(c.token_ids) for c in plain])
    assert [c.token_ids for c in out] == [c.token_ids for c in plain]
    assert backend.stats.decode_steps - steps <= steps / 2  # explored once, then kept speculating (plain: as many)
