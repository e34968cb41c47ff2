"""A reused draft is always a response the current run could produce (spec_rl.drafts.validity).

Unit part: :func:`draft_views` against a plain-Python reading of the rule, on fresh random drafts and
edge shapes. Distribution part, from the outside of the rollout: a tiny float64 Qwen2 (vocabulary 5,
EOS 0, responses of at most 4 tokens) whose response distribution is enumerated by the chain rule.
For every kind of draft that no longer fits (an EOS inside it, finished "length" under a smaller
budget, filled under a smaller max_model_len, longer than today's budget, an EOS set that grew),
20,000 keyed rollouts are compared by a chi-square test (cells with expected count < 5 pooled,
p > 0.001) with:

* exact acceptance, with and without tail speculation (history drafts): the fresh-sample
  distribution of the current policy under today's budget and EOS set (and token for token what plain
  keyed decoding gives);
* lenient l = 1: the paper's rule worked out by hand (accept d_i with probability
  min(1, p_new / p_old), the token at the first rejection from p_new, a complete valid draft kept
  whole, a prefix-only draft continued by p_new).

Keyed uniforms make every run of this file draw the same samples, so the tests cannot flake.
"""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch
from _stats import chi2_critical
from tiny_models import tiny_model

from spec_rl.acceptance.mode import RolloutMode
from spec_rl.acceptance.rules import Exact, Lenient
from spec_rl.backends.transformers_backend import TransformersBackend
from spec_rl.drafts.cache import CacheKey, RolloutCache
from spec_rl.drafts.history import HistoryIndex
from spec_rl.drafts.validity import DraftView, draft_view, draft_views
from spec_rl.rollout.speculative import RolloutRequest, SpeculativeRollout
from spec_rl.sampling.distribution import SamplingSettings, sampling_log_softmax

EOS = 0
VOCAB = 5
PROMPT = [3, 2]
N = 20000
Z_P001 = 3.090  # standard normal quantile at 1 - 0.001


# ------------------------------------------------------------------ the rule itself
def _reference_view(ids, budget, eos):
    for i, t in enumerate(ids[:budget]):
        if t in eos:
            return DraftView(i + 1, "eos")
    cut = min(len(ids), budget)
    return DraftView(cut, "length" if cut == budget else None)


def test_views_match_the_rule_on_random_drafts():
    rng = random.Random(7)
    for _ in range(50):
        eos = set(rng.sample(range(6), rng.randint(1, 2)))
        drafts = [[rng.randrange(6) for _ in range(rng.randint(0, 9))] for _ in range(rng.randint(1, 12))]
        budgets = [rng.randint(1, 10) for _ in drafts]
        got = draft_views([torch.tensor(d, dtype=torch.int32) for d in drafts], budgets, eos)
        assert got == [_reference_view(d, b, eos) for d, b in zip(drafts, budgets)]
        assert draft_views(drafts, budgets, eos) == got  # lists and tensors alike


@pytest.mark.parametrize(
    "ids, budget, eos, view",
    [
        ([4, 0, 3, 3], 4, {0}, DraftView(2, "eos")),  # EOS inside: cut after it
        ([0, 3], 4, {0}, DraftView(1, "eos")),  # EOS first
        ([4, 3], 4, {0}, DraftView(2, None)),  # shorter than the budget, no EOS: a prefix only
        ([4, 3, 2, 1], 2, {0}, DraftView(2, "length")),  # longer than the budget: cut, complete
        ([4, 3, 0], 2, {0}, DraftView(2, "length")),  # its EOS lies past the budget
        ([4, 3, 0], 3, {0}, DraftView(3, "eos")),  # EOS exactly at the budget
        ([4, 1, 3], 4, {0, 1}, DraftView(2, "eos")),  # the EOS set grew
        ([4, 3, 1], 4, {0}, DraftView(3, None)),  # ended with an EOS id that no longer is one
        ([4], 1, {0}, DraftView(1, "length")),
        ([], 3, {0}, DraftView(0, None)),
    ],
)
def test_views_on_edge_drafts(ids, budget, eos, view):
    assert draft_view(ids, budget, eos) == view
    assert view.complete == (view.finish_reason is not None)


def test_views_refuse_bad_arguments():
    with pytest.raises(ValueError, match="same length"):
        draft_views([[1]], [1, 2], {0})
    with pytest.raises(ValueError, match="budget"):
        draft_view([1, 2], 0, {0})
    with pytest.raises(ValueError, match="eos_ids"):
        draft_view([1, 2], 3, set())


# ------------------------------------------------------------------ enumerated distributions
class Enumerator:
    """The sampling distribution of a float64 model at every prefix, and response distributions by the chain rule."""

    def __init__(self, model, settings: SamplingSettings, eos: set[int]):
        self.model, self.settings, self.eos = model, settings, eos
        self._probs: dict[tuple, torch.Tensor] = {}

    def probs(self, context: tuple) -> torch.Tensor:
        if context not in self._probs:
            with torch.no_grad():
                logits = self.model(input_ids=torch.tensor([list(context)])).logits[0, -1].double()
            s = self.settings
            self._probs[context] = sampling_log_softmax(logits, s.temperature, s.top_k, s.top_p, torch.float64).exp()
        return self._probs[context]

    def fresh(self, prefix: tuple, budget: int) -> dict[tuple, float]:
        """P(response) of decoding on from PROMPT + prefix until EOS or ``budget`` tokens in all."""
        out: dict[tuple, float] = {}

        def walk(resp: tuple, p: float) -> None:
            if resp and (resp[-1] in self.eos or len(resp) == budget):
                out[resp] = out.get(resp, 0.0) + p
                return
            probs = self.probs(tuple(PROMPT) + resp)
            for t in range(VOCAB):
                if probs[t] > 0:
                    walk(resp + (t,), p * float(probs[t]))

        walk(tuple(prefix), 1.0)
        return out

    def lenient(self, draft: list[int], old_lps: list[float], budget: int) -> dict[tuple, float]:
        """The paper's rule at l = 1 on one fixed stored draft, worked out by hand (module docstring)."""
        view = draft_view(draft, budget, self.eos)
        valid = tuple(draft[: view.length])
        out: dict[tuple, float] = {}
        reach = 1.0  # P(the first n tokens are accepted)
        for n in range(view.length + 1):
            if n == view.length:
                tail = {valid: 1.0} if view.complete else self.fresh(valid, budget)
                for y, p in tail.items():
                    out[y] = out.get(y, 0.0) + reach * p
                break
            p_new = float(self.probs(tuple(PROMPT) + valid[:n])[valid[n]])
            accept = min(1.0, p_new / math.exp(old_lps[n]))
            for y, p in self.fresh(valid[:n], budget).items():  # rejected at n: the token at n from p_new
                out[y] = out.get(y, 0.0) + reach * (1.0 - accept) * p
            reach *= accept
        return out


def assert_fits_enumeration(responses: list[tuple], probs: dict[tuple, float]) -> None:
    """Chi-square of the observed responses against ``probs`` (expected < 5 pooled), p > 0.001."""
    counts = Counter(responses)
    impossible = [y for y in counts if probs.get(y, 0.0) <= 0.0]
    assert not impossible, (
        f"responses of probability zero occurred: {impossible[:5]} ({sum(counts[y] for y in impossible)} times)"
    )
    total = len(responses)
    cells = sorted(probs, key=probs.get)
    stat, pooled_obs, pooled_exp, df = 0.0, 0, 0.0, -1
    for y in cells:
        e = probs[y] * total
        if e < 5:
            pooled_obs, pooled_exp = pooled_obs + counts.get(y, 0), pooled_exp + e
            continue
        stat += (counts.get(y, 0) - e) ** 2 / e
        df += 1
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        df += 1
    assert df >= 1
    crit = chi2_critical(df, Z_P001)
    assert stat < crit, f"chi-square {stat:.1f} >= {crit:.1f} (df {df}, p < 0.001)"


# ------------------------------------------------------------------ rollouts
def _model(seed: int):
    return tiny_model(vocab_size=VOCAB, eos=(EOS,), seed=seed, layers=1, hidden=16).double()


def _requests(n: int) -> list[RolloutRequest]:
    return [RolloutRequest(list(PROMPT), slot=s) for s in range(n)]


def _filled(draft: list[int], old_lps: list[float], finish: str, settings: SamplingSettings, n: int) -> RolloutCache:
    """A cache holding ``draft`` for the first ``n`` slots of PROMPT (as a user could have filled it)."""
    cache = RolloutCache()
    cache.store(CacheKey.make(PROMPT, 0), draft, old_lps, finish, version=0, settings=settings)
    stored = cache.lookup(CacheKey.make(PROMPT, 0), settings)
    cache._entries.update(
        {CacheKey.make(PROMPT, s).digest: stored for s in range(1, n)}
    )  # the same Draft, no re-validation
    return cache


def _rollout(model, cache, settings, *, eos=(EOS,), max_model_len=16, rule=Exact(), history=None):
    """``rule`` None: no drafts (vanilla); tail speculation exactly when a history is given."""
    backend = TransformersBackend(model, eos_ids=list(eos), pad_id=4, max_batch_size=4096)
    mode = RolloutMode(rule, tail=3 if history is not None else 0)
    return SpeculativeRollout(backend, cache, settings, list(eos), max_model_len, mode=mode, seed=11, history=history)


def _history(responses: list[list[int]]) -> HistoryIndex:
    """A history index holding ``responses`` for PROMPT (the rollout keys a group by its slot-0 draft key)."""
    index = HistoryIndex()
    for r in responses:
        index.add(CacheKey.make(PROMPT, 0).digest, r)
    return index


S4 = SamplingSettings(max_tokens=4)
OLD_LPS = [-0.9, -1.4, -0.6, -2.0]
# (name, stored draft, its finish reason, settings it was stored under, today's settings, today's EOS set)
FIXED_DRAFTS = [
    ("eos-inside", [4, 0, 3, 3], "length", S4, S4, (EOS,)),
    ("length-shorter-than-budget", [4, 3], "length", SamplingSettings(max_tokens=2), S4, (EOS,)),
    ("longer-than-budget", [4, 3, 2, 1], "length", S4, SamplingSettings(max_tokens=2), (EOS,)),
    ("eos-set-grew", [4, 1, 3, 3], "length", S4, S4, (EOS, 1)),
]


@pytest.fixture(scope="module")
def policy():
    """The current policy (float64) and its plain keyed decoding of the N requests, per (settings, EOS set)."""
    model = _model(seed=3)
    plain: dict[tuple, list[list[int]]] = {}

    def decode(settings: SamplingSettings, eos: tuple) -> list[list[int]]:
        if (settings, eos) not in plain:
            out = _rollout(model, RolloutCache(), settings, eos=eos, rule=None).run(_requests(N), step=1)
            plain[(settings, eos)] = out.response_ids
        return plain[(settings, eos)]

    return model, decode


@pytest.mark.parametrize("case", FIXED_DRAFTS, ids=[c[0] for c in FIXED_DRAFTS])
def test_stored_drafts_give_fresh_samples_exact_and_the_paper_rule_lenient(case, policy):
    _, draft, finish, stored, today, eos = case
    model, decode = policy
    enum = Enumerator(model, today, set(eos))
    budget = today.budget(len(PROMPT), 16)
    plain = decode(today, eos)
    assert_fits_enumeration([tuple(r) for r in plain], enum.fresh((), budget))
    filled = _filled(draft, OLD_LPS[: len(draft)], finish, stored, N)
    for history in (None, _history([draft, [4, 3, 3, 3], [2, 2, 0]])):
        out = _rollout(model, _copy(filled), today, eos=eos, history=history).run(_requests(N), step=1)
        # token for token what plain keyed decoding gives, hence the same chi-square against the enumeration
        assert out.response_ids == plain
        assert sum(out.draft_found) == N and out.stats.accepted_tokens > 0
    out = _rollout(model, _copy(filled), today, eos=eos, rule=Lenient(1.0)).run(_requests(N), step=1)
    assert_fits_enumeration([tuple(r) for r in out.response_ids], enum.lenient(draft, OLD_LPS, budget))
    _assert_consistent(out, budget, set(eos))


def _assert_consistent(out, budget: int, eos: set[int]) -> None:
    """Finish reasons agree with the tokens: "eos" iff the response ends with EOS, else it fills the budget."""
    for r, f in zip(out.response_ids, out.finish_reasons):
        assert (f == "eos") == (r[-1] in eos) and all(t not in eos for t in r[:-1])
        assert f == "eos" or len(r) == budget


def test_drafts_filled_under_a_smaller_max_model_len_are_continued(policy):
    # Filled by the rollout itself under max_model_len=5 (budget 3) with older weights, reused under 16 (budget 4).
    new, decode = policy
    old = _model(seed=4)
    cache, history = RolloutCache(), HistoryIndex()
    filled = _rollout(old, cache, S4, max_model_len=5, rule=None, history=history).run(_requests(N), step=0)
    assert max(len(r) for r in filled.response_ids) == 3 and "length" in filled.finish_reasons
    enum_new, enum_old = Enumerator(new, S4, {EOS}), Enumerator(old, S4, {EOS})
    plain = decode(S4, (EOS,))
    assert_fits_enumeration([tuple(r) for r in plain], enum_new.fresh((), 4))
    for h in (None, history):
        out = _rollout(new, _copy(cache), S4, history=h).run(_requests(N), step=1)
        assert out.response_ids == plain
    # lenient: a mixture over the stored drafts (each drawn from the old policy with budget 3)
    out = _rollout(new, _copy(cache), S4, rule=Lenient(1.0)).run(_requests(N), step=1)
    mixture: dict[tuple, float] = {}
    for d, p_d in enum_old.fresh((), 3).items():
        old_lps = [math.log(float(enum_old.probs(tuple(PROMPT) + d[:i])[d[i]])) for i in range(len(d))]
        for y, p in enum_new.lenient(list(d), old_lps, 4).items():
            mixture[y] = mixture.get(y, 0.0) + p_d * p
    assert_fits_enumeration([tuple(r) for r in out.response_ids], mixture)
    _assert_consistent(out, 4, {EOS})


def _copy(cache: RolloutCache) -> RolloutCache:
    other = RolloutCache()
    other.update(cache)
    return other


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.parametrize(
    "settings", [SamplingSettings(temperature=0.7, top_k=3, max_tokens=4), SamplingSettings(top_p=0.9, max_tokens=4)]
)
@pytest.mark.parametrize("case", FIXED_DRAFTS, ids=[c[0] for c in FIXED_DRAFTS])
def test_long_variant_other_sampling_settings(case, settings):
    _, draft, finish, _, today, eos = case
    today = SamplingSettings(
        temperature=settings.temperature, top_k=settings.top_k, top_p=settings.top_p, max_tokens=today.max_tokens
    )
    stored = SamplingSettings(
        temperature=settings.temperature,
        top_k=settings.top_k,
        top_p=settings.top_p,
        max_tokens=len(draft) if finish == "length" else 4,
    )
    model = _model(seed=5)
    enum = Enumerator(model, today, set(eos))
    budget = today.budget(len(PROMPT), 16)
    for history in (None, _history([draft, [4, 3, 3, 3]])):
        out = _rollout(
            model, _filled(draft, OLD_LPS[: len(draft)], finish, stored, 2 * N), today, eos=eos, history=history
        ).run(_requests(2 * N), step=2)
        assert_fits_enumeration([tuple(r) for r in out.response_ids], enum.fresh((), budget))
