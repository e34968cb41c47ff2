"""From-logits verification: one streaming read of packed [N, V] or padded [B, T, V] logits, never copied.

Per-lane online log-sum-exp: each lane keeps its own (max, sum) with one exp2 per element and lanes merge once
per row, so the load loop has no cross-warp reduction; the next tile is prefetched. Padding rows are not read.
Each row's (max, sum, draft logit) goes to :mod:`.epilogue` as one vocabulary split."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import FLOAT_DTYPES, INTERPRET, NEG_FLT_MAX, DraftRows, kernel_results, unit_stride
from .configs import LogitsConfig, default_logits_config
from .epilogue import exp2_scale_tl, launch_epilogue


@triton.jit
def _lane_update(m, s, x, c):
    # d > 0: new max, rescale the old sum (s * e + 1); otherwise add e. One exp2 either way.
    d = x - m
    e = tl.exp2(-tl.abs(d) * c)
    s = tl.where(d > 0, s * e + 1.0, s + e)
    m = tl.maximum(m, x)
    return m, s


@triton.jit
def verify_from_logits_kernel(
    logits_ptr,
    ids_ptr,
    part_m_ptr,
    part_s_ptr,
    tgt_ptr,
    row_sample_ptr,
    params_ptr,
    n_rows,
    V,
    T,
    stride_b,
    stride_t,
    PACKED: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    in_range = rows < n_rows
    valid = in_range & (tl.load(row_sample_ptr + rows, mask=in_range, other=-1) >= 0)
    if PACKED:
        row_off = rows.to(tl.int64) * stride_t
    else:
        sample = rows // T
        row_off = sample.to(tl.int64) * stride_b + (rows - sample * T).to(tl.int64) * stride_t
    c_exp2 = exp2_scale_tl(params_ptr)
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
    tl.store(part_m_ptr + rows, m_row, mask=in_range)
    tl.store(part_s_ptr + rows, tl.sum(s * tl.exp2((m - m_row[:, None]) * c_exp2), axis=1), mask=in_range)
    tid = tl.load(ids_ptr + rows, mask=valid, other=0).to(tl.int64)
    tl.store(tgt_ptr + rows, tl.load(logits_ptr + row_off + tid, mask=valid, other=0.0).to(tl.float32), mask=in_range)


def launch_from_logits(logits: torch.Tensor, rows: DraftRows, config: LogitsConfig | None = None):
    """Run the kernel on packed [N, V] or padded [B, R, V] logits, then the epilogue -> :meth:`DraftRows.buffers`."""
    vocab = logits.shape[-1]
    packed = logits.dim() == 2
    if packed:
        n_rows, T, stride_b, stride_t = logits.shape[0], logits.shape[0], 0, logits.stride(0)
    else:
        n_rows, T, stride_b, stride_t = logits.shape[0] * logits.shape[1], logits.shape[1], *logits.stride()[:2]
    cfg = config or default_logits_config(vocab, logits.dtype, INTERPRET)
    params = rows.params(logits.device)
    part_m, part_s, tgt = torch.empty(3, n_rows, dtype=torch.float32, device=logits.device)
    if n_rows:
        verify_from_logits_kernel[(triton.cdiv(n_rows, cfg.block_r),)](
            logits,
            rows.ids,
            part_m,
            part_s,
            tgt,
            rows.row_sample,
            params,
            n_rows,
            vocab,
            T,
            stride_b,
            stride_t,
            PACKED=packed,
            BLOCK_R=cfg.block_r,
            BLOCK_V=cfg.block_v,
            num_warps=cfg.num_warps,
        )
    return launch_epilogue(rows, params, part_m, part_s, tgt, 1)


def verify_logits(logits: torch.Tensor, rows: DraftRows, config: LogitsConfig | None = None):
    """(new log-probs f32, accept bool, rejection index [B] int64) of ``rows`` from logits read once: packed [N, V]
    (tagged rows; results [N]) or padded [B, R, V] (results [B, R]). ValueError naming (sample, token) where a row has
    no distribution; NotImplementedError for a dtype the kernel does not take."""
    if logits.dtype not in FLOAT_DTYPES:
        raise NotImplementedError(f"Triton kernels take bf16/fp16/fp32 logits, got {logits.dtype}; use the reference")
    logits = unit_stride(logits)
    lp, acc, n, flag = launch_from_logits(logits, rows, config)
    return kernel_results(rows, lp.view(logits.shape[:-1]), acc.view(logits.shape[:-1]), n, flag)
