"""Public API of spec_rl.kernels: packed entry points, score-only helpers, dispatch contract."""

from __future__ import annotations

import math

import pytest
import torch
from _kernel_helpers import DEVICE, HIDDEN_ATOL, LOGITS_ATOL, K, assert_lp_close, kernel_verify, reference64
from modes import rule_mode

from spec_rl.acceptance.dispatch import VerifyOptions, verify_logits, verify_logprobs
from spec_rl.acceptance.reference import lengths_mask, reference_verify
from spec_rl.acceptance.scores import DraftScores
from spec_rl.sampling.distribution import SamplingSettings, token_logprobs

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def _padded_case(gen_seed=0, vocab=120, d=24):
    gen = torch.Generator().manual_seed(gen_seed)
    lengths = torch.tensor([5, 0, 3, 6])
    bsz, max_len = 4, 6
    logits = torch.randn(bsz, max_len, vocab, generator=gen) * 2
    hidden = torch.randn(bsz, max_len, d, generator=gen)
    weight = torch.randn(vocab, d, generator=gen) * 0.4
    ids = torch.randint(0, vocab, (bsz, max_len), generator=gen)
    old = -torch.rand(bsz, max_len, generator=gen) * 6
    uids = torch.tensor([10, -20, 2**62, 7])
    return dict(logits=logits, hidden=hidden, weight=weight, ids=ids, old=old, lengths=lengths, uids=uids)


def _pack(c):
    valid = lengths_mask(c["lengths"], c["ids"].shape[1])
    cu = torch.zeros(len(c["lengths"]) + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(c["lengths"], 0)
    return valid, cu


def test_rows_from_cu_seqlens():
    cu = torch.tensor([0, 3, 3, 5], device=DEVICE)
    row_sample, row_token, lengths = K.rows_from_cu_seqlens(cu)
    assert row_sample.cpu().tolist() == [0, 0, 0, 2, 2]
    assert row_token.cpu().tolist() == [0, 1, 2, 0, 1]
    assert lengths.cpu().tolist() == [3, 0, 2]
    with pytest.raises(ValueError):
        K.rows_from_cu_seqlens(torch.tensor([1, 3]))
    with pytest.raises(ValueError):
        K.rows_from_cu_seqlens(torch.tensor([0, 3, 2]))
    ids, old, uids = torch.arange(5, device=DEVICE), torch.zeros(5, device=DEVICE), torch.arange(3, device=DEVICE)
    drafts = K.PackedDrafts.from_cu_seqlens(cu, ids, old, uids, row_offsets_multiple_of=4)
    assert drafts.row_sample.cpu().tolist() == [0, 0, 0, 2, 2] and drafts.row_token.cpu().tolist() == [0, 1, 2, 0, 1]
    assert drafts.lengths.cpu().tolist() == [3, 0, 2] and drafts.row_offsets_multiple_of == 4
    assert drafts.draft_ids is ids and drafts.old_logprobs is old and drafts.uids is uids


@pytest.mark.parametrize("source", ["logits", "hidden"])
def test_packed_equals_padded(source):
    c = _padded_case(1)
    valid, cu = _pack(c)
    ids_p, old_p = c["ids"][valid].to(DEVICE), c["old"][valid].to(DEVICE)
    drafts = K.PackedDrafts.from_cu_seqlens(cu.to(DEVICE), ids_p, old_p, c["uids"].to(DEVICE))
    common = dict(seed=99, log_lenience=0.4, temperature=0.8)
    if source == "logits":
        packed = K.verify_packed_logits(c["logits"][valid].to(DEVICE), drafts, **common)
        padded = kernel_verify(
            c["ids"].to(DEVICE),
            c["old"].to(DEVICE),
            c["lengths"].to(DEVICE),
            seed=99,
            uids=c["uids"].to(DEVICE),
            log_lenience=0.4,
            temperature=0.8,
            logits=c["logits"].to(DEVICE),
            return_accept_mask=True,
        )
    else:
        packed = K.verify_packed_hidden(c["hidden"][valid].to(DEVICE), c["weight"].to(DEVICE), drafts, **common)
        padded = kernel_verify(
            c["ids"].to(DEVICE),
            c["old"].to(DEVICE),
            c["lengths"].to(DEVICE),
            seed=99,
            uids=c["uids"].to(DEVICE),
            log_lenience=0.4,
            temperature=0.8,
            hidden_states=c["hidden"].to(DEVICE),
            lm_head_weight=c["weight"].to(DEVICE),
            return_accept_mask=True,
        )
    assert torch.equal(packed.new_logprobs.cpu(), padded.new_logprobs.cpu()[valid])
    assert torch.equal(packed.accept.cpu(), padded.accept_mask.cpu()[valid])
    assert torch.equal(packed.accepted_len.cpu(), padded.accepted_len.cpu())


def test_packed_padding_rows_are_skipped():
    c = _padded_case(2)
    valid, cu = _pack(c)
    row_sample, row_token, lengths = K.rows_from_cu_seqlens(cu)
    logits = c["logits"][valid]
    n = logits.shape[0]
    # Interleave padding rows (sample -1) full of NaN.
    big = torch.full((2 * n, logits.shape[1]), float("nan"))
    big[::2] = logits
    rs = torch.full((2 * n,), -1, dtype=torch.int32)
    rs[::2] = row_sample
    rt = torch.zeros(2 * n, dtype=torch.int32)
    rt[::2] = row_token
    ids = torch.zeros(2 * n, dtype=torch.int64)
    ids[::2] = c["ids"][valid]
    old = torch.zeros(2 * n)
    old[::2] = c["old"][valid]
    lengths, uids = lengths.to(DEVICE), c["uids"].to(DEVICE)
    dense = K.PackedDrafts(
        c["ids"][valid].to(DEVICE),
        c["old"][valid].to(DEVICE),
        row_sample.to(DEVICE),
        row_token.to(DEVICE),
        lengths,
        uids,
    )
    padded = K.PackedDrafts(ids.to(DEVICE), old.to(DEVICE), rs.to(DEVICE), rt.to(DEVICE), lengths, uids)
    ref = K.verify_packed_logits(logits.to(DEVICE), dense, seed=3, log_lenience=1.0)
    out = K.verify_packed_logits(big.to(DEVICE), padded, seed=3, log_lenience=1.0)
    assert torch.equal(out.new_logprobs.cpu()[::2], ref.new_logprobs.cpu())
    assert bool((out.new_logprobs.cpu()[1::2] == 0).all()) and not bool(out.accept.cpu()[1::2].any())
    assert torch.equal(out.accepted_len.cpu(), ref.accepted_len.cpu())


def test_score_only_helpers_match_reference_token_logprobs():
    c = _padded_case(3)
    logits = c["logits"].reshape(-1, c["logits"].shape[-1])
    ids = c["ids"].reshape(-1)
    lp = K.logprobs_from_logits(logits.to(DEVICE), ids.to(DEVICE), temperature=0.6).cpu()
    assert_lp_close(lp, token_logprobs(logits, ids, 0.6, dtype=torch.float64), LOGITS_ATOL)
    hidden = c["hidden"].reshape(-1, c["hidden"].shape[-1])
    bias = torch.randn(c["weight"].shape[0])
    lp_h = K.logprobs_from_hidden(
        hidden.to(DEVICE), c["weight"].to(DEVICE), ids.to(DEVICE), lm_head_bias=bias.to(DEVICE), temperature=1.3
    ).cpu()
    ref_logits = hidden.double() @ c["weight"].double().T + bias.double()
    assert_lp_close(lp_h, token_logprobs(ref_logits, ids, 1.3, dtype=torch.float64), HIDDEN_ATOL)
    with pytest.raises(ValueError, match="NaN"):
        bad = logits.clone()
        bad[3, 5] = float("nan")
        K.logprobs_from_logits(bad.to(DEVICE), ids.to(DEVICE))


def test_new_logprobs_source_is_the_reference():
    """verify_logprobs with backend="triton" needs no kernel: it gives the reference's result."""
    c = _padded_case(4)
    new = -torch.rand(4, 6) * 5
    for rule, lenience in (("lenient", math.exp(0.3)), ("random", 1.0), ("exact", 1.0)):
        options = VerifyOptions(mode=rule_mode(rule, lenience), return_accept_mask=True)
        out = verify_logprobs(
            c["ids"].to(DEVICE),
            c["old"].to(DEVICE),
            new.to(DEVICE),
            c["lengths"].to(DEVICE),
            seed=5,
            uids=c["uids"].to(DEVICE),
            options=VerifyOptions(mode=rule_mode(rule, lenience), return_accept_mask=True, backend="triton"),
        )
        ref = reference_verify(
            c["ids"], c["old"], c["lengths"], c["uids"], DraftScores(new_logprobs=new), seed=5, options=options
        )
        assert torch.equal(out.accepted_len.cpu(), ref.accepted_len)
        assert torch.equal(out.accept_mask.cpu(), ref.accept_mask)
        assert torch.equal(out.new_logprobs.cpu(), ref.new_logprobs)


def test_top_k_top_p_not_implemented_and_bad_arguments():
    c = _padded_case(5)
    ids, old, lengths, uids = (c[k].to(DEVICE) for k in ("ids", "old", "lengths", "uids"))
    logits = c["logits"].to(DEVICE)
    for sampling in (SamplingSettings(top_k=50), SamplingSettings(top_p=0.9)):
        with pytest.raises(NotImplementedError):
            verify_logits(
                ids, old, logits, lengths, uids=uids, options=VerifyOptions(backend="triton", sampling=sampling)
            )
    with pytest.raises(ValueError, match="mode must be one of"):
        VerifyOptions(mode="greedy", backend="triton")
    padded = dict(seed=0, log_lenience=0.0, temperature=1.0)
    with pytest.raises(ValueError, match="exactly one"):
        K.verify_padded(ids, old, lengths, uids, DraftScores(), **padded)
    with pytest.raises(NotImplementedError):
        K.verify_padded(ids, old, lengths, uids, DraftScores(logits=c["logits"].double().to(DEVICE)), **padded)
    with pytest.raises(NotImplementedError):  # the verify functions do not fall back when triton is asked for
        verify_logits(ids, old, c["logits"].double().to(DEVICE), lengths, options=VerifyOptions(backend="triton"))
    with pytest.raises(ValueError, match="block_v"):
        K.LogitsConfig(block_v=100, num_warps=4)


def test_is_available_and_fp32_reference_agreement():
    assert K.is_available(DEVICE)
    assert not K.is_available("meta")
    c = _padded_case(6)
    out = kernel_verify(
        c["ids"].to(DEVICE),
        c["old"].to(DEVICE),
        c["lengths"].to(DEVICE),
        seed=1,
        uids=c["uids"].to(DEVICE),
        log_lenience=0.2,
        logits=c["logits"].to(DEVICE),
    )
    ref = reference64(
        draft_ids=c["ids"],
        old_logprobs=c["old"],
        lengths=c["lengths"],
        seed=1,
        uids=c["uids"],
        log_lenience=0.2,
        logits=c["logits"],
    )
    assert_lp_close(out.new_logprobs, ref.new_logprobs, LOGITS_ATOL)


def test_packed_hidden_with_row_offsets_gathers_rows_without_copy():
    c = _padded_case(7, d=32)
    valid, cu = _pack(c)
    hidden = c["hidden"].to(DEVICE)  # [B, T, d] contiguous
    b_idx, t_idx = valid.nonzero(as_tuple=True)
    offsets = (b_idx * hidden.stride(0) + t_idx * hidden.stride(1)).to(DEVICE)
    ids, old, uids = c["ids"][valid].to(DEVICE), c["old"][valid].to(DEVICE), c["uids"].to(DEVICE)
    kw = dict(seed=4, log_lenience=0.7)

    def drafts(**extra):
        return K.PackedDrafts.from_cu_seqlens(cu.to(DEVICE), ids, old, uids, **extra)

    gathered = K.verify_packed_hidden(
        hidden.view(-1, 32), c["weight"].to(DEVICE), drafts(row_offsets=offsets, row_offsets_multiple_of=8), **kw
    )
    copied = K.verify_packed_hidden(hidden[valid.to(DEVICE)], c["weight"].to(DEVICE), drafts(), **kw)
    assert torch.equal(gathered.new_logprobs.cpu(), copied.new_logprobs.cpu())
    assert torch.equal(gathered.accepted_len.cpu(), copied.accepted_len.cpu())
    with pytest.raises(ValueError, match="power of two"):
        K.verify_packed_hidden(
            hidden.view(-1, 32), c["weight"].to(DEVICE), drafts(row_offsets=offsets, row_offsets_multiple_of=3), **kw
        )
