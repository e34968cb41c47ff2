"""The framework-neutral request builder (no trainer library needed)."""

from __future__ import annotations

import math

import pytest
import torch

from spec_rl.cache import CacheKey, RolloutCache
from spec_rl.integrations.requests import SpecRequestBuilder, check_server_settings
from spec_rl.philox import mix_seed
from spec_rl.sampling import SamplingSettings
from spec_rl.verify import verify

S = SamplingSettings(temperature=1.0, max_tokens=6)


def builder(cache=None, max_model_len=10, **kw):
    return SpecRequestBuilder(cache if cache is not None else RolloutCache(), S, max_model_len, [1], **kw)


def test_settings_checks():
    check_server_settings(S)  # plain sampling at T = 1 is fine with raw prompt logprobs
    check_server_settings(SamplingSettings(temperature=0.6, top_k=5), "processed")
    with pytest.raises(ValueError, match="temperature=0.6"):
        check_server_settings(SamplingSettings(temperature=0.6))
    with pytest.raises(ValueError, match="top_k=5"):
        check_server_settings(SamplingSettings(top_k=5))
    with pytest.raises(ValueError, match="prompt_logprobs_mode"):
        check_server_settings(S, "scaled")
    with pytest.raises(ValueError, match="repetition_penalty"):
        check_server_settings(S, repetition_penalty=1.2)
    with pytest.raises(ValueError, match="processed_logprobs"):
        check_server_settings(S, logprobs_mode="processed_logits")
    with pytest.raises(ValueError, match="eos_ids"):
        SpecRequestBuilder(RolloutCache(), S, 10, [])


def test_plan_budget_rows_and_verify():
    cache = RolloutCache()
    b = builder(cache, max_model_len=10, lenience=1.0, seed=3)
    prompt = [7, 8, 9]
    assert b.plan(prompt, 0).scoring_ids is None  # no draft yet
    key = CacheKey.make(prompt, 1)
    cache.store(key, [4, 5, 6], [-1.0, -2.0, -0.5], "eos", 2, S)
    plan = b.plan(prompt, 1)
    assert plan.budget == min(6, 10 - 3) and plan.scoring_ids == [7, 8, 9, 4, 5, 6]
    # verl's layout: row j is the log-prob of position j + 1; a dummy row ends it
    rows = [[-9.0], [-9.0], [-1.5], [-2.5], [-0.25], [0.0]]
    ids = [[8], [9], [4], [5], [6], [0]]
    lp = b.draft_logprobs_from_rows(plan, rows, ids)
    assert lp == [-1.5, -2.5, -0.25]
    with pytest.raises(ValueError, match="scored token 5 at response position 0"):
        b.draft_logprobs_from_rows(plan, rows, [[8], [9], [5], [5], [6], [0]])
    with pytest.raises(ValueError, match="prompt-logprob rows"):
        b.draft_logprobs_from_rows(plan, rows[:3])
    v = b.verify(plan, lp, step=None)
    assert v.step == 3  # draft version 2 + 1 when the server reports no step
    expect = verify(torch.tensor([[4, 5, 6]]), torch.tensor([[-1.0, -2.0, -0.5]]), new_logprobs=torch.tensor([lp]),
                    lenience=1.0, seed=mix_seed(3, 3), uids=torch.tensor([key.uid]), backend="reference")
    assert v.n == int(expect.accepted_len[0]) and v.prefix_ids == [4, 5, 6][: v.n]
    cont = b.continuation(plan, v)
    if v.full_reuse:
        assert cont is None
    else:
        assert cont.context_ids == prompt + [4, 5, 6][: v.n] and cont.max_tokens == plan.budget - v.n
    with pytest.raises(ValueError, match="one per draft token"):
        b.verify(plan, [-1.0])


def test_cut_draft_keeps_the_scoring_sample_and_assembles():
    cache = RolloutCache()
    b = builder(cache, max_model_len=8, lenience=math.inf)
    prompt = [7, 8, 9]  # budget = min(6, 8 - 3) = 5; scoring may hold 8 - 3 - 1 = 4 draft tokens
    cache.store(CacheKey.make(prompt, 0), [4, 5, 6, 2, 3], [-1.0] * 5, "length", 0, S)
    plan = b.plan(prompt, 0)
    assert plan.draft_ids == [4, 5, 6, 2] and plan.budget == 5
    v = b.verify(plan, [-1.0, -1.1, -0.9, -1.2], step=4, scoring_sample=([11], [-0.7]))
    assert v.n == 4 and not v.full_reuse and v.prefix_ids == [4, 5, 6, 2, 11] and v.sampled == 1
    assert b.continuation(plan, v) is None  # budget used up by the sampled token
    res = b.assemble(plan, v, [], [])
    assert res.response_ids == [4, 5, 6, 2, 11]
    assert res.logprobs == pytest.approx([-1.0, -1.1, -0.9, -1.2, -0.7], abs=1e-6)  # float32 round trip
    assert res.finish_reason == "length" and res.metrics["tokens_generated"] == 1
    stored = cache.lookup(CacheKey.make(prompt, 0), S)
    assert stored.token_ids.tolist() == [4, 5, 6, 2, 11] and stored.version == 4
    with pytest.raises(ValueError, match="3 tokens but 1 log-probs"):
        b.assemble(plan, b.verify(plan, [-1.0] * 4, step=4), [1, 2, 3], [-0.1])


def test_no_draft_path_and_eos_finish():
    cache = RolloutCache()
    b = builder(cache)
    plan = b.plan([5, 6], 0, "ds:1")
    v = b.verify(plan, None)
    cont = b.continuation(plan, v)
    assert v.n == 0 and cont.context_ids == [5, 6] and cont.max_tokens == 6
    res = b.assemble(plan, v, [3, 1], [-0.5, -0.25], step=9)
    assert res.finish_reason == "eos" and cache.lookup(CacheKey.make([5, 6], 0, "ds:1"), S).version == 9
    with pytest.raises(ValueError, match="no room"):
        b.plan(list(range(10)), 0)
