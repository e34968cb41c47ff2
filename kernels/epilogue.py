"""Verification epilogue of the from-logits and fused LM-head kernels (:func:`launch_epilogue`).

Both leave per-row softmax partials (running max m, sum of ``exp2((x - m) * c)`` with c = log2(e) / T, the draft
token's logit) in one or more vocabulary splits; this kernel merges the splits in fixed order and finishes each row:
log-prob, SPEC-RL's lenient test (Sec. 3, Eq. 4, Alg. 1: accept iff ``log u <= log l + lp_new - lp_old``, u from
:mod:`.philox`), atomic min of the first rejected index (order-independent) and the NaN flag. Log-prob and margin
are float64, ordered as the reference's."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice as _libdevice  # triton >= 3.0; GPU path only

from ._common import INTERPRET, MODE_ACCEPT_ALL, MODE_FINITE, MODE_SCORE_ONLY, NEG_FLT_MAX, DraftRows
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
def exp2_scale_tl(params_ptr):
    """c = log2(e) / T (float32) of :meth:`~._common.DraftRows.params`: the softmax sums add ``exp2((x - m) * c)``."""
    return tl.load(params_ptr + 6).to(tl.float32, bitcast=True)


@triton.jit
def rule_params_tl(params_ptr):
    """(Philox key k0, k1 as uint32, log l and T as float64, c = log2(e) / T as float32) of
    :meth:`~._common.DraftRows.params`."""
    k0 = u32_from_i32_tl(tl.load(params_ptr))
    k1 = u32_from_i32_tl(tl.load(params_ptr + 1))
    log_l = f64_from_words_tl(tl.load(params_ptr + 2), tl.load(params_ptr + 3))
    temperature = f64_from_words_tl(tl.load(params_ptr + 4), tl.load(params_ptr + 5))
    return k0, k1, log_l, temperature, exp2_scale_tl(params_ptr)


@triton.jit
def epilogue_kernel(
    part_m_ptr,
    part_s_ptr,
    tgt_ptr,
    old_ptr,
    lp_out_ptr,
    acc_out_ptr,
    n_ptr,
    flag_ptr,
    row_sample_ptr,
    row_token_ptr,
    uids_ptr,
    params_ptr,
    N,
    num_splits,
    MODE: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_LIBDEVICE: tl.constexpr,
):
    """Rows [N]: writes lp_out (0 where not a draft token) and acc_out (int8, not in score-only mode), lowers
    n[sample] to the first rejected index; a row without a distribution gets a NaN log-prob and sets flag[0]."""
    row = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_range = row < N
    sample = tl.load(row_sample_ptr + row, mask=in_range, other=-1).to(tl.int32)
    token = tl.load(row_token_ptr + row, mask=in_range, other=0).to(tl.int32)
    valid = in_range & (sample >= 0)
    k0, k1, log_l, temperature, c_exp2 = rule_params_tl(params_ptr)
    m = tl.full([BLOCK], NEG_FLT_MAX, tl.float32)
    for sp in range(num_splits):
        m = tl.maximum(m, tl.load(part_m_ptr + sp * N + row, mask=in_range, other=NEG_FLT_MAX))
    s = tl.zeros([BLOCK], tl.float32)
    for sp in range(num_splits):
        m_k = tl.load(part_m_ptr + sp * N + row, mask=in_range, other=NEG_FLT_MAX)
        s_k = tl.load(part_s_ptr + sp * N + row, mask=in_range, other=0.0)
        s += s_k * tl.exp2((m_k - m) * c_exp2)
    tgt = tl.load(tgt_ptr + row, mask=in_range, other=0.0)
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
            u = philox_uniform_tl(k0, k1, token, uid, STREAM_ACCEPT)
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


EPILOGUE_BLOCK = 256


def launch_epilogue(rows: DraftRows, params: torch.Tensor, part_m, part_s, tgt, num_splits: int):
    """Finish the tagged ``rows`` from partials [num_splits, n_rows] (m, s) and [n_rows] (target logit), all float32
    -> :meth:`~._common.DraftRows.buffers` (log-probs, accept int8, rejection index, flag)."""
    n_rows = rows.row_sample.shape[0]
    lp, acc, n, flag = rows.buffers(n_rows, part_m.device)
    if n_rows:
        epilogue_kernel[(triton.cdiv(n_rows, EPILOGUE_BLOCK),)](
            part_m,
            part_s,
            tgt,
            rows.old,
            lp,
            acc,
            n,
            flag,
            rows.row_sample,
            rows.row_token,
            rows.uids,
            params,
            n_rows,
            num_splits,
            MODE=rows.mode,
            BLOCK=EPILOGUE_BLOCK,
            USE_LIBDEVICE=not INTERPRET,
            num_warps=4,
        )
    return lp, acc, n, flag
