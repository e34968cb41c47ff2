"""Behaviour log-probs and the reused mask of a rollout's responses against a float64 reference (docs/design.md
"Behaviour log-probs"), drafts that carry them, and the coupled keys (an exact keyed sample without old weights)."""

import math

import pytest
import torch
from tiny_models import full_forward_logprobs, tiny_model

from spec_rl.acceptance.mode import RolloutMode
from spec_rl.acceptance.rules import Coupled, Exact, Lenient
from spec_rl.backends.transformers_backend import TransformersBackend
from spec_rl.drafts.cache import CacheKey, RolloutCache
from spec_rl.rollout.old_policy import PolicyVersions
from spec_rl.rollout.speculative import RolloutRequest, SpeculativeRollout
from spec_rl.sampling.distribution import SamplingSettings

PROMPTS = [[3, 11, 12, 13, 14], [3, 15, 16], [3, 17, 18, 19, 20, 21, 22]]


def _rollout(model, rule, cache, **kw):
    return SpeculativeRollout(
        TransformersBackend(model, {1}, pad_id=0),
        cache,
        SamplingSettings(max_tokens=16),
        eos_ids=[1],
        max_model_len=64,
        mode=RolloutMode(rule, tail=0),
        seed=7,
        **kw,
    )


def _requests():
    return [RolloutRequest(p, s, dataset_id=f"p{i}") for i, p in enumerate(PROMPTS) for s in range(6)]


def _nudge(model, seed, scale=0.04):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)


@pytest.mark.parametrize("lenience", [1.0, math.exp(0.5)])
def test_kept_tokens_carry_their_path_probability_over_epochs(lenience):
    model, cache = tiny_model(seed=4), RolloutCache()
    ro = _rollout(model, Lenient(lenience), cache)
    reqs = _requests()
    previous = ro.run(reqs, step=0)
    assert previous.behaviour_logprobs == previous.logprobs  # nothing reused yet
    kept_somewhere = 0
    for step in (1, 2):  # step 2 keeps tokens that were already kept once: their path goes back to step 0
        _nudge(model, step)
        res = ro.run(reqs, step=step)
        for i, req in enumerate(reqs):
            n = res.verified_prefix_len[i]
            lp_new = full_forward_logprobs(model, req.prompt_ids, res.response_ids[i])
            lp_old = torch.tensor(previous.logprobs[i][:n], dtype=torch.float64)
            drafted = torch.tensor(previous.behaviour_logprobs[i][:n], dtype=torch.float64)
            want = drafted + (math.log(lenience) + lp_new[:n] - lp_old).clamp(max=0.0)
            got = torch.tensor(res.behaviour_logprobs[i], dtype=torch.float64)
            assert torch.allclose(got[:n], want, atol=1e-4)
            # the token at n and the generated tail are the current policy's samples
            assert torch.allclose(got[n:], lp_new[n:], atol=1e-4)
            assert res.reused_mask()[i] == [t < n for t in range(len(res.response_ids[i]))]
            stored = cache.lookup(CacheKey.make(req.prompt_ids, req.slot, req.dataset_id), ro.settings)
            assert torch.allclose(stored.behaviour.double(), got, atol=1e-6)
            kept_somewhere += bool(n)
        previous = res
    assert kept_somewhere
    padded = res.padded(pad_id=0)
    assert torch.equal(padded["reused_mask"].sum(1), torch.tensor(res.verified_prefix_len))
    assert torch.allclose(
        padded["behaviour_logprobs"][padded["response_mask"]],
        torch.tensor([x for b in res.behaviour_logprobs for x in b]),
    )


def test_a_draw_without_the_rejected_token_reports_its_renormalised_law():
    model, cache = tiny_model(seed=5), RolloutCache()
    ro = _rollout(model, Lenient(1.0, "without-draft"), cache)
    reqs = _requests()
    first = ro.run(reqs, step=0)
    _nudge(model, 11, scale=0.08)
    res = ro.run(reqs, step=1)
    checked = 0
    for i, req in enumerate(reqs):
        n, draft = res.verified_prefix_len[i], first.response_ids[i]
        if n >= len(draft):
            continue
        lp_new = full_forward_logprobs(model, req.prompt_ids, res.response_ids[i])
        rejected = full_forward_logprobs(model, req.prompt_ids, draft[: n + 1])[n]
        want = lp_new[n] - math.log1p(-math.exp(rejected))
        assert res.behaviour_logprobs[i][n] == pytest.approx(float(want), abs=1e-4)
        checked += 1
    assert checked


@pytest.mark.parametrize("rule", [Exact(), Coupled(), Lenient(1.0, "residual")], ids=lambda r: r.name)
def test_rules_that_sample_the_policy_report_its_logprobs(rule):
    model, cache = tiny_model(seed=6), RolloutCache()
    kw = {"old_policies": PolicyVersions(model, pad_id=0)} if rule.needs_old_policy else {}
    ro = _rollout(model, rule, cache, **kw)
    reqs = _requests()
    ro.run(reqs, step=0)
    if rule.needs_old_policy:
        kw["old_policies"].keep(0)
    _nudge(model, 3)
    res = ro.run(reqs, step=1)
    assert res.stats.accepted_tokens > 0
    assert res.behaviour_logprobs == res.logprobs


def test_coupled_keys_give_the_current_policys_keyed_sample_whatever_the_drafts():
    model, cache = tiny_model(seed=8), RolloutCache()
    reqs = _requests()
    ro = _rollout(model, Coupled(), cache)
    first = ro.run(reqs, step=0)
    again = ro.run(reqs, step=1)  # an unchanged policy decodes the same tokens under the same keys: all reused
    assert again.response_ids == first.response_ids and again.stats.tokens_generated == 0
    _nudge(model, 5)
    res = ro.run(reqs, step=2)
    fresh = _rollout(model, Coupled(), RolloutCache()).run(reqs, step=9)  # no drafts: plain keyed decoding
    assert res.response_ids == fresh.response_ids
    assert 0 < res.stats.accepted_tokens < res.stats.vanilla_tokens
    # point-mass exact acceptance under new keys keeps far less of the same drafts
    exact_cache = RolloutCache()
    exact_cache.update(cache)
    exact = _rollout(model, Exact(), exact_cache).run(reqs, step=3)
    assert exact.stats.accepted_tokens < res.stats.accepted_tokens
