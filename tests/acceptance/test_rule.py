"""The acceptance rule (paper Sec. 3, Alg. 1; docs/design.md "The rule") and its Philox uniforms."""

import math
from types import SimpleNamespace

import pytest
import torch

from spec_rl.acceptance.dispatch import VerifyOptions, verify_hidden, verify_logits, verify_logprobs, verify_scores
from spec_rl.acceptance.reference import reference_verify
from spec_rl.acceptance.rules import RULES, Lenient
from spec_rl.acceptance.rules.random_reuse import random_reuse_index
from spec_rl.acceptance.scores import DraftScores
from spec_rl.sampling.distribution import SamplingSettings
from spec_rl.sampling.philox import STREAM_ACCEPT, bits_to_uniform, philox4x32, philox_uniform


def _t(*values):
    return tuple(torch.tensor(v, dtype=torch.int64) for v in values)


@pytest.mark.parametrize(
    "counter,key,expected",
    [
        # Random123 known-answer vectors for philox4x32_10.
        ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
        ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
        (
            (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
            (0xA4093822, 0x299F31D0),
            (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
        ),
    ],
)
def test_philox_known_answers(counter, key, expected):
    out = philox4x32(_t(*counter), _t(*key))
    assert tuple(int(x) for x in out) == expected


def test_uniform_mapping_and_range():
    x = torch.tensor([0, 255, 256, 0xFFFFFFFF], dtype=torch.int64)
    u = bits_to_uniform(x)
    assert u.dtype == torch.float32
    assert u.tolist() == [2.0**-24, 2.0**-24, 2 * 2.0**-24, 1.0]
    uids = torch.arange(64, dtype=torch.int64).unsqueeze(1)
    u = philox_uniform(123, uids, torch.arange(512).unsqueeze(0))
    assert u.min() > 0 and u.max() <= 1
    assert abs(float(u.mean()) - 0.5) < 0.01
    # Keyed: the same (seed, uid, index) gives the same value in any batch layout.
    single = philox_uniform(123, torch.tensor([[37]]), torch.tensor([[200]]))
    assert single.item() == u[37, 200].item()


def test_uniform_negative_uid_and_large_seed_are_reinterpreted_unsigned():
    a = philox_uniform(-1, torch.tensor([[-5]]), torch.tensor([[3]]))
    b = philox_uniform((1 << 64) - 1, torch.tensor([[(1 << 64) - 5 - (1 << 64)]]), torch.tensor([[3]]))
    assert a.item() == b.item()
    # And it is Philox with counter (3, uid_lo, uid_hi, 0), key (seed_lo, seed_hi).
    uid = (1 << 64) - 5
    x0 = philox4x32(_t(3, uid & 0xFFFFFFFF, uid >> 32, STREAM_ACCEPT), _t(0xFFFFFFFF, 0xFFFFFFFF))[0]
    assert a.item() == bits_to_uniform(x0).item()


@pytest.mark.parametrize("log_l,log_ratio", [(0.0, -0.7), (0.5, -1.2), (0.5, -0.2), (0.15, 0.3), (-0.5, 0.1)])
def test_empirical_acceptance_rate_matches_min_1_l_ratio(log_l, log_ratio):
    # One-token drafts over many independent uids: P(accept) = min(1, l * p_new / p_old).
    n = 40000
    lp_old = torch.full((n, 1), -1.0)
    lp_new = lp_old + log_ratio
    res = verify_logprobs(
        torch.zeros((n, 1), dtype=torch.long),
        lp_old,
        lp_new,
        seed=7,
        uids=torch.arange(n),
        options=VerifyOptions(mode=Lenient(math.exp(log_l))),
    )
    expected = min(1.0, math.exp(log_l + log_ratio))
    rate = res.accepted_len.float().mean().item()
    sigma = math.sqrt(max(expected * (1 - expected), 1e-12) / n)
    assert abs(rate - expected) <= 5 * sigma + 1e-9, (rate, expected)


def test_empirical_rate_on_synthetic_distributions():
    # Tokens drawn from p_old; accept rate per token matches min(1, l p_new/p_old) averaged over draws.
    torch.manual_seed(0)
    vocab, n = 6, 60000
    p_old = torch.softmax(torch.randn(vocab), 0)
    p_new = torch.softmax(torch.randn(vocab), 0)
    tokens = torch.multinomial(p_old, n, replacement=True)
    lenience = 1.3
    res = verify_logprobs(
        tokens.unsqueeze(1),
        p_old.log()[tokens].unsqueeze(1),
        p_new.log()[tokens].unsqueeze(1),
        seed=11,
        uids=torch.arange(n),
        options=VerifyOptions(mode=Lenient(lenience)),
    )
    expected = float((p_old * torch.clamp(lenience * p_new / p_old, max=1.0)).sum())
    rate = res.accepted_len.float().mean().item()
    assert abs(rate - expected) < 5 * math.sqrt(expected * (1 - expected) / n)


def _random_case(bsz=6, max_len=12, vocab=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(bsz, max_len, vocab, generator=g) * 2
    ids = torch.randint(0, vocab, (bsz, max_len), generator=g)
    lengths = torch.randint(0, max_len + 1, (bsz,), generator=g)
    old = (
        torch.log_softmax(logits + torch.randn(bsz, max_len, vocab, generator=g) * 0.3, -1)
        .gather(-1, ids.unsqueeze(-1))
        .squeeze(-1)
    )
    return logits, ids, lengths, old


def test_identical_policies_reuse_everything_when_l_at_least_1():
    logits, ids, lengths, _ = _random_case()
    same = torch.log_softmax(logits, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    for lenience in (1.0, math.exp(0.5)):
        res = verify_logits(
            ids, same, logits, lengths, seed=3, uids=torch.arange(6), options=VerifyOptions(mode=Lenient(lenience))
        )
        assert torch.equal(res.accepted_len, lengths)
        assert bool(res.full_reuse.all())


def test_infinite_lenience_reuses_everything_and_tiny_lenience_nothing():
    logits, ids, lengths, old = _random_case(seed=1)
    old = torch.zeros_like(old)  # old policy was certain: every ratio < 1
    res = verify_logits(ids, old, logits, lengths, seed=1, options=VerifyOptions(mode=Lenient(float("inf"))))
    assert torch.equal(res.accepted_len, lengths)
    res = verify_logits(ids, old, logits, lengths, seed=1, options=VerifyOptions(mode=Lenient(1e-30)))
    assert int(res.accepted_len.sum()) == 0
    res = verify_logits(ids, old, logits, lengths, seed=1, options=VerifyOptions(mode=Lenient(0.0)))
    assert int(res.accepted_len.sum()) == 0
    assert res.stats.full_reuse_count == int((lengths == 0).sum())


def test_first_rejection_index_is_the_number_of_leading_accepts():
    logits, ids, lengths, old = _random_case(bsz=16, seed=2)
    res = verify_logits(
        ids,
        old,
        logits,
        lengths,
        seed=5,
        uids=torch.arange(16),
        options=VerifyOptions(mode=Lenient(1.0), return_accept_mask=True),
    )
    for b in range(16):
        row = res.accept_mask[b, : lengths[b]].tolist()
        expected = row.index(False) if False in row else int(lengths[b])
        assert int(res.accepted_len[b]) == expected
        assert not res.accept_mask[b, lengths[b] :].any()


def test_decisions_invariant_under_permutation_and_padding():
    logits, ids, lengths, old = _random_case(bsz=8, seed=4)
    uids = torch.tensor([11, 5, 99, 3, 7, 1000, -4, 2**62])
    base = verify_logits(ids, old, logits, lengths, seed=9, uids=uids)
    perm = torch.randperm(8, generator=torch.Generator().manual_seed(0))
    res = verify_logits(ids[perm], old[perm], logits[perm], lengths[perm], seed=9, uids=uids[perm])
    assert torch.equal(res.accepted_len, base.accepted_len[perm])
    pad = 5
    res = verify_logits(
        torch.cat([ids, torch.full((8, pad), 7)], 1),
        torch.cat([old, torch.full((8, pad), -0.5)], 1),
        torch.cat([logits, torch.randn(8, pad, logits.shape[2])], 1),
        lengths,
        seed=9,
        uids=uids,
    )
    assert torch.equal(res.accepted_len, base.accepted_len)
    assert torch.allclose(res.new_logprobs[:, : ids.shape[1]], base.new_logprobs)
    assert bool((res.new_logprobs[:, ids.shape[1] :] == 0).all())


def test_a_prefix_mask_verifies_as_its_lengths():
    logits, ids, lengths, old = _random_case(seed=3)
    mask = torch.arange(ids.shape[1]).unsqueeze(0) < lengths.unsqueeze(1)
    a = verify_logits(ids, old, logits, lengths, seed=4, uids=torch.arange(6))
    b = verify_logits(ids, old, logits, mask, seed=4, uids=torch.arange(6))
    assert torch.equal(a.accepted_len, b.accepted_len) and torch.equal(a.new_logprobs, b.new_logprobs)
    assert a.stats.to_dict() == b.stats.to_dict()


def test_temperature_and_score_sources_agree():
    torch.manual_seed(0)
    bsz, max_len, d, vocab = 3, 5, 8, 20
    hidden = torch.randn(bsz, max_len, d)
    weight = torch.randn(vocab, d)
    bias = torch.randn(vocab)
    ids = torch.randint(0, vocab, (bsz, max_len))
    old = torch.full((bsz, max_len), -2.0)
    logits = hidden @ weight.T + bias
    expected = torch.log_softmax(logits.double() / 0.7, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    options = VerifyOptions(sampling=SamplingSettings(temperature=0.7))
    a = verify_logits(ids, old, logits, seed=1, options=options)
    b = verify_hidden(ids, old, hidden, SimpleNamespace(weight=weight, bias=bias), seed=1, options=options)
    c = verify_logprobs(ids, old, expected.float(), seed=1)
    head = torch.nn.Linear(d, vocab)
    with torch.no_grad():
        head.weight.copy_(weight)
        head.bias.copy_(bias)
    e = verify_hidden(ids, old, hidden, head, seed=1, options=options)  # a module's .weight and .bias
    assert torch.allclose(a.new_logprobs.double(), expected, atol=1e-5)
    assert torch.allclose(b.new_logprobs.double(), expected, atol=1e-4)
    assert torch.equal(b.new_logprobs, e.new_logprobs)
    assert torch.equal(a.accepted_len, b.accepted_len) and torch.equal(a.accepted_len, c.accepted_len)
    # a bare weight tensor is the head without a bias
    f = verify_hidden(ids, old, hidden, weight, seed=1, options=options)
    no_bias = torch.log_softmax((hidden @ weight.T).double() / 0.7, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(f.new_logprobs.double(), no_bias, atol=1e-4)


def test_top_k_outside_support_is_rejected():
    logits = torch.tensor([[[5.0, 4.0, 0.0, -1.0]]])
    ids = torch.tensor([[2]])
    res = verify_logits(
        ids,
        torch.tensor([[-3.0]]),
        logits,
        seed=0,
        options=VerifyOptions(mode=Lenient(1e6), sampling=SamplingSettings(top_k=2)),
    )
    assert res.new_logprobs[0, 0].item() == float("-inf")
    assert int(res.accepted_len[0]) == 0


def test_random_reuse_is_uniform_over_0_to_R():
    n, length = 30000, 9
    res = verify_logprobs(
        torch.zeros((n, length), dtype=torch.long),
        torch.full((n, length), -1.0),
        torch.full((n, length), -1.0),
        seed=2,
        uids=torch.arange(n),
        options=VerifyOptions(mode="random"),
    )
    counts = torch.bincount(res.accepted_len, minlength=length + 1).float()
    expected = n / (length + 1)
    assert counts.numel() == length + 1
    assert float(((counts - expected) ** 2 / expected).sum()) < 40  # chi-square, 9 dof: p < 1e-5
    # n is the random-reuse draw itself, whatever the scores; a draft may be reused whole; an empty draft gives 0
    lengths = torch.full((n,), length)
    assert torch.equal(res.accepted_len, random_reuse_index(2, torch.arange(n), lengths))
    assert int(res.accepted_len.max()) == length and bool(res.full_reuse.any())
    assert random_reuse_index(2, torch.arange(3), torch.zeros(3, dtype=torch.long)).tolist() == [0, 0, 0]


def test_accepted_drift_is_the_mean_gap_over_the_accepted_tokens():
    from spec_rl.acceptance.prefixes import accepted_drift

    new = torch.tensor([[-1.0, -2.0, -0.5], [-0.1, -0.2, -0.3]])
    old = torch.tensor([[-1.5, -1.0, -0.5], [-0.4, -0.2, -9.0]])
    lengths = torch.tensor([3, 2])
    # accepted: row 0 tokens 0-1 (gaps 0.5, 1.0); row 1 up to its length, tokens 0-1 (gaps 0.3, 0.0)
    assert accepted_drift(new, old, lengths, torch.tensor([2, 3])) == pytest.approx(0.45)
    assert accepted_drift(new, old, lengths, torch.zeros(2, dtype=torch.long)) == 0.0  # nothing accepted


def test_float64_reference_matches_float32_path():
    logits, ids, lengths, old = _random_case(seed=6)
    scores = DraftScores(logits=logits)
    a = reference_verify(ids, old, lengths, torch.arange(6), scores, seed=1, options=VerifyOptions())
    b = reference_verify(
        ids, old, lengths, torch.arange(6), scores, seed=1, options=VerifyOptions(), compute_dtype=torch.float64
    )
    assert torch.allclose(a.new_logprobs, b.new_logprobs, atol=1e-5)


def test_stats():
    logits, ids, lengths, old = _random_case(seed=8)
    res = verify_logits(ids, old, logits, lengths, seed=1, options=VerifyOptions(mode=Lenient(1.0)))
    s = res.stats
    assert s.num_samples == 6 and s.draft_tokens == int(lengths.sum())
    assert s.accepted_tokens == int(res.accepted_len.sum())
    assert s.full_reuse_ratio == pytest.approx(float(res.full_reuse.float().mean()))


# ------------------------------------------------------------------ bad input
def test_bad_inputs_raise_clear_errors():
    logits, ids, lengths, old = _random_case()
    with pytest.raises(ValueError, match="old_logprobs has shape"):
        verify_logits(ids, old[:, :3], logits)
    with pytest.raises(ValueError, match="logits has shape"):
        verify_logits(ids, old, logits[:, :3])
    bad = logits.clone()
    bad[0, 0, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        verify_logits(ids, old, bad)
    with pytest.raises(ValueError, match=r"lenience must be a number \(inf allowed\) >= 0, got -1.0"):
        VerifyOptions(mode=Lenient(-1.0))
    with pytest.raises(ValueError, match="lenience must be a number"):
        VerifyOptions(mode=Lenient(float("nan")))
    big = ids.clone()
    big[0, 0] = logits.shape[2]
    with pytest.raises(ValueError, match="outside"):
        verify_logits(big, old, logits)
    with pytest.raises(ValueError, match="exactly one"):
        verify_scores(ids, old, DraftScores())
    with pytest.raises(ValueError, match="<= 0"):
        verify_logits(ids, old.abs() + 1, logits)
    with pytest.raises(ValueError, match="temperature"):
        VerifyOptions(sampling=SamplingSettings(temperature=0.0))
    holey = torch.ones_like(ids, dtype=torch.bool).index_fill(1, torch.tensor([0]), False)
    with pytest.raises(ValueError, match="contiguous prefix"):
        verify_logits(ids, old, logits, holey)
    with pytest.raises(TypeError, match="integer"):
        verify_logits(ids.float(), old, logits)
    with pytest.raises(ValueError, match="lengths must lie"):
        verify_logits(ids, old, logits, torch.full((6,), 99))
    with pytest.raises(TypeError, match="options must be a VerifyOptions, got dict"):
        verify_logits(ids, old, logits, options={"lenience": 2.0})
    with pytest.raises(TypeError, match="lm_head must be a"):
        verify_hidden(ids, old, torch.randn(6, ids.shape[1], 4), object())


def test_nan_at_masked_positions_is_ignored():
    logits, ids, _, old = _random_case()
    lengths = torch.full((6,), 4)
    logits[:, 6:] = float("nan")
    old[:, 6:] = float("nan")
    ids[:, 6:] = -1  # padding ids may be anything
    res = verify_logits(ids, old, logits, lengths, options=VerifyOptions(mode=Lenient(1.0)))
    assert not torch.isnan(res.new_logprobs).any()


def test_positive_new_logprobs_and_inf_logits_raise():
    logits, ids, lengths, old = _random_case()
    with pytest.raises(ValueError, match="new_logprobs must be log-probabilities"):
        verify_logprobs(ids, old, torch.ones_like(old))
    bad = logits.clone()
    bad[0, 0, 3] = float("inf")
    with pytest.raises(ValueError, match=r"\+inf"):
        verify_logits(ids, old, bad, options=VerifyOptions(backend="reference"))


def test_lenience_of_the_wrong_type_names_the_argument():
    with pytest.raises(TypeError, match="lenience must be a real number"):
        VerifyOptions(mode=Lenient("2"))
    with pytest.raises(TypeError, match="lenience must be a real number"):
        VerifyOptions(mode=Lenient([0.5]))
    assert VerifyOptions(mode=Lenient(2)).mode.log_lenience == pytest.approx(math.log(2))
    assert VerifyOptions(mode=Lenient(0)).mode.log_lenience == float("-inf")
    assert VerifyOptions(mode=Lenient(float("inf"))).mode.log_lenience == float("inf")


def test_a_lenience_applies_to_the_lenient_rule_only():
    for rule in ("exact", "random"):
        with pytest.raises(TypeError, match="lenience"):
            RULES[rule](lenience=2.0)
        assert VerifyOptions(mode=rule).mode.log_lenience == 0.0
    with pytest.raises(ValueError, match="mode must be one of"):
        VerifyOptions(mode="random-ref")
    with pytest.raises(ValueError, match="backend must be one of"):
        VerifyOptions(backend="cuda")
    with pytest.raises(TypeError, match="sampling must be a SamplingSettings"):
        VerifyOptions(sampling={"temperature": 0.7})
