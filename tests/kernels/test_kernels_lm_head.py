"""Fused LM-head kernel (logits never materialised) vs the float64 reference."""

from __future__ import annotations

import pytest
import torch
from _kernel_helpers import (
    DEVICE,
    HIDDEN_ATOL,
    K,
    assert_lp_close,
    assert_same_decisions,
    far_from_ties_old_logprobs,
    kernel_verify,
    reference64,
)

from spec_rl.acceptance.reference import lengths_mask

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # interpreter: fp overflow to inf is intended

# Small tiles so the tests cross several vocabulary tiles, splits and d-steps.
SMALL = K.LMHeadConfig(block_m=16, block_n=32, block_k=16, num_warps=4, num_stages=2, target_splits=3, merge_block=32)


def _case(bsz, max_len, d, vocab, lengths, dtype, *, bias=False, seed=21, temperature=1.0, log_l=0.5, gen_seed=0):
    gen = torch.Generator().manual_seed(gen_seed)
    hidden = torch.randn(bsz, max_len, d, generator=gen).to(dtype)
    weight = (torch.randn(vocab, d, generator=gen) * (2.0 / d**0.5)).to(dtype)
    b = (torch.randn(vocab, generator=gen)).to(dtype) if bias else None
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
        hidden_states=hidden,
        lm_head_weight=weight,
        lm_head_bias=b,
        temperature=temperature,
    )
    old = far_from_ties_old_logprobs(ref0.new_logprobs, lengths, seed, uids, log_l, gen)
    return dict(
        hidden=hidden,
        weight=weight,
        bias=b,
        ids=ids,
        old=old,
        lengths=lengths,
        uids=uids,
        seed=seed,
        temperature=temperature,
        log_l=log_l,
    )


def _run(case, config=SMALL, hidden=None, weight=None, **extra):
    h = case["hidden"] if hidden is None else hidden
    w = case["weight"] if weight is None else weight
    bias = case["bias"].to(DEVICE) if case["bias"] is not None else None
    out = kernel_verify(
        case["ids"].to(DEVICE),
        case["old"].to(DEVICE),
        case["lengths"].to(DEVICE),
        seed=case["seed"],
        uids=case["uids"].to(DEVICE),
        log_lenience=case["log_l"],
        hidden_states=h.to(DEVICE),
        lm_head_weight=w.to(DEVICE),
        lm_head_bias=bias,
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
        hidden_states=case["hidden"],
        lm_head_weight=case["weight"],
        lm_head_bias=case["bias"],
        temperature=case["temperature"],
        return_accept_mask=True,
        **extra,
    )
    return out, ref


@pytest.mark.parametrize(
    "dtype,bias,temperature",
    [(torch.float32, False, 1.0), (torch.float32, True, 0.7), (torch.bfloat16, False, 0.7), (torch.float16, True, 1.0)],
)
def test_matches_reference(dtype, bias, temperature):
    # V = 200 = 6 tiles of 32 + 8 ragged columns, in 3 splits; d = 40 (not a multiple of 16).
    case = _case(3, 9, 40, 200, [9, 4, 7], dtype, bias=bias, temperature=temperature, gen_seed=1)
    for config in (SMALL, None):  # the packed entry point under small tiles; the padded one (default tiles)
        out, ref = _run(case, config=config)
        assert_lp_close(out.new_logprobs, ref.new_logprobs, HIDDEN_ATOL)
        assert_same_decisions(out, ref)
    assert 0 < int(ref.accepted_len.sum()) < int(case["lengths"].sum())


def test_vocab_smaller_than_one_tile_and_default_config():
    case = _case(2, 5, 32, 20, [5, 3], torch.float32, gen_seed=2)
    out, ref = _run(case)  # V = 20 < block_n = 32: one ragged tile, one split
    assert_lp_close(out.new_logprobs, ref.new_logprobs, HIDDEN_ATOL)
    assert_same_decisions(out, ref)
    out2, _ = _run(case, config=None)
    assert_lp_close(out2.new_logprobs, ref.new_logprobs, HIDDEN_ATOL)
    assert_same_decisions(out2, ref)


def test_long_response_and_single_sample():
    case = _case(1, 300, 32, 64, [300], torch.bfloat16, log_l=1.5, gen_seed=3)
    out, ref = _run(case, config=None)
    assert_lp_close(out.new_logprobs, ref.new_logprobs, HIDDEN_ATOL)
    assert_same_decisions(out, ref)


def test_neg_inf_bias_masks_vocabulary():
    case = _case(2, 6, 32, 100, [6, 6], torch.float32, bias=True, log_l=2.0, gen_seed=4)
    bias = case["bias"].clone()
    bias[40:] = float("-inf")  # whole tiles and whole splits of -inf logits
    case["ids"][0, 1] = 70  # draft token now impossible
    case["bias"] = bias
    out, ref = _run(case)
    assert out.new_logprobs[0, 1].item() == float("-inf")
    assert not bool(out.accept_mask[0, 1])
    assert_lp_close(out.new_logprobs, ref.new_logprobs, HIDDEN_ATOL)
    assert_same_decisions(out, ref)


def test_nan_raises_but_nan_in_padding_is_ignored():
    case = _case(2, 5, 32, 64, [5, 2], torch.bfloat16, gen_seed=5)
    h = case["hidden"].clone()
    h[1, 3:] = float("nan")  # padded positions: never read
    out, ref = _run(case, hidden=h)
    assert_same_decisions(out, ref)
    h[1, 1, 4] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        _run(case, hidden=h)
    w = case["weight"].clone()
    w[7, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        _run(case, weight=w)


def test_empty_responses_and_lenience_extremes():
    case = _case(3, 4, 16, 48, [0, 0, 0], torch.float32, gen_seed=6)
    out, ref = _run(case)
    assert torch.equal(out.accepted_len.cpu(), torch.zeros(3, dtype=torch.int64))
    assert_same_decisions(out, ref)
    case = _case(3, 4, 16, 48, [4, 0, 2], torch.float32, gen_seed=7)
    for log_l, expected in ((float("inf"), [4, 0, 2]), (float("-inf"), [0, 0, 0])):
        case["log_l"] = log_l
        for config in (SMALL, None):
            out, ref = _run(case, config=config)
            assert out.accepted_len.cpu().tolist() == expected
            assert_same_decisions(out, ref)


def test_random_reuse_rule_identical():
    case = _case(4, 6, 16, 40, [6, 1, 0, 4], torch.float32, gen_seed=8)
    out, ref = _run(case, rule="random")
    assert_lp_close(out.new_logprobs, ref.new_logprobs, HIDDEN_ATOL)
    assert_same_decisions(out, ref)


def test_strided_hidden_permutation_padding_invariance_and_determinism():
    case = _case(3, 5, 32, 96, [5, 2, 4], torch.bfloat16, gen_seed=9)
    out, ref = _run(case)
    assert_same_decisions(out, ref)
    # Same rows inside a larger, strided, permuted and padded hidden tensor.
    perm = torch.tensor([2, 0, 1])
    big = torch.full((3, 9, 48), float("nan")).to(torch.bfloat16)
    big[:, :5, :32] = case["hidden"][perm]
    h_view = big[:, :, :32]
    assert not h_view.is_contiguous()
    ids = torch.zeros(3, 9, dtype=torch.int64)
    ids[:, :5] = case["ids"][perm]
    old = torch.zeros(3, 9)
    old[:, :5] = case["old"][perm]
    out_p = kernel_verify(
        ids.to(DEVICE),
        old.to(DEVICE),
        case["lengths"][perm].to(DEVICE),
        seed=case["seed"],
        uids=case["uids"][perm].to(DEVICE),
        log_lenience=case["log_l"],
        hidden_states=h_view.to(DEVICE),
        lm_head_weight=case["weight"].to(DEVICE),
        return_accept_mask=True,
        config=SMALL,
    )
    assert torch.equal(out_p.accepted_len.cpu(), out.accepted_len.cpu()[perm])
    assert torch.equal(out_p.new_logprobs.cpu()[:, :5], out.new_logprobs.cpu()[perm])
    assert torch.equal(out_p.accept_mask.cpu()[:, :5], out.accept_mask.cpu()[perm])
    assert bool((out_p.new_logprobs.cpu()[~lengths_mask(case["lengths"][perm], 9)] == 0).all())
    again, _ = _run(case)
    assert torch.equal(again.new_logprobs.cpu(), out.new_logprobs.cpu())


def test_split_count_does_not_change_decisions():
    case = _case(2, 6, 32, 256, [6, 6], torch.float32, gen_seed=10)
    outs = []
    for splits in (1, 2, 8):
        cfg = K.LMHeadConfig(block_m=16, block_n=32, block_k=16, num_warps=4, num_stages=2, target_splits=splits)
        out, ref = _run(case, config=cfg)
        assert_lp_close(out.new_logprobs, ref.new_logprobs, HIDDEN_ATOL)
        assert_same_decisions(out, ref)
        outs.append(out)
