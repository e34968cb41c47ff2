"""The framework-neutral request builder (no trainer library needed), lenient and exact acceptance."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch
from _stats import assert_fits
from fake_server import FixedServer

from spec_rl.acceptance.dispatch import VerifyOptions, verify_logprobs
from spec_rl.acceptance.mode import MODES, RolloutMode
from spec_rl.acceptance.rules import Exact, Lenient
from spec_rl.drafts.cache import CacheKey, RolloutCache
from spec_rl.integrations.exact import draw_continuation, residual_seeds
from spec_rl.integrations.requests import ContinuationRequest, SpecRequestBuilder, check_server_settings
from spec_rl.sampling.distribution import SamplingSettings
from spec_rl.sampling.philox import mix_seed

S = SamplingSettings(temperature=1.0, max_tokens=6)


def builder(cache=None, max_model_len=10, **kw):
    kw.setdefault("mode", "spec")  # the paper's rule (the adapters' default is exact)
    return SpecRequestBuilder(cache if cache is not None else RolloutCache(), S, max_model_len, [1], **kw)


def lenient(lenience: float, draw: str = "policy") -> RolloutMode:
    """The lenient rule as the adapters build it (no tail speculation on a server)."""
    return RolloutMode(Lenient(lenience, draw), tail=0)


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
    with pytest.raises(ValueError, match="mode must be one of"):
        builder(mode="lenient")


def test_plan_budget_rows_and_verify():
    cache = RolloutCache()
    b = builder(cache, max_model_len=10, mode=lenient(1.0), seed=3)
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
    expect = verify_logprobs(
        torch.tensor([[4, 5, 6]]),
        torch.tensor([[-1.0, -2.0, -0.5]]),
        torch.tensor([lp]),
        seed=mix_seed(3, 3),
        uids=torch.tensor([key.uid]),
        options=VerifyOptions(mode=Lenient(1.0), backend="reference"),
    )
    assert v.n == int(expect.accepted_len[0]) and plan.tokens == [4, 5, 6][: v.n]
    cont = b.continuation(plan, v)
    if v.full_reuse:
        assert cont is None
    else:
        assert cont.context_ids == prompt + [4, 5, 6][: v.n] and cont.max_tokens == plan.budget - v.n
    with pytest.raises(ValueError, match="one per draft token"):
        b.verify(plan, [-1.0])


def test_cut_draft_keeps_the_scoring_sample_and_assembles():
    cache = RolloutCache()
    b = builder(cache, max_model_len=8, mode=lenient(math.inf))
    prompt = [7, 8, 9]  # budget = min(6, 8 - 3) = 5; scoring may hold 8 - 3 - 1 = 4 draft tokens
    cache.store(CacheKey.make(prompt, 0), [4, 5, 6, 2, 3], [-1.0] * 5, "length", 0, S)
    plan = b.plan(prompt, 0)
    assert plan.draft_ids == [4, 5, 6, 2] and plan.budget == 5
    v = b.verify(plan, [-1.0, -1.1, -0.9, -1.2], step=4, scoring_sample=([11], [-0.7]))
    assert v.n == 4 and not v.full_reuse and plan.tokens == [4, 5, 6, 2, 11] and v.sampled == 1
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
    # a mode without draft reuse (vanilla) looks up no draft: every response is generated
    cache.store(CacheKey.make([5, 6], 1), [3, 4], [-1.0, -1.0], "length", 0, S)
    assert builder(cache).plan([5, 6], 1).scoring_ids == [5, 6, 3, 4]
    off = builder(cache, mode="vanilla")
    plan = off.plan([5, 6], 1)
    assert plan.scoring_ids is None and plan.draft_ids == []
    assert off.continuation(plan, off.verify(plan, None)).context_ids == [5, 6]


# ---------------------------------------------------------------- drafts that no longer fit (spec_rl.drafts.validity)
def test_draft_with_an_eos_inside_is_cut_after_it_and_reused_whole():
    cache = RolloutCache()
    b = builder(cache, max_model_len=16, mode=lenient(math.inf))
    prompt = [7, 8, 9]
    cache.store(CacheKey.make(prompt, 0), [4, 1, 5, 6], [-1.0] * 4, "length", 0, S)  # EOS (1) inside
    plan = b.plan(prompt, 0)
    assert plan.draft_ids == [4, 1] and plan.old_logprobs == [-1.0, -1.0] and plan.draft_end == "eos"
    v = b.verify(plan, [-0.5, -0.5], step=1, scoring_sample=([6], [-0.1]))
    assert v.full_reuse and plan.tokens == [4, 1] and b.continuation(plan, v) is None
    res = b.assemble(plan, v)
    assert res.response_ids == [4, 1] and res.finish_reason == "eos"


def test_draft_cut_by_a_smaller_budget_is_continued_not_returned():
    cache = RolloutCache()
    b = builder(cache, max_model_len=16, mode=lenient(math.inf))  # today's budget: min(6, 16 - 3) = 6
    prompt = [7, 8, 9]
    cache.store(CacheKey.make(prompt, 0), [4, 5], [-1.0, -1.0], "length", 0, SamplingSettings(max_tokens=2))
    plan = b.plan(prompt, 0)
    assert plan.draft_ids == [4, 5] and plan.draft_end is None  # a prefix only
    v = b.verify(plan, [-0.5, -0.5], step=1, scoring_sample=([6], [-0.1]))
    assert not v.full_reuse and v.n == 2 and plan.tokens == [4, 5, 6]
    cont = b.continuation(plan, v)
    assert cont.context_ids == prompt + [4, 5, 6] and cont.max_tokens == 6 - 3
    res = b.assemble(plan, v, [2, 1], [-0.2, -0.3])
    assert res.response_ids == [4, 5, 6, 2, 1] and res.finish_reason == "eos"
    # the same without a scoring sample: the continuation starts right after the draft
    v = b.verify(plan, [-0.5, -0.5], step=1)
    assert b.continuation(plan, v).context_ids == prompt + [4, 5] and b.continuation(plan, v).max_tokens == 4


def test_draft_longer_than_the_budget_is_cut_to_it_and_ends_by_length():
    cache = RolloutCache()
    b = builder(cache, max_model_len=16, mode=lenient(math.inf))
    prompt = [7, 8, 9]
    cache.store(
        CacheKey.make(prompt, 0), [4, 5, 6, 2, 3, 4, 5, 6], [-1.0] * 8, "length", 0, SamplingSettings(max_tokens=8)
    )
    plan = b.plan(prompt, 0)
    assert plan.draft_ids == [4, 5, 6, 2, 3, 4] and plan.draft_end == "length"
    v = b.verify(plan, [-0.5] * 6, step=1, scoring_sample=([6], [-0.1]))
    assert v.full_reuse and b.continuation(plan, v) is None
    assert b.assemble(plan, v).finish_reason == "length"


# ---------------------------------------------------------------- exact acceptance
V, EOS = 4, 3
PROBS = torch.tensor([0.6, 0.25, 0.1, 0.05])  # the fixed next-token distribution; drafts hold token 0
EXACT_S = SamplingSettings(temperature=1.0, max_tokens=2)


def test_exact_options_and_requests():
    exact = "exact"
    with pytest.raises(ValueError, match="max_resample_attempts"):
        builder(mode=exact, max_resample_attempts=0)
    cache = RolloutCache()
    b = builder(cache, mode=exact, seed=5, seed_param="sampling_seed", max_resample_attempts=4)
    assert b.mode == RolloutMode(Exact(), tail=0) and b.mode.log_lenience == 0.0
    prompt, draft = [7, 8, 9], [4, 5, 6]
    cache.store(CacheKey.make(prompt, 0), draft, [-1.0, -2.0, -0.5], "eos", 2, S)
    plan = b.plan(prompt, 0)
    new = [-0.1, -3.0, -0.2]
    for step in range(40):  # find a step whose uniforms reject somewhere
        v = b.verify(plan, new, step=step)
        if v.n < len(draft):
            break
    ref = verify_logprobs(
        torch.tensor([draft]),
        None,
        torch.tensor([new]),
        seed=mix_seed(5, step),
        uids=torch.tensor([plan.key.uid]),
        options=VerifyOptions(mode="exact", backend="reference"),
    )
    assert v.n == int(ref.accepted_len[0]) < len(draft)
    assert v.rejected == draft[v.n] and v.rejected_logprob == pytest.approx(new[v.n])
    cont = b.continuation(plan, v)
    assert cont.excluded == draft[v.n] and cont.context_ids == prompt + draft[: v.n]
    assert cont.seeds == residual_seeds(mix_seed(5, step), plan.key.uid, 4) and len(set(cont.seeds)) == 4
    params = b.continuation_sampling_params({"temperature": 1.0, "prompt_logprobs": 0}, cont, cont.seeds[1])
    assert params == {
        "temperature": 1.0,
        "max_tokens": cont.max_tokens,
        "logprobs": True,
        "sampling_seed": cont.seeds[1],
    }
    with pytest.raises(ValueError, match="begins with the rejected draft token"):
        b.assemble(plan, v, [draft[v.n]], [-0.5])
    res = b.assemble(plan, v, [1], [-0.5], resamples=2)
    assert res.metrics["exact_acceptance"] is True and res.metrics["resamples"] == 2
    lenient = builder(RolloutCache()).assemble(plan, b.verify(plan, new, step=0), [], [], store=False)
    assert lenient.metrics["exact_acceptance"] is False and lenient.metrics["resamples"] == 0


def test_draw_continuation_resends_and_gives_up():
    req = ContinuationRequest([1, 2], 3, excluded=0, excluded_logprob=-0.01, seeds=[11, 12, 13])
    sent = []

    async def send(seed, first=(0, 0, 2)):
        sent.append(seed)
        return [first[len(sent) - 1], 1], [-0.1, -0.2]

    out, resamples = asyncio.run(draw_continuation(req, send))
    assert out[0] == [2, 1] and resamples == 2 and sent == [11, 12, 13]

    async def always_excluded(seed):
        return [0], [-0.01]

    with pytest.raises(RuntimeError, match="rejected draft token 0 first in all 3"):
        asyncio.run(draw_continuation(req, always_excluded))
    sent.clear()
    plain = ContinuationRequest([1, 2], 3)  # lenient: one request, the server's own randomness
    assert asyncio.run(draw_continuation(plain, send)) == (([0, 1], [-0.1, -0.2]), 0) and sent == [None]
    assert asyncio.run(draw_continuation(None, send, nothing="none")) == ("none", 0)


async def _one_exact_sample(b, server, index):
    """The verl/OpenRLHF request sequence for one sample, against a server with a fixed distribution."""
    plan = b.plan([0, 1], 0, f"ds:{index}")
    rid = (
        f"r{index}"  # without a seed the fake server's randomness follows the request id (as a server's own would vary)
    )
    scored = server.run(rid, plan.scoring_ids, b.scoring_sampling_params({"temperature": 1.0}))
    lps = b.draft_logprobs_from_rows(plan, scored["prompt_logprobs"], scored["prompt_ids"])
    v = b.verify(plan, lps, step=1, scoring_sample=(scored["token_ids"], scored["log_probs"]))
    cont = b.continuation(plan, v)

    async def send(seed):
        r = server.run(rid, cont.context_ids, b.continuation_sampling_params({"temperature": 1.0}, cont, seed))
        return r["token_ids"], r["log_probs"]

    (ids, new_lps), resamples = await draw_continuation(cont, send, nothing=([], []))
    kept = cont is not None and cont.kept_excluded
    return v.n, b.assemble(plan, v, ids, new_lps, resamples=resamples, kept_excluded=kept)


def test_exact_token_at_the_rejection_follows_the_residual():
    # Every draft is [0, 0]. Exact acceptance keeps token 0 with probability 0.6 at each position and
    # otherwise draws from the residual (PROBS without token 0, renormalised), so each position's
    # marginal is PROBS, whatever the draft.
    server = FixedServer(PROBS, {EOS}, max_model_len=8)
    cache = RolloutCache()
    # 16 attempts (the default) fail with probability 0.6 ** 16 per rejection, about once in 3500 rejections
    b = SpecRequestBuilder(cache, EXACT_S, 8, [EOS], mode=MODES["exact"], seed=3, max_resample_attempts=64)
    n_samples = 2000  # (the verl test runs 5000 through the agent loop)
    for i in range(n_samples):
        cache.store(CacheKey.make([0, 1], 0, f"ds:{i}"), [0, 0], [-0.5, -0.5], "length", 0, EXACT_S)

    async def go():
        return [await _one_exact_sample(b, server, i) for i in range(n_samples)]

    out = asyncio.run(go())
    first = torch.tensor([r.response_ids[0] for _, r in out])
    second = torch.tensor([r.response_ids[1] for _, r in out if len(r.response_ids) > 1])
    at_rejection = torch.tensor([r.response_ids[0] for n, r in out if n == 0])
    assert_fits(torch.bincount(first, minlength=V), PROBS)
    assert_fits(torch.bincount(second, minlength=V), PROBS)
    residual = PROBS.clone()
    residual[0] = 0
    assert_fits(torch.bincount(at_rejection, minlength=V), residual / residual.sum())
    assert sum(r.metrics["resamples"] for _, r in out) > 100  # the continuation began with 0: resent
    for _, r in out:  # log-probs are pi_t's, not the residual's
        assert r.logprobs == pytest.approx([math.log(PROBS[t]) for t in r.response_ids], abs=1e-5)


def _lenient_zeros_samples(draw: str, seed: int, attempts: int, n_samples: int = 1500):
    """(builder, cache, samples): ``n_samples`` drafts [0, 0] stored with q(0) = 0.9, verified at l = 1 under
    ``draw`` against the fixed server and continued through draw_continuation (``attempts`` per rejection)."""
    server = FixedServer(PROBS, {EOS}, max_model_len=8)
    cache = RolloutCache()
    b = SpecRequestBuilder(cache, EXACT_S, 8, [EOS], mode=lenient(1.0, draw), seed=seed, max_resample_attempts=attempts)
    for i in range(n_samples):
        cache.store(CacheKey.make([0, 1], 0, f"ds:{i}"), [0, 0], [math.log(0.9)] * 2, "length", 0, EXACT_S)

    async def go():
        return [await _one_exact_sample(b, server, i) for i in range(n_samples)]

    return b, cache, asyncio.run(go())


@pytest.mark.parametrize("draw", ["policy", "without-draft"])
def test_the_token_at_a_lenient_rejection_follows_the_chosen_draw(draw):
    # Drafts [0, 0] stored with q(0) = 0.9; the server's pi_t gives token 0 probability 0.6, so at l = 1 a draft
    # token is kept with probability 0.6 / 0.9. At a rejection the paper's draw is the server's own sample of
    # pi_t (token 0 included); the without-draft draw resends until the first token is not 0.
    _, _, out = _lenient_zeros_samples(draw, seed=4, attempts=64)
    at_rejection = torch.tensor([r.response_ids[0] for n, r in out if n == 0])
    assert len(at_rejection) > 300  # about n_samples / 3 rejections at position 0
    law = PROBS.clone()
    if draw == "without-draft":
        law[0] = 0
    assert_fits(torch.bincount(at_rejection, minlength=V), law / law.sum())
    assert (sum(r.metrics["resamples"] for _, r in out) > 0) == (draw == "without-draft")


def test_the_without_draft_draw_keeps_the_last_attempt_when_all_begin_with_the_rejected_token():
    # As above with 2 attempts: the draw keeps the second attempt when both began with token 0 (a peaked policy
    # would otherwise stop the run), so at a rejection token 0 has probability 0.6^2 and every other token
    # PROBS[t] (1 + 0.6): the paper's draw mixed in where the attempts ran out, and counted.
    with pytest.warns(RuntimeWarning, match="kept a continuation that begins with the rejected token 0 after 2"):
        b, cache, out = _lenient_zeros_samples("without-draft", seed=6, attempts=2)
    at_rejection = torch.tensor([r.response_ids[0] for n, r in out if n == 0])
    law = PROBS * (1 + PROBS[0])
    law[0] = PROBS[0] ** 2
    assert_fits(torch.bincount(at_rejection, minlength=V), law / law.sum())
    fallbacks = [r for n, r in out if r.metrics["draw_fallbacks"]]
    assert len(fallbacks) > 50 and all(r.metrics["resamples"] == 1 for r in fallbacks)
    # a fallback is exactly a rejection (at n = 0 or 1) whose token at n is the rejected one (the drafts' token 0)
    assert sum(int(r.response_ids[n] == 0) for n, r in out if n < 2) == len(fallbacks)
    # kept_excluded only where draw_continuation sets it: else draw_fallbacks would count a fallback that did not happen
    refused = "kept_excluded=True needs a rejection with the without-draft draw"
    cache.store(CacheKey.make([0, 1], 0, "ds:refuse"), [0, 0], [math.log(0.9)] * 2, "length", 0, EXACT_S)
    plan = b.plan([0, 1], 0, "ds:refuse")
    for step in range(60):
        v = b.verify(plan, [math.log(0.1)] * 2, step=step)
        if v.rejected is not None:
            break
    assert v.rejected == 0
    for ids in ([2, 1], []):  # begins with another token; nothing generated
        with pytest.raises(ValueError, match=refused):
            b.assemble(plan, v, ids, [-0.5] * len(ids), store=False, kept_excluded=True)
    whole = b.verify(plan, [math.log(0.9)] * 2, step=0)  # p = q at l = 1: reused whole, nothing rejected
    assert whole.full_reuse and whole.rejected is None
    with pytest.raises(ValueError, match=refused):
        b.assemble(plan, whole, [], [], store=False, kept_excluded=True)
    paper = SpecRequestBuilder(RolloutCache(), EXACT_S, 8, [EOS], mode=lenient(1.0), seed=6, max_resample_attempts=2)
    plan_p = paper.plan([0, 1], 0, "ds:p")  # no draft stored: nothing is rejected
    with pytest.raises(ValueError, match=refused):
        paper.assemble(plan_p, paper.verify(plan_p, None), [0], [-0.5], store=False, kept_excluded=True)
    v = b.verify(plan, [math.log(0.1)] * 2, step=step)  # a sample holds the prefix of its last verification
    assert b.assemble(plan, v, [0, 1], [-0.5, -0.6], store=False, kept_excluded=True).metrics["draw_fallbacks"] == 1
    # exact acceptance never keeps it: the draw would not be lossless
    plain = ContinuationRequest([1, 2], 3, excluded=0, seeds=[11], keep_last=False)

    async def always_excluded(seed):
        return [0], [-0.01]

    with pytest.raises(RuntimeError, match="first in all 1"):
        asyncio.run(draw_continuation(plain, always_excluded))
    exact = SpecRequestBuilder(RolloutCache(), EXACT_S, 8, [EOS], mode=MODES["exact"], max_resample_attempts=1)
    plan = exact.plan([0, 1], 0, "ds:x")
    with pytest.raises(ValueError, match="kept_excluded is only for the lenient without-draft draw"):
        exact.assemble(plan, exact.verify(plan, None), [0], [-0.5], kept_excluded=True)


def test_the_without_draft_draw_is_refused_where_it_means_nothing():
    with pytest.raises(ValueError, match="mode must be one of"):
        builder(mode="l=2-residual")
    with pytest.raises(ValueError, match="needs lenience >= 1"):
        builder(mode="l=0.5-excl")
    assert builder(mode="l=2-excl").mode == lenient(2.0, "without-draft")


@pytest.mark.parametrize("seed", range(4))
def test_a_servers_samples_carry_behaviour_logprobs_against_float64(seed):
    """Kept tokens: the draft's behaviour plus the test's keep probability; the sampled token after a draft kept
    whole and the continuation: their own log-probs; a continuation drawn without the rejected token: renormalised."""
    gen = torch.Generator().manual_seed(seed)
    for draw in ("policy", "without-draft"):
        cache = RolloutCache()
        lenience = math.exp(0.5)
        b = builder(cache, max_model_len=12, mode=lenient(lenience, draw), seed=seed)
        prompt = [7, 8, 9]
        old = (-torch.rand(5, generator=gen, dtype=torch.float64) * 3).tolist()
        drafted = (-torch.rand(5, generator=gen, dtype=torch.float64) * 3).tolist()
        key = CacheKey.make(prompt, 0)
        cache.store(key, [4, 5, 6, 2, 3], old, "length", 0, S, behaviour_logprobs=drafted)
        plan = b.plan(prompt, 0)
        assert plan.draft_behaviour == pytest.approx(drafted[:5], abs=1e-6)
        new = (torch.tensor(old) - torch.rand(5, generator=gen, dtype=torch.float64) * 2).tolist()
        v = b.verify(plan, new, step=1)
        keep = [min(0.0, math.log(lenience) + n - o) for n, o in zip(new, old)]
        want = [d + k for d, k in zip(drafted, keep)][: v.n]
        assert plan.behaviour == pytest.approx(want, abs=1e-5)
        tail_ids, tail_lps = [10, 1][: plan.budget - v.n], [-0.4, -0.2][: plan.budget - v.n]
        kept_excluded = False
        res = b.assemble(plan, v, tail_ids, tail_lps, kept_excluded=kept_excluded)
        assert res.behaviour_logprobs[: v.n] == pytest.approx(want, abs=1e-5)
        tail = res.behaviour_logprobs[v.n :]
        if draw == "without-draft" and v.n < 5 and tail_ids:
            assert tail[0] == pytest.approx(tail_lps[0] - math.log1p(-math.exp(new[v.n])), abs=1e-5)
            tail = tail[1:]
            tail_lps = tail_lps[1:]
        assert tail == pytest.approx(tail_lps[: len(tail)])
        stored = cache.lookup(key, S)
        assert stored.behaviour.tolist() == pytest.approx(res.behaviour_logprobs, abs=1e-6)


def test_servers_refuse_the_modes_only_spec_rls_own_rollout_makes():
    for name in ("coupled", "l=1-res"):
        with pytest.raises(ValueError, match="spec-rl's own trainer"):
            builder(mode=name)
    for name in ("coupled", "l=1-res"):
        with pytest.raises(ValueError, match="made by a rollout"):
            VerifyOptions(mode=name)
