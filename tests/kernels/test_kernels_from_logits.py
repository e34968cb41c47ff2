"""From-logits kernel (K.verify_padded; the packed entry point under a forced tile config) vs the float64 reference
(spec_rl.acceptance.reference.reference_verify)."""

from __future__ import annotations

import pytest
import torch
from _kernel_helpers import (
    DEVICE,
    LOGITS_ATOL,
    K,
    assert_lp_close,
    assert_same_decisions,
    far_from_ties_old_logprobs,
    kernel_verify,
    reference64,
)

from spec_rl.acceptance.reference import lengths_mask, rejection_index
from spec_rl.acceptance.rules.lenient import lenient_test
from spec_rl.sampling.philox import philox_uniform

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # interpreter: fp overflow to inf is intended


def _case(bsz, max_len, vocab, lengths, dtype, *, seed=11, temperature=1.0, log_l=0.5, gen_seed=0, scale=3.0):
    gen = torch.Generator().manual_seed(gen_seed)
    logits = (torch.randn(bsz, max_len, vocab, generator=gen) * scale).to(dtype)
    ids = torch.randint(0, vocab, (bsz, max_len), generator=gen)
    lengths = torch.as_tensor(lengths, dtype=torch.int64)
    uids = torch.randint(-(2**63), 2**63 - 1, (bsz,), generator=gen, dtype=torch.int64)
    ref0 = reference64(
        draft_ids=ids,
        old_logprobs=torch.zeros(bsz, max_len),
        lengths=lengths,
        seed=seed,
        uids=uids,
        log_lenience=0.0,
        logits=logits,
        temperature=temperature,
    )
    old = far_from_ties_old_logprobs(ref0.new_logprobs, lengths, seed, uids, log_l, gen)
    return dict(
        logits=logits, ids=ids, old=old, lengths=lengths, uids=uids, seed=seed, temperature=temperature, log_l=log_l
    )


def _run(case, config=None, logits=None, **extra):
    lg = case["logits"] if logits is None else logits
    out = kernel_verify(
        case["ids"].to(DEVICE),
        case["old"].to(DEVICE),
        case["lengths"].to(DEVICE),
        seed=case["seed"],
        uids=case["uids"].to(DEVICE),
        log_lenience=case["log_l"],
        logits=lg.to(DEVICE),
        temperature=case["temperature"],
        return_accept_mask=True,
        config=config,
        **extra,
    )
    ref = reference64(
        draft_ids=case["ids"],
        old_logprobs=case["old"],
        lengths=case["lengths"],
        seed=case["seed"],
        uids=case["uids"],
        log_lenience=case["log_l"],
        logits=case["logits"],
        temperature=case["temperature"],
        return_accept_mask=True,
        **extra,
    )
    return out, ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_matches_reference_ragged_vocab(dtype, temperature):
    # V = 1000 with 256-column tiles: three full tiles and a ragged tail.
    case = _case(4, 12, 1000, [12, 5, 0, 9], dtype, temperature=temperature, gen_seed=1)
    for config in (K.LogitsConfig(block_v=256, num_warps=4, block_r=4), None):  # packed under 256-column tiles; padded
        out, ref = _run(case, config)
        assert out.new_logprobs.dtype == torch.float32 and out.accepted_len.dtype == torch.int64
        assert_lp_close(out.new_logprobs, ref.new_logprobs, LOGITS_ATOL)
        assert_same_decisions(out, ref)
    assert 0 < int(ref.accepted_len.sum()) < int(case["lengths"].sum())  # a real mix


def test_vocab_smaller_than_one_tile_and_default_config():
    case = _case(3, 6, 100, [6, 6, 2], torch.float32, gen_seed=2)
    out, ref = _run(case, K.LogitsConfig(block_v=256, num_warps=4, block_r=2))
    assert_lp_close(out.new_logprobs, ref.new_logprobs, LOGITS_ATOL)
    assert_same_decisions(out, ref)
    out2, _ = _run(case)  # default (deterministic) config
    assert_lp_close(out2.new_logprobs, ref.new_logprobs, LOGITS_ATOL)
    assert_same_decisions(out2, ref)


def test_long_response_single_sample():
    case = _case(1, 300, 64, [300], torch.bfloat16, log_l=2.0, gen_seed=3)
    out, ref = _run(case)
    assert_lp_close(out.new_logprobs, ref.new_logprobs, LOGITS_ATOL)
    assert_same_decisions(out, ref)


def test_neg_inf_logits_reject_impossible_tokens():
    case = _case(3, 8, 300, [8, 8, 4], torch.float32, log_l=3.0, gen_seed=4)
    logits = case["logits"].clone()
    ids = case["ids"]
    logits[0, 2, ids[0, 2]] = float("-inf")  # draft token impossible now
    logits[1, :, 150:] = float("-inf")  # masked half of the vocabulary (whole tiles and lanes)
    logits[2, 1, :] = float("-inf")
    logits[2, 1, ids[2, 1]] = 0.0  # only the draft token is possible: lp = 0
    case["logits"] = logits
    out, ref = _run(case, K.LogitsConfig(block_v=64, num_warps=2, block_r=4))
    assert out.new_logprobs[0, 2].item() == float("-inf")
    assert not bool(out.accept_mask[0, 2])
    assert out.new_logprobs[2, 1].item() == 0.0
    assert_lp_close(out.new_logprobs, ref.new_logprobs, LOGITS_ATOL)
    assert_same_decisions(out, ref)
    assert int(out.accepted_len[0]) <= 2


def test_nan_in_a_scored_row_raises():
    case = _case(2, 5, 200, [5, 3], torch.bfloat16, gen_seed=5)
    logits = case["logits"].clone()
    logits[1, 2, 17] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        _run(case, logits=logits)
    logits[1, 2, 17] = float("inf")
    with pytest.raises(ValueError, match="NaN"):
        _run(case, logits=logits)


def test_padding_is_never_read():
    """NaN logits and out-of-range ids at padded positions are ignored."""
    case = _case(3, 7, 128, [7, 2, 0], torch.float32, gen_seed=6)
    ref_out, ref = _run(case)
    logits = case["logits"].clone()
    logits[1, 2:] = float("nan")
    logits[2] = float("nan")
    ids = case["ids"].clone()
    ids[1, 2:] = -5
    ids[2] = 10**6
    out = kernel_verify(
        ids.to(DEVICE),
        case["old"].to(DEVICE),
        case["lengths"].to(DEVICE),
        seed=case["seed"],
        uids=case["uids"].to(DEVICE),
        log_lenience=case["log_l"],
        logits=logits.to(DEVICE),
        return_accept_mask=True,
    )
    assert torch.equal(out.new_logprobs.cpu(), ref_out.new_logprobs.cpu())
    assert bool((out.new_logprobs[~lengths_mask(case["lengths"], 7).to(DEVICE)] == 0).all())
    assert_same_decisions(out, ref)
    assert out.accepted_len[2].item() == 0 and bool(out.full_reuse[2])


def test_empty_batch_and_all_empty_responses():
    case = _case(2, 4, 50, [0, 0], torch.float32, gen_seed=7)
    out, ref = _run(case)
    assert torch.equal(out.accepted_len.cpu(), torch.zeros(2, dtype=torch.int64))
    assert_same_decisions(out, ref)
    empty = kernel_verify(
        torch.zeros(0, 3, dtype=torch.int64, device=DEVICE),
        torch.zeros(0, 3, device=DEVICE),
        torch.zeros(0, dtype=torch.int64, device=DEVICE),
        seed=0,
        uids=torch.zeros(0, dtype=torch.int64, device=DEVICE),
        log_lenience=0.0,
        logits=torch.zeros(0, 3, 10, device=DEVICE),
    )
    assert empty.accepted_len.shape == (0,) and empty.stats.num_samples == 0


def test_non_contiguous_row_strides():
    case = _case(3, 6, 200, [6, 4, 5], torch.bfloat16, temperature=0.7, gen_seed=8)
    base = torch.randn(3, 12, 256).to(torch.bfloat16)
    base[:, ::2, :200] = case["logits"]
    view = base[:, ::2, :200]  # row stride 512, sample stride 3072, unit vocab stride
    assert not view.is_contiguous()
    out, ref = _run(case, logits=view)
    assert_lp_close(out.new_logprobs, ref.new_logprobs, LOGITS_ATOL)
    assert_same_decisions(out, ref)


@pytest.mark.parametrize("log_l", [float("inf"), float("-inf")])
def test_lenience_extremes(log_l):
    case = _case(3, 5, 64, [5, 0, 3], torch.float32, gen_seed=9)
    case["log_l"] = log_l
    out, ref = _run(case)
    assert_same_decisions(out, ref)
    expected = case["lengths"] if log_l > 0 else torch.zeros(3, dtype=torch.int64)
    assert torch.equal(out.accepted_len.cpu(), expected)


def test_random_reuse_rule_identical():
    case = _case(5, 9, 80, [9, 0, 3, 9, 1], torch.float32, gen_seed=10)
    out, ref = _run(case, rule="random")
    assert_lp_close(out.new_logprobs, ref.new_logprobs, LOGITS_ATOL)
    assert_same_decisions(out, ref)


def test_decisions_exactly_follow_the_rule_on_the_kernel_logprobs():
    """Near ties included: given the kernel's own lp_new, the decisions are the reference rule's, bit for bit."""
    gen = torch.Generator().manual_seed(12)
    bsz, max_len, vocab = 4, 10, 96
    logits = torch.randn(bsz, max_len, vocab, generator=gen) * 2
    ids = torch.randint(0, vocab, (bsz, max_len), generator=gen)
    lengths = torch.tensor([10, 7, 10, 2])
    uids = torch.tensor([1, 2, 3, 4])
    u = philox_uniform(5, uids.unsqueeze(1), torch.arange(max_len).unsqueeze(0))

    def run(old):
        return kernel_verify(
            ids.to(DEVICE),
            old.to(DEVICE),
            lengths.to(DEVICE),
            seed=5,
            uids=uids.to(DEVICE),
            log_lenience=0.1,
            logits=logits.to(DEVICE),
            return_accept_mask=True,
        )

    lp = run(torch.zeros(bsz, max_len)).new_logprobs.cpu()  # lp_new does not depend on old
    # old = lp + log l - log u + tiny noise: every token sits within ~1e-7 of its tie.
    noise = 1e-9 * torch.randn(bsz, max_len, generator=gen, dtype=torch.float64)
    old = (lp.double() + 0.1 - torch.log(u.double()) + noise).float()
    out = run(old)
    assert torch.equal(out.new_logprobs.cpu(), lp)
    rule = lenient_test(out.new_logprobs.cpu(), old, u, 0.1) & lengths_mask(lengths, max_len)
    assert torch.equal(out.accept_mask.cpu(), rule)
    assert torch.equal(out.accepted_len.cpu(), rejection_index(rule, lengths))


def test_permutation_and_padding_invariance_and_determinism():
    case = _case(4, 6, 150, [6, 3, 5, 1], torch.bfloat16, gen_seed=13)
    out, _ = _run(case)
    perm = torch.tensor([2, 0, 3, 1])
    pad = 5
    logits_p = torch.full((4, 6 + pad, 150), float("nan")).to(torch.bfloat16)
    logits_p[:, :6] = case["logits"][perm]
    ids_p = torch.zeros(4, 6 + pad, dtype=torch.int64)
    ids_p[:, :6] = case["ids"][perm]
    old_p = torch.zeros(4, 6 + pad)
    old_p[:, :6] = case["old"][perm]
    out_p = kernel_verify(
        ids_p.to(DEVICE),
        old_p.to(DEVICE),
        case["lengths"][perm].to(DEVICE),
        seed=case["seed"],
        uids=case["uids"][perm].to(DEVICE),
        log_lenience=case["log_l"],
        logits=logits_p.to(DEVICE),
        return_accept_mask=True,
    )
    assert torch.equal(out_p.accepted_len.cpu(), out.accepted_len.cpu()[perm])
    assert torch.equal(out_p.new_logprobs.cpu()[:, :6], out.new_logprobs.cpu()[perm])  # bit-identical
    assert torch.equal(out_p.accept_mask.cpu()[:, :6], out.accept_mask.cpu()[perm])
    again, _ = _run(case)
    assert torch.equal(again.new_logprobs.cpu(), out.new_logprobs.cpu())
