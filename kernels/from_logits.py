"""From-logits verification: one streaming read of packed [N, V] or padded [B, T, V] logits, never copied.

Per-lane online log-sum-exp: each lane keeps its own (max, sum) with one exp2 per element and lanes merge once
per row, so the load loop has no cross-warp reduction; the next tile is prefetched. Padding rows are not read."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import FLOAT_DTYPES, INTERPRET, NEG_FLT_MAX, DraftRows, kernel_results, unit_stride
from .configs import LogitsConfig, default_logits_config
from .epilogue import finish_rows


@triton.jit
def _lane_update(m, s, x, c):
    # d > 0: new max, rescale the old sum (s * e + 1); otherwise add e. One exp2 either way.
    d = x - m
    e = tl.exp2(-tl.abs(d) * c)
    s = tl.where(d > 0, s * e + 1.0, s + e)
    m = tl.maximum(m, x)
    return m, s


@triton.jit(do_not_specialize=["k0_w", "k1_w", "log_l_lo", "log_l_hi", "temp_lo", "temp_hi", "c_exp2"])
def verify_from_logits_kernel(
    logits_ptr,
    ids_ptr,
    old_ptr,
    lp_out_ptr,
    acc_out_ptr,
    n_ptr,
    flag_ptr,
    row_sample_ptr,
    row_token_ptr,
    lengths_ptr,
    uids_ptr,
    n_rows,
    V,
    T,
    stride_b,
    stride_t,
    k0_w,
    k1_w,
    log_l_lo,
    log_l_hi,
    temp_lo,
    temp_hi,
    c_exp2,
    PACKED: tl.constexpr,
    MODE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_V: tl.constexpr,
    USE_LIBDEVICE: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    in_range = rows < n_rows
    if PACKED:
        sample = tl.load(row_sample_ptr + rows, mask=in_range, other=-1).to(tl.int32)
        token = tl.load(row_token_ptr + rows, mask=in_range, other=0).to(tl.int32)
        valid = in_range & (sample >= 0)
        row_off = rows.to(tl.int64) * stride_t
    else:
        sample = rows // T
        token = rows - sample * T
        length = tl.load(lengths_ptr + sample, mask=in_range, other=0).to(tl.int32)
        valid = in_range & (token < length)
        row_off = sample.to(tl.int64) * stride_b + token.to(tl.int64) * stride_t
    # No tl.where(valid, row_off, 0): it would hide the 16-byte divisibility and unvectorise the (masked) loads.
    ptrs = logits_ptr + row_off[:, None] + tl.arange(0, BLOCK_V)[None, :]
    row_mask = valid[:, None]
    m = tl.full([BLOCK_R, BLOCK_V], NEG_FLT_MAX, tl.float32)
    s = tl.zeros([BLOCK_R, BLOCK_V], tl.float32)
    n_full = (V // BLOCK_V) * tl.max(valid.to(tl.int32), axis=0)  # 0 when no row is a draft token
    if n_full > 0:
        x = tl.load(ptrs, mask=row_mask, other=float("-inf"), eviction_policy="evict_first").to(tl.float32)
        for i in range(1, n_full):
            x_next = tl.load(ptrs + i * BLOCK_V, mask=row_mask, other=float("-inf"), eviction_policy="evict_first").to(
                tl.float32
            )
            m, s = _lane_update(m, s, x, c_exp2)
            x = x_next
        m, s = _lane_update(m, s, x, c_exp2)
    tail = n_full * BLOCK_V + tl.arange(0, BLOCK_V)  # columns past V load -inf: (m, s) unchanged as m > -inf
    x = tl.load(
        ptrs + n_full * BLOCK_V, mask=row_mask & (tail < V)[None, :], other=float("-inf"), eviction_policy="evict_first"
    )
    m, s = _lane_update(m, s, x.to(tl.float32), c_exp2)
    m_row = tl.max(m, axis=1)
    s_row = tl.sum(s * tl.exp2((m - m_row[:, None]) * c_exp2), axis=1)
    tid = tl.load(ids_ptr + rows, mask=valid, other=0).to(tl.int64)
    tgt = tl.load(logits_ptr + row_off + tid, mask=valid, other=0.0).to(tl.float32)
    finish_rows(
        rows,
        in_range,
        valid,
        sample,
        token,
        m_row,
        s_row,
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
        MODE,
        USE_LIBDEVICE,
    )


def launch_from_logits(logits: torch.Tensor, rows: DraftRows, config: LogitsConfig | None = None):
    """Run the kernel on packed [N, V] (tagged ``rows``) or padded [B, R, V] logits -> :meth:`DraftRows.buffers`."""
    vocab = logits.shape[-1]
    packed = logits.dim() == 2
    if packed:
        n_rows, T, stride_b, stride_t = logits.shape[0], logits.shape[0], 0, logits.stride(0)
    else:
        n_rows, T, stride_b, stride_t = logits.shape[0] * logits.shape[1], logits.shape[1], *logits.stride()[:2]
    cfg = config or default_logits_config(vocab, logits.dtype, INTERPRET)
    lp, acc, n, flag = rows.buffers(n_rows, logits.device)
    if n_rows == 0:
        return lp, acc, n, flag
    verify_from_logits_kernel[(triton.cdiv(n_rows, cfg.block_r),)](
        logits,
        rows.ids,
        rows.old,
        lp,
        acc,
        n,
        flag,
        rows.row_sample if packed else n,
        rows.row_token if packed else n,  # unused pointer slots: any tensor
        rows.lengths,
        rows.uids,
        n_rows,
        vocab,
        T,
        stride_b,
        stride_t,
        *rows.scalars(),  # k0, k1, log_l lo/hi, temperature lo/hi, c
        PACKED=packed,
        MODE=rows.mode,
        BLOCK_R=cfg.block_r,
        BLOCK_V=cfg.block_v,
        USE_LIBDEVICE=not INTERPRET,
        num_warps=cfg.num_warps,
    )
    return lp, acc, n, flag


def verify_logits(logits: torch.Tensor, rows: DraftRows, config: LogitsConfig | None = None):
    """(new log-probs f32, accept bool, rejection index [B] int64) of ``rows`` from logits read once: packed [N, V]
    (tagged rows; results [N]) or padded [B, R, V] (results [B, R]). ValueError naming (sample, token) where a row has
    no distribution; NotImplementedError for a dtype the kernel does not take."""
    if logits.dtype not in FLOAT_DTYPES:
        raise NotImplementedError(f"Triton kernels take bf16/fp16/fp32 logits, got {logits.dtype}; use the reference")
    logits = unit_stride(logits)
    lp, acc, n, flag = launch_from_logits(logits, rows, config)
    return kernel_results(rows, lp.view(logits.shape[:-1]), acc.view(logits.shape[:-1]), n, flag)
