"""PagedEngine with history speculation: multi-token decode steps change nothing in the output.

Proposers are built from corrupted copies of the plain outputs, so some proposed tokens are
accepted and some rejected. Sampling is keyed by (seed, uid, position), so speculative decoding
must give the same tokens as one-token-per-step decoding, the K/V left after every rollback must
be what a fresh prefill computes, and no block may leak.
"""

import random
import warnings

import pytest
import torch
from backend_jobs import continue_rows, generate
from block_checks import check_invariants
from engine_models import tiny_family_model
from tiny_models import full_forward_logprobs, tiny_model

from spec_rl.backends.paged import PagedEngine
from spec_rl.drafts.history import SuffixAutomaton, SuffixProposer
from spec_rl.sampling.distribution import SamplingSettings

warnings.filterwarnings("ignore", message="spec_rl._C is not built")

# Rows 0 and 5 share a context: they are forked from one prefill and share its partial block.
PROMPTS = [[3, 11, 12, 13, 14], [3, 15, 16], [3, 17, 18, 19, 20, 21, 22], [4, 5], [6], [3, 11, 12, 13, 14]]
BUDGETS = [40, 25, 40, 3, 1, 40]
UIDS = [1000 + i for i in range(len(PROMPTS))]


def _engine(model, num_blocks=128, **kwargs):
    return PagedEngine(model, eos_ids={1}, pad_id=0, block_size=4, num_blocks=num_blocks, **kwargs)


def _corrupted(tokens, rng, vocab):
    """A copy with about one token in six replaced by a random non-special id."""
    hit = set(rng.sample(range(len(tokens)), max(1, len(tokens) // 6))) if tokens else set()
    return [rng.randrange(3, vocab) if j in hit else t for j, t in enumerate(tokens)]


def _automata(outputs, vocab, seed=0):
    """Per row: a corrupted copy of its own output, then the next row's output."""
    rng = random.Random(seed)
    automata = []
    for i, out in enumerate(outputs):
        sam = SuffixAutomaton()
        sam.add_response(_corrupted(out, rng, vocab))
        sam.add_response(outputs[(i + 1) % len(outputs)])
        automata.append(sam)
    return automata


def _proposers(automata, prefixes=None, max_k=6):
    prefixes = prefixes or [[] for _ in automata]
    return [SuffixProposer(a, prefix=p, max_k=max_k) for a, p in zip(automata, prefixes)]


def _checked_decode(engine, context_lens):
    """Wrap the runner's decode step: after each step, blocks are consistent and every live sequence
    holds exactly the K/V of the tokens before its pending one (the rollback left nothing behind)."""
    runner, decode = engine.runner, engine.runner.decode

    def step(seqs, sampler):
        decode(seqs, sampler)
        check_invariants(engine.blocks)
        for s in seqs:
            if not s.finished:
                assert engine.blocks.length(s.seq_id) == context_lens[s.result_index] + len(s.tokens) - 1

    runner.decode = step


def _assert_same(a, b, atol=1e-5):
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.finish_reason for o in a] == [o.finish_reason for o in b]
    for x, y in zip(a, b):
        assert torch.allclose(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=atol)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_speculation_gives_the_same_tokens_logprobs_and_kv(temperature):
    model = tiny_model(seed=11, bias_eos=-1.0)
    settings = SamplingSettings(temperature=temperature, max_tokens=40)
    engine = _engine(model)
    plain = generate(engine, PROMPTS, BUDGETS, settings, seed=7, uids=UIDS)
    plain_steps = engine.stats.decode_steps
    assert engine.stats.proposed_tokens == 0
    engine.runner.stats = type(engine.stats)()  # counters from here on
    _checked_decode(engine, [len(p) for p in PROMPTS])
    automata = _automata([o.token_ids for o in plain], model.config.vocab_size)
    spec = generate(engine, PROMPTS, BUDGETS, settings, seed=7, uids=UIDS, proposers=_proposers(automata))
    _assert_same(plain, spec)
    for p, o, budget in zip(PROMPTS, spec, BUDGETS):
        assert 1 <= len(o.token_ids) <= budget
        ref = full_forward_logprobs(model, p, o.token_ids, temperature=temperature)  # K/V after rollbacks are right
        assert torch.allclose(torch.tensor(o.logprobs, dtype=torch.float64), ref, atol=1e-4)
    st = engine.stats
    assert st.accepted_tokens > 0 and st.proposed_tokens > st.accepted_tokens  # both accept and reject paths ran
    assert st.decode_steps < plain_steps
    assert engine.blocks.num_free == engine.blocks.num_blocks
    check_invariants(engine.blocks)


def test_greedy_with_and_without_speculation_and_a_zero_width():
    model = tiny_family_model("llama", seed=3)
    greedy = SamplingSettings(temperature=1.0, top_k=1, max_tokens=30)
    engine = _engine(model)
    plain = generate(engine, PROMPTS, BUDGETS, greedy, seed=0)
    automata = _automata([o.token_ids for o in plain], model.config.vocab_size, seed=1)
    spec = generate(engine, PROMPTS, BUDGETS, greedy, seed=0, proposers=_proposers(automata))
    _assert_same(plain, spec)
    assert engine.stats.accepted_tokens > 0
    off = _engine(model)
    _assert_same(plain, generate(off, PROMPTS, BUDGETS, greedy, seed=0, proposers=_proposers(automata, max_k=0)))
    assert off.stats.proposed_tokens == 0


def test_tiny_cache_waits_and_speculates_without_leaking_blocks():
    model = tiny_model(seed=12, bias_eos=-2.0)
    prompts = [[3, 11 + i, 12, 13, 14, 15, 16, 17] for i in range(5)] + [[3, 11, 12, 13, 14, 15, 16, 17]]
    settings = SamplingSettings(temperature=0.8, max_tokens=20)
    ref = generate(_engine(model), prompts, [20] * 6, settings, seed=3, uids=UIDS)
    automata = _automata([o.token_ids for o in ref], model.config.vocab_size, seed=2)
    # 8 + 20 tokens need 7 blocks of 4 per sequence: with 10 blocks only one runs at a time.
    small = _engine(model, num_blocks=10, max_batch_size=4)
    _checked_decode(small, [len(p) for p in prompts])
    got = generate(small, prompts, [20] * 6, settings, seed=3, uids=UIDS, proposers=_proposers(automata))
    _assert_same(ref, got)
    assert small.stats.accepted_tokens > 0 and small.stats.proposed_tokens > small.stats.accepted_tokens
    assert small.blocks.num_free == 10
    check_invariants(small.blocks)


DRAFTS = [[4, 5, 6, 7, 8, 9, 10], [7, 8, 9, 10, 11, 12, 13, 14, 15], [8, 9, 10, 2, 12]]
ACCEPT = [3, 0, 4]
EXTRA = [[4, 9], [3, 17, 18]]


def _continue(engine, settings, first, proposers=None):
    handle = engine.score(PROMPTS[:3], DRAFTS)
    uids = UIDS[:5]
    return continue_rows(
        engine, handle, ACCEPT, first, [30, 20, 30], settings, 5, EXTRA, [25, 25], uids=uids, proposers=proposers
    )


@pytest.mark.parametrize("num_blocks", [128, 13])
def test_continue_from_with_speculation_equals_without(num_blocks):
    # 13 blocks: the scored rows cannot all keep their K/V, so some are prefilled again.
    model = tiny_model(seed=13, bias_eos=-2.0)
    settings = SamplingSettings(temperature=0.9, max_tokens=30)
    first = [5, 9, 12]
    plain = _continue(_engine(model), settings, first)
    engine = _engine(model, num_blocks=num_blocks, max_tokens_per_forward=16)
    prefixes = [d[:n] + [t] for d, n, t in zip(DRAFTS, ACCEPT, first)] + [[], []]
    automata = _automata([o.token_ids for o in plain], model.config.vocab_size, seed=3)
    context_lens = [len(p) + n + 1 for p, n in zip(PROMPTS, ACCEPT)] + [len(c) for c in EXTRA]
    _checked_decode(engine, context_lens)
    spec = _continue(engine, settings, first, _proposers(automata, prefixes))
    _assert_same(plain, spec)
    for i, o in enumerate(spec[:3]):
        context = PROMPTS[i] + DRAFTS[i][: ACCEPT[i]] + [first[i]]
        ref = full_forward_logprobs(model, context, o.token_ids, temperature=0.9)
        assert torch.allclose(torch.tensor(o.logprobs, dtype=torch.float64), ref, atol=1e-4)
    assert engine.stats.accepted_tokens > 0 and engine.stats.proposed_tokens > engine.stats.accepted_tokens
    assert (engine.stats.reprefill_tokens > 0) == (num_blocks == 13)
    assert engine.blocks.num_free == num_blocks
    check_invariants(engine.blocks)


def test_a_row_alone_equals_the_same_row_in_a_batch():
    model = tiny_model(seed=14, bias_eos=-1.0)
    settings = SamplingSettings(temperature=1.0, max_tokens=40)
    engine = _engine(model)
    plain = generate(engine, PROMPTS, BUDGETS, settings, seed=9, uids=UIDS)
    automata = _automata([o.token_ids for o in plain], model.config.vocab_size, seed=4)
    batch = generate(engine, PROMPTS, BUDGETS, settings, seed=9, uids=UIDS, proposers=_proposers(automata))
    for i in (0, 2, 5):  # 0 and 5 are forked from one context in the batch, prefilled alone here
        (alone,) = generate(
            engine, [PROMPTS[i]], [BUDGETS[i]], settings, seed=9, uids=[UIDS[i]], proposers=_proposers([automata[i]])
        )
        _assert_same([batch[i]], [alone])
    assert plain[0].token_ids != plain[5].token_ids  # same context, other uid: another sample


def test_every_step_feeds_each_sequence_its_whole_proposal():
    model = tiny_model(seed=3)
    settings = SamplingSettings(max_tokens=40)
    plain = generate(_engine(model), PROMPTS, BUDGETS, settings, seed=9, uids=UIDS)
    automata = _automata([c.token_ids for c in plain], model.config.vocab_size)
    engine = _engine(model)
    proposers = _proposers(automata, max_k=4)
    calls = []  # (limit, fill, tokens proposed) of every lookup
    for p in proposers:

        def propose(limit, fill=0, _f=p.propose):
            out = _f(limit, fill)
            calls.append((limit, fill, len(out)))
            return out

        p.propose = propose
    out = generate(engine, PROMPTS, BUDGETS, settings, seed=9, uids=UIDS, proposers=proposers)
    assert [c.token_ids for c in out] == [c.token_ids for c in plain]
    # each live sequence is asked for all it may feed (its proposer's max_k, less only where its budget ends) ...
    assert calls and all(fill == limit and 1 <= limit <= 4 for limit, fill, _ in calls)
    # ... and feeds all of it: every proposed token is verified
    stats = engine.stats
    assert stats.proposed_tokens == sum(n for _, _, n in calls) > 0
    assert stats.accepted_tokens > 0 and stats.decode_positions > stats.decode_rows
