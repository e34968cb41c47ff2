"""Verification epilogue shared by the from-logits and fused LM-head kernels (:func:`finish_rows`).

Log-prob, SPEC-RL's lenient test (Sec. 3, Eq. 4, Alg. 1: accept iff ``log u <= log l + lp_new - lp_old``, u from
:mod:`.philox`), atomic min of the first rejected index (order-independent) and the NaN flag. Sums use
``exp2((x - m) * c)``, c = log2(e) / T; log-prob and margin are float64, ordered as the reference's."""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice as _libdevice  # triton >= 3.0; GPU path only

from ._common import MODE_ACCEPT_ALL, MODE_FINITE, MODE_SCORE_ONLY
from .philox import STREAM_ACCEPT, philox_uniform_tl, u32_from_i32_tl


@triton.jit
def f64_from_words_tl(lo, hi):
    lo_u = lo.to(tl.int32).to(tl.uint32, bitcast=True).to(tl.int64)
    bits = (hi.to(tl.int32).to(tl.int64) << 32) | lo_u
    return bits.to(tl.float64, bitcast=True)


@triton.jit
def log_f64_tl(x, USE_LIBDEVICE: tl.constexpr):
    """float64 natural log: libdevice on the GPU, tl.log in the interpreter (no externs); both within 1 ulp."""
    if USE_LIBDEVICE:
        return _libdevice.log(x)
    else:
        return tl.log(x)


@triton.jit
def finish_rows(
    row,
    in_range,
    valid,
    sample,
    token,
    m,
    s,
    tgt,
    lp_out_ptr,
    acc_out_ptr,
    n_ptr,
    flag_ptr,
    old_ptr,
    uids_ptr,
    k0_w,
    k1_w,
    log_l_lo,
    log_l_hi,
    temp_lo,
    temp_hi,
    MODE: tl.constexpr,
    USE_LIBDEVICE: tl.constexpr,
):
    """Epilogue for one row or a block: ``in_range`` masks stores, ``valid`` (a subset) marks draft tokens.

    m, s: f32 running max (raw logits) and sum of exp((x - m) / T); tgt: f32 draft logit; scalars as
    :meth:`~._common.DraftRows.scalars`. Writes lp_out (0 where not valid) and acc_out (int8, not in score-only
    mode), lowers n[sample] to the first rejected index; an invalid row gets a NaN log-prob and sets flag[0]."""
    log_l = f64_from_words_tl(log_l_lo, log_l_hi)
    temperature = f64_from_words_tl(temp_lo, temp_hi)
    # Invalid: NaN (a +inf logit makes the normaliser NaN too), or s == 0 (every logit -inf).
    bad = valid & ((s != s) | (tgt != tgt) | (s == 0.0))  # noqa: PLR0124 (x != x is the NaN test)
    lp64 = (tgt.to(tl.float64) - m.to(tl.float64)) / temperature - log_f64_tl(s.to(tl.float64), USE_LIBDEVICE)
    lp64 = tl.where(tgt == float("-inf"), float("-inf"), lp64)  # also for an all -inf row (-inf + inf)
    lp = lp64.to(tl.float32)
    lp = tl.where(bad, float("nan"), lp)
    tl.store(lp_out_ptr + row, tl.where(valid, lp, 0.0), mask=in_range)
    if MODE != MODE_SCORE_ONLY:
        sample_safe = tl.where(valid, sample, 0)
        if MODE == MODE_FINITE:
            uid = tl.load(uids_ptr + sample_safe)
            u = philox_uniform_tl(u32_from_i32_tl(k0_w), u32_from_i32_tl(k1_w), token, uid, STREAM_ACCEPT)
            old = tl.load(old_ptr + row, mask=valid, other=0.0).to(tl.float64)
            margin = (lp.to(tl.float64) - old) + log_l  # acceptance_test's order, lp_new rounded to f32 first
            accept = log_f64_tl(u.to(tl.float64), USE_LIBDEVICE) <= margin  # NaN margin: rejected, as reference
        elif MODE == MODE_ACCEPT_ALL:
            accept = valid
        else:  # MODE_REJECT_ALL
            accept = valid & (token < 0)  # all False, with the right shape
        accept = accept & valid & (bad == 0)
        tl.store(acc_out_ptr + row, accept.to(tl.int8), mask=in_range)
        tl.atomic_min(n_ptr + sample_safe, token, mask=valid & (accept == 0), sem="relaxed")
    tl.atomic_max(flag_ptr + sample * 0, 1, mask=bad, sem="relaxed")
