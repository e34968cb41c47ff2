"""Speculative decoding over the transformers cache is lossless: same tokens as one-token steps."""

import random

import pytest
import torch
from backend_jobs import generate
from tiny_models import full_forward_logprobs, tiny_model

from spec_rl.backends.hf_decode import DecodeRow, KVRows, SpeculativeDecoder, TailGate, prefill
from spec_rl.backends.kv_buffer import in_place_cache
from spec_rl.drafts.history import SuffixAutomaton, SuffixProposer
from spec_rl.sampling.distribution import SamplingSettings

PROMPTS = [[3, 11, 12, 13, 14], [3, 15, 16], [3, 17, 18, 19, 20, 21, 22], [4, 5], [6], [3, 11, 12, 13, 14]]


def _decode(model, settings, budgets, max_k=0, automata=None, seed=7, proposer=SuffixProposer, gate=None):
    kv, logits = prefill(model, PROMPTS, pad_id=0)
    dec = SpeculativeDecoder(model, settings, seed, eos_ids={1}, pad_id=0, gate=gate)
    uids = [1000 + i for i in range(len(PROMPTS))]
    toks, lps = dec.sample(logits.float(), uids, [len(p) for p in PROMPTS])
    rows = []
    for i, (p, t, lp, b) in enumerate(zip(PROMPTS, toks, lps, budgets)):
        prop = proposer(automata[i], prefix=[t], max_k=max_k) if automata and max_k else None
        row = DecodeRow(
            out=i, uid=uids[i], last=t, position=len(p), budget=b - 1, proposer=prop, tokens=[t], logprobs=[lp]
        )
        row.finish = "eos" if t == 1 else ("length" if b == 1 else None)
        rows.append(row)
    dec.run(kv, rows)
    return rows, dec.stats


def _noisy_copy(tokens, rng, vocab):
    out = list(tokens)
    for _ in range(max(1, len(out) // 6)):
        if out:
            out[rng.randrange(len(out))] = rng.randrange(3, vocab)
    return out


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_speculation_gives_the_same_tokens_and_logprobs(temperature):
    model = tiny_model(seed=11, bias_eos=-1.0)
    settings = SamplingSettings(temperature=temperature, max_tokens=40)
    budgets = [40, 25, 40, 3, 1, 40]
    plain, c0 = _decode(model, settings, budgets)
    rng = random.Random(0)
    automata = []
    for r in plain:  # history: a corrupted copy of the row's own output and another row's output
        sam = SuffixAutomaton()
        sam.add_response(_noisy_copy(r.tokens, rng, model.config.vocab_size))
        sam.add_response(plain[(r.out + 1) % len(plain)].tokens)
        automata.append(sam)
    spec, c1 = _decode(model, settings, budgets, max_k=6, automata=automata)
    for a, b, p in zip(plain, spec, PROMPTS):
        assert a.tokens == b.tokens and a.finish == b.finish
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)
        ref = full_forward_logprobs(model, p, b.tokens, temperature=temperature)  # K/V after rollbacks are right
        assert torch.allclose(torch.tensor(b.logprobs, dtype=torch.float64), ref, atol=1e-4)
        assert len(b.tokens) <= budgets[b.out]
    assert c1.accepted_tokens > 0 and c1.proposed_tokens > c1.accepted_tokens  # both accept and reject paths ran
    assert c1.decode_steps < c0.decode_steps


class _RecordingProposer(SuffixProposer):
    calls: list = []  # (limit, fill, tokens proposed) of every call

    def propose(self, limit, fill=0):
        out = super().propose(limit, fill)
        _RecordingProposer.calls.append((limit, fill, len(out)))
        return out


def test_every_step_feeds_each_row_its_whole_proposal():
    model = tiny_model(seed=11, bias_eos=-3.0)
    settings = SamplingSettings(max_tokens=40)
    budgets = [40] * len(PROMPTS)
    plain, c0 = _decode(model, settings, budgets)
    automata = []
    for r in plain:  # the row's own output as its history: a proposal at almost every step
        sam = SuffixAutomaton()
        sam.add_response(r.tokens)
        automata.append(sam)
    _RecordingProposer.calls = []
    rows, c = _decode(model, settings, budgets, max_k=4, automata=automata, proposer=_RecordingProposer)
    assert [r.tokens for r in rows] == [r.tokens for r in plain]
    calls = _RecordingProposer.calls
    # each live row is asked for up to max_k tokens (less only where its budget ends), every step ...
    assert calls and all(fill == 4 and 1 <= limit <= 4 for limit, fill, _ in calls)
    assert sum(limit < 4 for limit, _, _ in calls) <= len(PROMPTS) * 3
    # ... and everything it proposes is fed (verified), none of it cut
    assert c.proposed_tokens == sum(n for _, _, n in calls) > 0
    assert c.accepted_tokens > 0 and c.decode_steps < c0.decode_steps


def test_prefill_computes_a_repeated_context_once_with_each_rows_values():
    """The G samples of a prompt share one prefill; every row's K/V, mask and logits are its own forward's."""
    model = tiny_model(seed=3).double()
    contexts = [[3, 11, 12], [5, 6], [3, 11, 12], [7, 8, 9, 10], [5, 6], [3, 11, 12]]
    fed = []
    hook = model.register_forward_hook(
        lambda mod, args, kwargs, out: fed.append(kwargs["input_ids"].shape), with_kwargs=True
    )
    kv, logits = prefill(model, contexts, pad_id=0)
    hook.remove()
    assert fed == [torch.Size([3, 4])]  # three distinct contexts, one forward
    assert kv.mask.tolist() == [[0] * (4 - len(c)) + [1] * len(c) for c in contexts]
    for row, ctx in enumerate(contexts):
        alone, alone_logits = prefill(model, [ctx], pad_id=0)
        assert torch.allclose(logits[row], alone_logits[0], atol=1e-10)
        for (k, v), (k1, v1) in zip(_layers(kv), _layers(alone)):
            assert torch.allclose(k[row, :, 4 - len(ctx) :], k1[0], atol=1e-10)
            assert torch.allclose(v[row, :, 4 - len(ctx) :], v1[0], atol=1e-10)
    kv.cache.layers[0].keys[0].zero_()  # rows are copies, not views of one another
    assert kv.cache.layers[0].keys[2].abs().sum() > 0


def _layers(kv):
    return [(layer.keys, layer.values) for layer in kv.cache.layers]


def test_compact_keeps_each_rows_real_positions():
    k = torch.arange(2 * 1 * 5 * 2, dtype=torch.float32).view(2, 1, 5, 2)
    kv = KVRows(in_place_cache([(k, k + 100)]), torch.tensor([[0, 1, 0, 1, 1], [1, 1, 0, 0, 1]]))
    kv.compact()
    assert kv.mask.tolist() == [[1, 1, 1], [1, 1, 1]]
    assert kv.cache.layers[0].keys[0, 0, :, 0].tolist() == [2.0, 6.0, 8.0]
    assert kv.cache.layers[0].values[1, 0, :, 0].tolist() == [110.0, 112.0, 118.0]


def test_trim_front_drops_only_columns_every_row_pads():
    k = torch.arange(2 * 1 * 12 * 2, dtype=torch.float32).view(2, 1, 12, 2)
    mask = torch.tensor([[0] * 9 + [1, 1, 1], [0] * 10 + [1, 1]])
    kv = KVRows(in_place_cache([(k, k + 100)]), mask.clone())
    kv.trim_front(min_columns=10)
    assert kv.width == 12  # 9 leading columns: fewer than asked, kept
    kv.trim_front()
    assert kv.mask.tolist() == [[1, 1, 1], [0, 1, 1]]
    assert torch.equal(kv.cache.layers[0].keys, k[:, :, 9:]) and torch.equal(
        kv.cache.layers[0].values, k[:, :, 9:] + 100
    )


def test_decoding_after_the_longest_context_leaves_is_unchanged(monkeypatch):
    """When the row with the longest context finishes, the left padding only it needed is dropped; the
    other rows' tokens and log-probs are those of a plain forward over each row alone (float64)."""
    model = tiny_model(seed=3, bias_eos=-3.0).double()
    prompts, budgets = [[3] + list(range(5, 25)), [3, 11, 12], [4, 5], [6, 7, 8, 9]], [2, 30, 30, 30]
    widths = []
    real_trim = KVRows.trim_front

    def recorded(self, *args):
        real_trim(self, *args)
        widths.append(self.width)

    monkeypatch.setattr(KVRows, "trim_front", recorded)
    kv, logits = prefill(model, prompts, pad_id=0)
    settings = SamplingSettings(temperature=1.0, max_tokens=30)
    dec = SpeculativeDecoder(model, settings, 5, eos_ids={1}, pad_id=0)
    uids = list(range(len(prompts)))
    toks, lps = dec.sample(logits.float(), uids, [len(p) for p in prompts])
    rows = [
        DecodeRow(out=i, uid=i, last=t, position=len(p), budget=b - 1, tokens=[t], logprobs=[lp])
        for i, (p, t, lp, b) in enumerate(zip(prompts, toks, lps, budgets))
    ]
    dec.run(kv, rows)
    assert widths and widths[0] < len(prompts[0])  # the 21-token prompt's padding is gone
    for p, r in zip(prompts, rows):
        assert 0 < len(r.tokens) <= 30
        ref = full_forward_logprobs(model, p, r.tokens)
        assert torch.allclose(torch.tensor(r.logprobs, dtype=torch.float64), ref, atol=1e-6)


def test_speculation_keeps_the_next_token_marginals():
    """Independent seeds: speculative and plain decoding sample the same distribution (two-sample chi-square)."""
    from _stats import assert_same_distribution

    from spec_rl.backends.transformers_backend import TransformersBackend

    model = tiny_model(seed=5, bias_eos=-3.0)
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)  # a peaked policy, so history drafts are often right
    settings = SamplingSettings(temperature=1.0, max_tokens=6)
    contexts = [[3, 11, 12]] * 3000
    plain = generate(
        TransformersBackend(model, {1}, pad_id=0), contexts, [6] * 3000, settings, seed=1, uids=list(range(3000))
    )
    history = SuffixAutomaton()
    for c in plain[:50]:
        history.add_response(c.token_ids)
    proposers = [SuffixProposer(history, max_k=4) for _ in contexts]
    spec = generate(
        TransformersBackend(model, {1}, pad_id=0, adaptive_tail=False),
        contexts,
        [6] * 3000,
        settings,
        seed=2,
        uids=list(range(3000)),
        proposers=proposers,
    )
    assert sum(p.accepted for p in proposers) > 3000  # speculation really ran
    vocab = model.config.vocab_size
    for pos in (1, 2, 4):
        a = torch.bincount(torch.tensor([c.token_ids[pos] for c in plain if len(c.token_ids) > pos]), minlength=vocab)
        b = torch.bincount(torch.tensor([c.token_ids[pos] for c in spec if len(c.token_ids) > pos]), minlength=vocab)
        assert_same_distribution(a, b)


def _gate(a, b, q, sizes=(64, 576)):
    """A gate that measured steps costing a + b T at the given sizes and tokens held with probability q."""
    gate = TailGate()
    for _ in range(20):
        for t in sizes:
            gate.record(t, a + b * t, hits=round(100 * q), trials=100)
    return gate


def test_tail_gate_fits_the_step_cost_line_and_the_acceptance():
    rng = random.Random(3)
    a, b = rng.uniform(0.01, 0.1), rng.uniform(1e-5, 1e-3)
    gate = TailGate()
    assert gate.line() is None and gate.speculate(64, 9, 64)  # nothing measured yet: speculate
    for _ in range(40):
        t = rng.randrange(1, 600)
        gate.record(t, a + b * t, hits=3, trials=10)
    fit_a, fit_b = gate.line()
    assert fit_a == pytest.approx(a, rel=1e-6) and fit_b == pytest.approx(b, rel=1e-6)
    assert gate.q == pytest.approx(3 / 10, abs=0.02)  # the prior 1/2 has decayed away


@pytest.mark.parametrize(
    ("a", "b", "q", "expected"),
    [
        (0.02, 0.0, 0.05, True),  # a wider step costs nothing more (a GPU): any acceptance pays
        (0.02, 1e-3, 0.05, False),  # each position costs compute (a CPU) and proposals rarely hold
        (0.02, 1e-5, 0.45, True),  # a cheap position pays for a proposal that holds now and then
        (0.02, 1.0, 0.6, True),  # proposals that usually hold are fed whatever the timings say
        (0.02, 1e-4, 0.0, False),  # nothing ever held
    ],
)
def test_tail_gate_speculates_only_where_it_pays(a, b, q, expected):
    gate = _gate(a, b, q)
    rows, width = 64, 9
    gain = 1 + sum(q**j for j in range(1, width))
    pays = gain / (a + b * rows * width) > 1 / (a + b * rows)
    assert (pays or q >= TailGate.ALWAYS_Q) == expected  # the case is what it claims
    assert gate.speculate(rows, width, proposing=rows) == expected
    assert not gate.speculate(rows, 1, proposing=0)  # no proposal: nothing to feed


class _ClosedGate(TailGate):
    def speculate(self, rows, width, proposing):
        return False


def test_a_closed_tail_gate_keeps_the_tokens_and_feeds_no_proposal():
    model = tiny_model(seed=11, bias_eos=-1.0)
    settings = SamplingSettings(temperature=1.0, max_tokens=30)
    budgets = [30, 20, 30, 3, 1, 30]
    plain, _ = _decode(model, settings, budgets)
    automata = []
    for r in plain:  # a history that predicts every row exactly
        sam = SuffixAutomaton()
        sam.add_response(r.tokens)
        automata.append(sam)
    opened, c_open = _decode(model, settings, budgets, max_k=4, automata=automata)
    gate = _ClosedGate()
    closed, c_closed = _decode(model, settings, budgets, max_k=4, automata=automata, gate=gate)
    for a, b, c in zip(plain, opened, closed):
        assert a.tokens == b.tokens == c.tokens and a.logprobs == pytest.approx(c.logprobs, abs=1e-5)
    assert c_open.accepted_tokens > 0 and c_open.decode_steps < c_closed.decode_steps
    assert c_closed.proposed_tokens == 0 and c_closed.decode_positions == c_closed.decode_rows  # width 1 at every step
    assert gate.q > 0.5  # the held-back proposals were checked against the samples: they would have held
