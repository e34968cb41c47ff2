"""Speculative path of the PagedEngine: score + continue_from, and SpeculativeRollout on top of it.

A continuation from a spliced prefix must equal a fresh prefill of
[prompt, prefix, first token], and the engine must spend no prefill beyond the
single scoring pass.
"""

import warnings

import pytest
import torch
from backend_jobs import continue_rows, generate
from block_checks import check_invariants
from engine_models import greedy_reference, tiny_family_model
from tiny_models import full_forward_logprobs

from spec_rl.acceptance.mode import RolloutMode
from spec_rl.acceptance.rules import Lenient
from spec_rl.backends.base import Backend, Cut, Job
from spec_rl.backends.paged import PagedEngine
from spec_rl.backends.transformers_backend import TransformersBackend
from spec_rl.drafts.cache import RolloutCache
from spec_rl.rollout.speculative import RolloutRequest, SpeculativeRollout
from spec_rl.sampling.distribution import SamplingSettings

warnings.filterwarnings("ignore", message="spec_rl._C is not built")

PROMPTS = [[3, 11, 12, 13, 14], [3, 15, 16], [3, 17, 18, 19, 20, 21, 22, 23, 24, 25]]
DRAFTS = [[4, 5, 6, 7, 8, 9, 10], [7, 8, 9, 10, 11, 12, 13, 14, 15], [8, 9, 10, 2, 12]]
ACCEPT = [3, 0, 4]  # n < R for every row; n = 0 keeps only the prompt
GREEDY = SamplingSettings(temperature=1.0, top_k=1, max_tokens=64)


def _first_tokens(scores, settings, gen=None):
    rows = torch.arange(len(ACCEPT))
    logits = scores.logits_at(rows, torch.tensor(ACCEPT))
    if settings.top_k == 1:
        return logits.argmax(-1).tolist()
    from spec_rl.sampling.distribution import sampling_log_softmax

    logp = sampling_log_softmax(logits, settings.temperature, settings.top_k, settings.top_p)
    return torch.multinomial(logp.exp(), 1, generator=gen).squeeze(-1).tolist()


def test_greedy_continuation_from_spliced_prefix_equals_fresh_prefill():
    model = tiny_family_model("llama", seed=9)
    engine = PagedEngine(model, eos_ids={1}, pad_id=0, block_size=4, num_blocks=64)
    assert isinstance(engine, Backend)
    handle = engine.score(PROMPTS, DRAFTS)
    scores = handle.scores
    first = _first_tokens(scores, GREEDY)
    scored = engine.stats.prefill_tokens
    outs = continue_rows(engine, handle, ACCEPT, first, [40] * 3, GREEDY, seed=0)
    assert engine.stats.prefill_tokens == scored == engine.stats.scoring_tokens  # nothing prefilled twice
    assert engine.stats.reprefill_tokens == 0
    for p, d, n, t, out in zip(PROMPTS, DRAFTS, ACCEPT, first, outs):
        ctx = p + d[:n]
        assert t == greedy_reference(model, ctx, 1)[0]
        assert out.token_ids == greedy_reference(model, ctx + [t], 40, eos_ids={1})
    assert engine.blocks.num_free == 64


def test_sampled_continuation_equals_fresh_prefill_with_the_same_seed():
    model = tiny_family_model("qwen2", seed=10)
    settings = SamplingSettings(temperature=0.9, max_tokens=64)
    engine = PagedEngine(model, eos_ids={1}, pad_id=0, block_size=4, num_blocks=64)
    for row in range(3):  # one row at a time: the generator draws the same uniforms in both runs
        p, d, n = PROMPTS[row], DRAFTS[row], ACCEPT[row]
        handle = engine.score([p], [d])
        t = 5
        spliced = continue_rows(engine, handle, [n], [t], [20], settings, seed=123)[0]
        fresh = generate(engine, [p + d[:n] + [t]], [20], settings, seed=123)[0]
        assert spliced.token_ids == fresh.token_ids
        assert torch.allclose(torch.tensor(spliced.logprobs), torch.tensor(fresh.logprobs), atol=1e-5)
        ref = full_forward_logprobs(model, p + d[:n] + [t], spliced.token_ids, temperature=0.9)
        assert torch.allclose(torch.tensor(spliced.logprobs, dtype=torch.float64), ref, atol=1e-4)


def test_scoring_eviction_falls_back_to_prefill_and_still_matches():
    model = tiny_family_model("qwen3", seed=11)
    # 13 blocks of 4: the three [prompt, draft] rows (3 + 3 + 4 blocks) plus their decode cannot all stay.
    engine = PagedEngine(model, eos_ids={1}, pad_id=0, block_size=4, num_blocks=13, max_tokens_per_forward=16)
    handle = engine.score(PROMPTS, DRAFTS)
    scores = handle.scores
    first = _first_tokens(scores, GREEDY)
    outs = continue_rows(engine, handle, ACCEPT, first, [30] * 3, GREEDY, seed=0)
    for p, d, n, t, out in zip(PROMPTS, DRAFTS, ACCEPT, first, outs):
        assert out.token_ids == greedy_reference(model, p + d[:n] + [t], 30, eos_ids={1})
    assert engine.stats.reprefill_tokens > 0  # honest accounting of the fallback
    assert engine.blocks.num_free == 13
    check_invariants(engine.blocks)


def _perturb(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * p.std() * torch.randn(p.shape, generator=g))


def test_speculative_rollout_with_engine_equals_transformers_backend():
    settings = SamplingSettings(temperature=1.0, top_k=1, max_tokens=30)
    requests = [RolloutRequest(p, s, dataset_id=f"p{i}") for i, p in enumerate(PROMPTS + [[4, 9]]) for s in range(2)]
    results = {}
    for name in ("reprefill", "transformers", "engine"):
        model = tiny_family_model("qwen2", seed=12)
        if name == "engine":
            backend = PagedEngine(model, eos_ids={1}, pad_id=0, block_size=4, num_blocks=128)
        else:  # the transformers backend splices the scoring K/V, or (splice=False) prefills again
            backend = TransformersBackend(model, {1}, pad_id=0, splice=name == "transformers")
        rollout = SpeculativeRollout(
            backend, RolloutCache(), settings, eos_ids=[1], max_model_len=64, mode=RolloutMode(Lenient(1.0), tail=0)
        )
        first = rollout.run(requests, step=0)
        _perturb(model, 0)  # the policy moves: some drafts are now rejected part-way
        if name == "engine":
            backend.runner.stats = type(backend.stats)()  # counters from here on
        second = rollout.run(requests, step=1)
        # step 2: a new prompt has no draft, so it is generated alongside the continuations
        third = rollout.run(requests + [RolloutRequest([4, 9, 9], s) for s in range(2)], step=2)
        results[name] = (first, second, third, backend)
    (f_t, s_t, t_t, _), (f_e, s_e, t_e, engine) = results["transformers"], results["engine"]
    f_r, s_r, t_r, _ = results["reprefill"]
    for a, b in ((f_t, f_e), (s_t, s_e), (t_t, t_e), (f_r, f_e), (s_r, s_e), (t_r, t_e)):
        assert a.response_ids == b.response_ids
        assert a.finish_reasons == b.finish_reasons
        assert a.verified_prefix_len == b.verified_prefix_len
        for x, y in zip(a.logprobs, b.logprobs):
            assert torch.allclose(torch.tensor(x), torch.tensor(y), atol=1e-4)
    # the perturbation made some drafts partially accepted, so both paths did continue from a prefix
    partial = [n for n, r, ok in zip(s_e.verified_prefix_len, s_e.response_ids, s_e.draft_found) if ok and n < len(r)]
    assert partial
    assert s_r.stats.reprefill_tokens > 0
    assert s_t.stats.reprefill_tokens == 0 and t_t.stats.reprefill_tokens == 0
    assert s_e.stats.reprefill_tokens == 0 and t_e.stats.reprefill_tokens == 0
    # engine prefill over steps 1-2 = the scoring passes + prompts without drafts, nothing else
    assert engine.stats.reprefill_tokens == 0
    assert engine.stats.prefill_tokens - engine.stats.scoring_tokens == len([4, 9, 9])  # its group, prefilled once
    assert engine.blocks.num_free == engine.blocks.num_blocks


# One group of five samples (shared prompt, ends mid-block) and a second prompt. Under exact
# acceptance a sample may continue another sample's draft: rows 1 and 4 both continue row 0's
# draft, longer than row 0's own verified prefix; row 2 continues row 3's draft, and row 3 itself
# is released (no first token).
GROUP = [3, 11, 12, 13, 14]
SRC_PROMPTS = [GROUP] * 5 + [[3, 15, 16]]
SRC_DRAFTS = [
    [4, 5, 6, 7, 8, 9, 10],
    [4, 5, 6, 2, 9],
    [7, 8, 9, 10, 11, 12],
    [7, 8, 9, 10, 11, 12, 13, 2, 4],
    [13],
    [5, 6],
]
SOURCES = [0, 0, 3, 3, 0, 5]
SRC_ACCEPT = [2, 5, 8, 1, 7, 2]
SRC_FIRST = [9, 12, 6, None, 14, 7]
SRC_UIDS = [500 + i for i in range(6)]


def _continue_with_sources(backend, settings, budget, extra=((), ())):
    handle = backend.score(SRC_PROMPTS, SRC_DRAFTS)
    budgets = [budget] * 5 + [0]  # row 5 (its own source) has nothing left to sample
    return continue_rows(
        backend, handle, SRC_ACCEPT, SRC_FIRST, budgets, settings, 17, *extra, uids=SRC_UIDS + [600], sources=SOURCES
    )


@pytest.mark.parametrize("num_blocks, budget, max_tokens", [(128, 20, 16), (14, 20, 16), (17, 40, 64)])
def test_rows_continuing_other_rows_drafts_equal_a_fresh_prefill(num_blocks, budget, max_tokens):
    # 14 blocks of 4 cannot hold all six scored rows: the oldest (among them source row 0) are evicted.
    # 17 blocks hold them, but not the decode of the first: resumed forks give up their K/V.
    settings = SamplingSettings(temperature=0.9, max_tokens=budget)
    model = tiny_family_model("llama", seed=21)
    extra = ([[3, 17, 18]], [15])
    backend = TransformersBackend(model, {1}, pad_id=0, splice=False)
    fresh = _continue_with_sources(backend, settings, budget, extra)
    engine = PagedEngine(model, {1}, 0, block_size=4, num_blocks=num_blocks, max_tokens_per_forward=max_tokens)
    outs = _continue_with_sources(engine, settings, budget, extra)
    assert [o.token_ids for o in outs] == [o.token_ids for o in fresh]
    assert [o.finish_reason for o in outs] == [o.finish_reason for o in fresh]
    for a, b in zip(outs, fresh):
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4)
    assert [len(o.token_ids) for o in outs[3::2]] == [0, 0]  # the released row and the zero budget
    for i in (0, 1, 2, 4):  # the K/V a row continued from is its source's draft prefix
        context = GROUP + SRC_DRAFTS[SOURCES[i]][: SRC_ACCEPT[i]] + [SRC_FIRST[i]]
        ref = full_forward_logprobs(model, context, outs[i].token_ids, temperature=0.9)
        assert torch.allclose(torch.tensor(outs[i].logprobs, dtype=torch.float64), ref, atol=1e-4)
    st = engine.stats
    assert (st.reprefill_tokens > 0) == (num_blocks != 128)
    if num_blocks == 128:  # nothing but the scoring pass and the extra context was prefilled
        assert st.prefill_tokens == st.scoring_tokens + 3
    assert engine.blocks.num_free == num_blocks
    check_invariants(engine.blocks)


def test_scoring_eviction_of_a_source_is_prefilled_again():
    settings = SamplingSettings(temperature=1.0, top_k=1, max_tokens=20)
    model = tiny_family_model("qwen3", seed=22)
    engine = PagedEngine(model, eos_ids={1}, pad_id=0, block_size=4, num_blocks=14, max_tokens_per_forward=16)
    handle = engine.score(SRC_PROMPTS, SRC_DRAFTS)
    assert handle.state.seq_ids[0] is None and handle.state.seq_ids[3] is not None  # 0 evicted, 3 resident
    outs = continue_rows(engine, handle, SRC_ACCEPT, SRC_FIRST, [20] * 6, settings, 0, sources=SOURCES)
    for i in (0, 1, 2, 4):
        context = GROUP + SRC_DRAFTS[SOURCES[i]][: SRC_ACCEPT[i]] + [SRC_FIRST[i]]
        assert outs[i].token_ids == greedy_reference(model, context, 20, eos_ids={1})
    # rows 0, 1 and 4 (source 0) are prefilled again; row 2 forks the resident row 3
    assert engine.stats.reprefill_tokens == sum(len(GROUP) + SRC_ACCEPT[i] + 1 for i in (0, 1, 4))
    assert engine.blocks.num_free == 14
    check_invariants(engine.blocks)


@pytest.mark.parametrize(
    "cut, match",
    [
        (Cut(6, 2, 9), r"jobs\[0\]\.cut\.row must be <= 5, got 6"),  # out of range
        (Cut(4, 2, 9), r"jobs\[0\]\.cut\.n must be <= 1, got 2"),  # longer than the row's draft
    ],
)
def test_bad_cuts_are_rejected_and_free_every_block(cut, match):
    engine = PagedEngine(tiny_family_model("qwen2", seed=23), eos_ids={1}, pad_id=0, block_size=4, num_blocks=64)
    scored = engine.score(SRC_PROMPTS, SRC_DRAFTS)
    with pytest.raises(ValueError, match=match):
        engine.continue_from(scored, [Job(20, cut=cut)], GREEDY, 0)
    assert engine.blocks.num_free == 64
    check_invariants(engine.blocks)
