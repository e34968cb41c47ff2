"""Scoring alignment, generation backend, and speculative rollout assembly on a tiny model."""

import copy
import math
from types import SimpleNamespace

import pytest
import torch
from tiny_models import full_forward_logprobs, tiny_model

from spec_rl.acceptance.mode import MODES, RolloutMode
from spec_rl.acceptance.rules import Exact, Lenient, RandomReuse
from spec_rl.backends.base import eos_token_ids, fresh_jobs, policy_tokens
from spec_rl.backends.scoring import PolicyScorer
from spec_rl.backends.transformers_backend import TransformersBackend
from spec_rl.drafts.cache import CacheKey, RolloutCache
from spec_rl.drafts.history import HistoryIndex
from spec_rl.rollout.speculative import RolloutRequest, SpeculativeRollout
from spec_rl.sampling.distribution import SamplingSettings

PROMPTS = [[3, 11, 12, 13, 14], [3, 15, 16], [3, 17, 18, 19, 20, 21, 22]]


def _lenient(lenience: float) -> RolloutMode:
    """The lenient rule at ``lenience``, without tail speculation."""
    return RolloutMode(Lenient(lenience), tail=0)


def _rollout(model, eos=(1,), max_tokens=24, max_model_len=128, cache=None, mode=RolloutMode(Lenient(), tail=0), **kw):
    settings = SamplingSettings(temperature=kw.pop("temperature", 1.0), max_tokens=max_tokens)
    return SpeculativeRollout(
        TransformersBackend(
            model,
            set(eos),
            pad_id=0,
            max_batch_size=kw.pop("max_batch_size", 256),
            max_tokens_per_forward=kw.pop("max_tokens_per_forward", 65536),
        ),
        cache if cache is not None else RolloutCache(),
        settings,
        eos_ids=list(eos),
        max_model_len=max_model_len,
        mode=mode,
        **kw,
    )


def _requests(group=2):
    return [RolloutRequest(p, s, dataset_id=f"p{i}") for i, p in enumerate(PROMPTS) for s in range(group)]


def test_scoring_uses_the_position_before_each_token():
    model = tiny_model(seed=1)
    drafts = [[4, 5, 6], [], [7, 8, 9, 10, 2]]
    scores = PolicyScorer(model, pad_id=0, max_tokens_per_forward=8).score(PROMPTS, drafts)  # forces chunking
    assert scores.hidden_states is not None  # plain linear head: hidden-state path
    for b, (p, d) in enumerate(zip(PROMPTS, drafts)):
        if not d:
            continue
        with torch.no_grad():
            full = model(input_ids=torch.tensor([p + d])).logits[0]
        rows = torch.arange(len(d))
        got = scores.logits_at(torch.full_like(rows, b), rows)
        assert torch.allclose(got, full[len(p) - 1 : len(p) - 1 + len(d)], atol=1e-4)


def test_response_logprobs_follow_the_sampling_settings():
    from spec_rl.backends.scoring import response_logprobs

    model = tiny_model(seed=1)
    responses = [[4, 5, 6], [7], [8, 9]]
    for settings in (SamplingSettings(), SamplingSettings(temperature=0.7)):
        lp = response_logprobs(model, PROMPTS, responses, 0, settings)
        for b, (p, r) in enumerate(zip(PROMPTS, responses)):
            ref = full_forward_logprobs(model, p, r, temperature=settings.temperature)
            assert torch.allclose(lp[b, : len(r)].double(), ref, atol=1e-4)
    top_k = response_logprobs(model, PROMPTS, responses, 0, SamplingSettings(top_k=1))
    assert bool((top_k[0, :3] == 0).logical_or(top_k[0, :3] == float("-inf")).all())  # one token keeps all the mass


def test_policy_tokens_pad_falls_back_to_an_eos_id_and_no_eos_is_refused():
    model = tiny_model(eos=(7, 8), seed=2)
    tok = SimpleNamespace(pad_token_id=None, eos_token_id=5)
    assert policy_tokens(model, tok) == ({5, 7, 8}, 5)  # the tokenizer's EOS id pads
    assert policy_tokens(model, SimpleNamespace(pad_token_id=3, eos_token_id=None)) == ({7, 8}, 3)
    assert policy_tokens(model, SimpleNamespace(pad_token_id=None, eos_token_id=[9, 6])) == ({6, 7, 8, 9}, 6)
    assert policy_tokens(model, SimpleNamespace()) == ({7, 8}, 7)  # no tokenizer ids: the model's smallest EOS id
    model.config.eos_token_id = model.generation_config.eos_token_id = None
    with pytest.raises(ValueError, match="no EOS id found .*set eos_token_id"):
        policy_tokens(model, SimpleNamespace(pad_token_id=0, eos_token_id=None))


def test_backend_logprobs_budgets_and_eos_set():
    model = tiny_model(eos=(1, 2), bias_eos=2.0, seed=2)
    assert eos_token_ids(model) == {1, 2}
    backend = TransformersBackend(model, {1, 2}, pad_id=0)
    settings = SamplingSettings(temperature=0.8, max_tokens=30)
    outs = backend.generate(fresh_jobs(PROMPTS * 4, [30, 3, 0] * 4), settings, seed=0)
    saw_eos = set()
    for ctx, budget, out in zip(PROMPTS * 4, [30, 3, 0] * 4, outs):
        assert len(out.token_ids) <= budget
        assert not any(t in (1, 2) for t in out.token_ids[:-1])  # nothing after an EOS
        if out.finish_reason == "eos":
            saw_eos.add(out.token_ids[-1])
            assert out.token_ids[-1] in (1, 2)
        else:
            assert len(out.token_ids) == budget
        if out.token_ids:
            ref = full_forward_logprobs(model, ctx, out.token_ids, temperature=0.8)
            assert torch.allclose(torch.tensor(out.logprobs, dtype=torch.float64), ref, atol=1e-4)
    assert saw_eos == {1, 2}  # both EOS ids end a response


def test_epoch_two_reuses_drafts_whole_under_the_same_policy():
    model = tiny_model(seed=3)
    ro = _rollout(model, mode=_lenient(1.0), seed=5)
    first = ro.run(_requests(), step=0)
    assert first.stats.drafts_found == 0 and first.stats.tokens_generated == first.stats.vanilla_tokens
    second = ro.run(list(reversed(_requests())), step=1)
    assert second.stats.drafts_found == 6 and second.stats.full_reuse_ratio == 1.0
    assert second.stats.tokens_generated == 0
    assert second.response_ids == list(reversed(first.response_ids))
    for a, b in zip(second.logprobs, reversed(first.logprobs)):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-4)


def test_changed_policy_keeps_a_verified_prefix_and_logprobs_match_a_full_forward():
    model = tiny_model(seed=4)
    cache = RolloutCache()
    ro = _rollout(model, cache=cache, mode=_lenient(1.0), seed=1, max_tokens=20)
    reqs = [RolloutRequest(p, s) for p in PROMPTS for s in range(6)]
    first = ro.run(reqs, step=0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    second = ro.run(reqs, step=1)
    assert 0 < second.stats.accepted_tokens < second.stats.draft_tokens
    assert second.stats.reused_drift > 0  # how far the moved policy is from the drafts on what it reused
    for i, (r1, r2) in enumerate(zip(first.response_ids, second.response_ids)):
        n = second.verified_prefix_len[i]
        assert r2[:n] == r1[:n]  # the reused prefix equals the cached tokens
        ref = full_forward_logprobs(model, reqs[i].prompt_ids, r2)
        assert torch.allclose(torch.tensor(second.logprobs[i], dtype=torch.float64), ref, atol=1e-4)
        key = CacheKey.make(reqs[i].prompt_ids, reqs[i].slot)
        assert cache.lookup(key, ro.settings).token_ids.tolist() == r2 and cache.lookup(key, ro.settings).version == 1
    assert second.stats.tokens_generated == second.stats.vanilla_tokens - second.stats.accepted_tokens


def test_tiny_lenience_reuses_nothing_and_vanilla_skips_scoring():
    model = tiny_model(seed=5)
    ro = _rollout(model, mode=_lenient(1e-30), seed=0)
    ro.run(_requests(), 0)
    res = ro.run(_requests(), 1)
    assert res.stats.accepted_tokens == 0 and res.stats.tokens_generated == res.stats.vanilla_tokens
    ro = _rollout(model, mode=MODES["vanilla"])
    ro.run(_requests(), 0)
    res = ro.run(_requests(), 1)
    assert res.stats.drafts_found == 0 and res.stats.scoring_seconds < 0.05


def test_truncation_and_budget_with_a_long_prompt():
    model = tiny_model(seed=6)
    long_prompt = list(range(3, 30)) * 4  # 108 tokens
    ro = _rollout(model, max_tokens=50, max_model_len=112, mode=_lenient(1.0))
    assert ro.settings.budget(len(long_prompt), ro.max_model_len) == 4
    res = ro.run([RolloutRequest(long_prompt, s) for s in range(4)], 0)
    for r, f in zip(res.response_ids, res.finish_reasons):
        assert len(r) <= 4
        assert (f == "length") == (len(r) == 4 and r[-1] != 1)
    assert res.truncated == [f == "length" for f in res.finish_reasons]
    with pytest.raises(ValueError, match=r"requests\[0\] has 135 tokens: max_model_len=112 leaves no room"):
        ro.run([RolloutRequest(list(range(3, 30)) * 5, 0)], 1)


def test_padded_tensors():
    model = tiny_model(seed=7)
    res = _rollout(model).run(_requests(1), 0)
    t = res.padded(pad_id=0)
    lens = [len(r) for r in res.response_ids]
    assert t["response_mask"].sum(1).tolist() == lens
    assert t["response_ids"].shape == (3, max(lens))


def test_random_reuse_and_bad_arguments():
    model = tiny_model(seed=8)
    ro = _rollout(model, mode=RolloutMode(RandomReuse(), tail=0), seed=3)
    ro.run(_requests(4), 0)
    res = ro.run(_requests(4), 1)
    assert res.stats.drafts_found == 12
    with pytest.raises(ValueError, match="mode must be one of"):
        _rollout(model, mode="greedy")
    assert _rollout(model, mode="random").mode == MODES["random"]
    with pytest.raises(ValueError, match="lenience"):
        Lenient(-math.e)
    with pytest.raises(ValueError, match="empty prompt"):
        ro.run([RolloutRequest([], 0)], 2)


def test_the_mode_decides_tail_speculation_and_the_recorded_lenience():
    model = tiny_model(seed=8)
    for name in ("spec", "exact", "random", "histspec"):  # tail speculation: a history of their own
        assert isinstance(_rollout(model, mode=MODES[name]).history, HistoryIndex), name
    mine = HistoryIndex()
    assert _rollout(model, mode=MODES["spec"], history=mine).history is mine
    assert _rollout(model, mode=MODES["vanilla"]).history is None
    assert _rollout(model, mode=_lenient(2.0)).history is None
    with pytest.raises(ValueError, match="history is what tail speculation drafts from, and this mode has tail=0"):
        _rollout(model, mode=MODES["vanilla"], history=HistoryIndex())
    ro = _rollout(model, mode=RolloutMode(Lenient(math.exp(0.3)), tail=0), seed=1)
    ro.run(_requests(), 0)
    assert ro.run(_requests(), 1).stats.log_lenience == pytest.approx(0.3)


@pytest.mark.parametrize("rule", [Lenient(1.0), None])
def test_tail_speculation_changes_decode_steps_never_tokens(rule):
    model = tiny_model(seed=9).double()
    with torch.no_grad():
        model.lm_head.weight.mul_(60.0)  # a peaked policy: earlier responses predict the next ones
    reqs = [RolloutRequest(p, s, dataset_id=f"p{i}") for i, p in enumerate(PROMPTS) for s in range(4)]
    runs = {}
    for name, history in (("plain", None), ("tail", HistoryIndex())):
        m = copy.deepcopy(model)
        mode = RolloutMode(rule, tail=8 if history is not None else 0)
        # seed 0: a draw whose longest row meets history drafts (decode steps are set by the longest row)
        ro = _rollout(m, mode=mode, seed=0, history=history, max_tokens=30)
        out = [ro.run(reqs, step=0)]
        with torch.no_grad():
            for p in m.parameters():
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel()), dtype=p.dtype) * 0.002)
        out.append(ro.run(reqs, step=1))
        runs[name] = out
    for a, b in zip(runs["plain"], runs["tail"]):
        assert a.response_ids == b.response_ids and a.finish_reasons == b.finish_reasons
    assert runs["tail"][1].stats.tail_accepted > 0
    assert runs["tail"][1].stats.decode_steps < runs["plain"][1].stats.decode_steps


def test_the_exact_rule_stops_scoring_drafts_that_do_not_pay_and_retries_them():
    model = tiny_model(seed=4)
    ro = _rollout(copy.deepcopy(model), mode=RolloutMode(Exact(), tail=0), seed=3)
    plain = _rollout(copy.deepcopy(model), mode=MODES["vanilla"], seed=3)
    reqs = _requests()
    ro.run(reqs, 0)
    assert ro.run(reqs, 1).stats.draft_tokens > 0  # nothing measured yet: drafts are scored
    ro.reuse_gate.pays = False  # as after a call whose accepted tokens saved less than the scoring cost
    scored = []
    for step in range(2, 2 + 2 * ro.reuse_gate.RETRY_EVERY):
        out = ro.run(reqs, step)
        scored.append(out.stats.draft_tokens > 0)
        assert out.response_ids == plain.run(reqs, step).response_ids  # lossless: the same keyed samples
        ro.reuse_gate.pays = False
    every = ro.reuse_gate.RETRY_EVERY
    assert scored == ([False] * (every - 1) + [True]) * 2


@pytest.mark.parametrize(
    ("accepted", "scoring_seconds", "pays"),
    [(100, 0.5, True), (2, 0.5, False), (0, 0.0, False), (9, 0.1, False), (9, 0.05, True), (10, 9.0, True)],
)
def test_reuse_pays_when_the_accepted_tokens_would_have_cost_more_to_generate(accepted, scoring_seconds, pays):
    from spec_rl.rollout.speculative import ReuseGate
    from spec_rl.rollout.types import RolloutStats

    gate = ReuseGate()  # 100 draft tokens; at 10% accepted (MIN_SHARE) drafts are scored whatever the timings
    stats = RolloutStats(
        draft_tokens=100, accepted_tokens=accepted, scoring_seconds=scoring_seconds, generation_seconds=1.0
    )
    stats.tokens_generated = 100  # 10 ms per generated token
    gate.record(stats)
    assert gate.pays is pays
