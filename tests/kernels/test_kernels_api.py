"""The kernels' launchers (the layer under the verify functions): tagged rows and padded drafts agree, padding is
never read, score-only launches, the triton backend's contract."""

from __future__ import annotations

import math

import pytest
import torch
from _kernel_helpers import (
    DEVICE,
    HIDDEN_ATOL,
    LOGITS_ATOL,
    K,
    assert_lp_close,
    kernel_verify,
    packed_rows,
    reference64,
)
from modes import rule_mode

from spec_rl.acceptance.dispatch import VerifyOptions, verify_logits, verify_logprobs
from spec_rl.acceptance.reference import reference_verify
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


def _on(c, *keys):
    return [c[k].to(DEVICE) for k in keys]


@pytest.mark.parametrize("source", ["logits", "hidden"])
def test_packed_rows_equal_padded_rows(source):
    c = _padded_case(1)
    ids, old, lengths, uids = _on(c, "ids", "old", "lengths", "uids")
    settings = dict(seed=99, log_lenience=0.4, temperature=0.8)
    rows, (b, t) = packed_rows(ids, old, lengths, uids, **settings)
    if source == "logits":
        packed = K.verify_logits(c["logits"].to(DEVICE)[b, t], rows)
        padded = K.verify_logits(c["logits"].to(DEVICE), K.DraftRows.padded(ids, old, lengths, uids, **settings))
    else:
        hidden, weight = _on(c, "hidden", "weight")
        packed = K.verify_hidden(hidden[b, t], weight, None, rows)
        padded = K.verify_hidden_padded(hidden, weight, None, ids, old, lengths, uids, **settings)
    assert torch.equal(packed[0].cpu(), padded[0].cpu()[b.cpu(), t.cpu()])
    assert torch.equal(packed[1].cpu(), padded[1].cpu()[b.cpu(), t.cpu()])
    assert torch.equal(packed[2].cpu(), padded[2].cpu())


@pytest.mark.parametrize("seed, log_lenience, temperature", [(2**64 - 1, 0.5, 0.7), (12345, -math.inf, 1.3)])
def test_rule_params_carry_the_rule_bit_exactly(seed, log_lenience, temperature):
    lengths = torch.tensor([2, 0, 3])
    rows = K.DraftRows.padded(
        torch.zeros(3, 3, dtype=torch.int64),
        torch.zeros(3, 3),
        lengths,
        torch.arange(3),
        seed=seed,
        log_lenience=log_lenience,
        temperature=temperature,
    )
    assert rows.row_sample.tolist() == [0, 0, -1, -1, -1, -1, 2, 2, 2]
    assert rows.row_token.tolist() == [0, 1, 2] * 3
    w = [x & 0xFFFFFFFF for x in rows.params("cpu").tolist()]
    assert w[0] | (w[1] << 32) == seed % 2**64
    f64 = [torch.tensor([lo | (hi << 32)], dtype=torch.int64).view(torch.float64).item() for lo, hi in (w[2:4], w[4:6])]
    assert f64 == [log_lenience if math.isfinite(log_lenience) else 0.0, temperature]
    c = torch.tensor([w[6]], dtype=torch.int64).to(torch.int32).view(torch.float32).item()
    assert c == torch.tensor(math.log2(math.e) / temperature, dtype=torch.float32).item()


def test_padding_rows_are_skipped():
    c = _padded_case(2)
    ids, old, lengths, uids = _on(c, "ids", "old", "lengths", "uids")
    settings = dict(seed=3, log_lenience=1.0, temperature=1.0)
    dense, (b, t) = packed_rows(ids, old, lengths, uids, **settings)
    n = dense.ids.shape[0]
    logits = c["logits"].to(DEVICE)[b, t]
    big = torch.full((2 * n, logits.shape[1]), float("nan"), device=DEVICE)  # padding rows (sample -1) of NaN
    big[::2] = logits
    rs = torch.full((2 * n,), -1, dtype=torch.int32, device=DEVICE)
    rs[::2] = dense.row_sample
    rt = torch.zeros(2 * n, dtype=torch.int32, device=DEVICE)
    rt[::2] = dense.row_token
    spread = torch.zeros(2 * n, dtype=torch.int64, device=DEVICE)
    spread[::2] = dense.ids
    spread_old = torch.zeros(2 * n, device=DEVICE)
    spread_old[::2] = dense.old
    padded = K.DraftRows(spread, spread_old, dense.lengths, dense.uids, rs, rt, 3, 1.0, 1.0, dense.mode)
    ref = K.verify_logits(logits, dense)
    out = K.verify_logits(big, padded)
    assert torch.equal(out[0].cpu()[::2], ref[0].cpu())
    assert bool((out[0].cpu()[1::2] == 0).all()) and not bool(out[1].cpu()[1::2].any())
    assert torch.equal(out[2].cpu(), ref[2].cpu())


def test_score_only_rows_match_reference_token_logprobs():
    c = _padded_case(3)
    lengths = torch.full((4,), 6)
    ids, old, uids = _on(c, "ids", "old", "uids")
    rows = K.DraftRows.padded(
        ids, old, lengths.to(DEVICE), uids, seed=0, log_lenience=0.0, temperature=0.6, score_only=True
    )
    lp, accept, n = K.verify_logits(c["logits"].to(DEVICE), rows)
    want = token_logprobs(c["logits"], c["ids"], 0.6, dtype=torch.float64)
    assert_lp_close(lp.cpu(), want, LOGITS_ATOL)
    assert not bool(accept.any()) and n.cpu().tolist() == [6] * 4  # score only: no decisions
    bias = torch.randn(c["weight"].shape[0]).to(DEVICE)
    hidden, weight = _on(c, "hidden", "weight")
    lp_h, _, _ = K.verify_hidden_padded(
        hidden,
        weight,
        bias,
        ids,
        old,
        lengths.to(DEVICE),
        uids,
        seed=0,
        log_lenience=0.0,
        temperature=1.3,
        score_only=True,
    )
    ref_logits = c["hidden"].double() @ c["weight"].double().T + bias.cpu().double()
    assert_lp_close(lp_h.cpu(), token_logprobs(ref_logits, c["ids"], 1.3, dtype=torch.float64), HIDDEN_ATOL)


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


def test_top_k_top_p_and_other_dtypes_are_not_implemented():
    c = _padded_case(5)
    ids, old, lengths, uids = (c[k].to(DEVICE) for k in ("ids", "old", "lengths", "uids"))
    logits = c["logits"].to(DEVICE)
    for sampling in (SamplingSettings(top_k=50), SamplingSettings(top_p=0.9)):
        with pytest.raises(NotImplementedError):
            verify_logits(
                ids, old, logits, lengths, uids=uids, options=VerifyOptions(backend="triton", sampling=sampling)
            )
    with pytest.raises(NotImplementedError):  # the verify functions do not fall back when triton is asked for
        verify_logits(ids, old, c["logits"].double().to(DEVICE), lengths, options=VerifyOptions(backend="triton"))
    with pytest.raises(AssertionError, match="block_v"):
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


def test_hidden_rows_addressed_by_offsets_are_read_in_place():
    c = _padded_case(7, d=32)
    ids, old, lengths, uids, hidden, weight = _on(c, "ids", "old", "lengths", "uids", "hidden", "weight")
    rows, (b, t) = packed_rows(ids, old, lengths, uids, seed=4, log_lenience=0.7, temperature=1.0)
    offsets = (b * hidden.stride(0) + t * hidden.stride(1)).contiguous()
    gathered = K.verify_hidden(hidden.view(-1, 32), weight, None, rows, row_offsets=offsets, row_align=8)
    copied = K.verify_hidden(hidden[b, t], weight, None, rows)
    assert torch.equal(gathered[0].cpu(), copied[0].cpu()) and torch.equal(gathered[2].cpu(), copied[2].cpu())
