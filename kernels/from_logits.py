"""From-logits verification kernel: one streaming read of the logits.

Each program owns BLOCK_R logits rows (1 for large vocabularies; several
for small ones, and in the interpreter, where every Triton op is one numpy
call). A row is read once, in tiles of BLOCK_V columns, with a *per-lane*
online log-sum-exp: every lane j of the tile keeps
its own running max m_j and sum s_j, updated with a single exponential per
element,

    d = x - m_j;  e = exp2(-|d| * c)
    s_j = s_j * e + 1   if d > 0   (new max: rescale the old sum)
    s_j = s_j + e       otherwise
    m_j = max(m_j, x),

and lanes are merged once at the end of the row (max, then a rescaled sum).
Compared with the usual per-tile update (tile max, then exp of every
element), this has no cross-warp reduction (shared memory + barrier) inside
the loop, so nothing stalls the stream of loads; the cost is one exp2 per
element, which on an H100/H200 (16 MUFU ops/clk/SM, CUDA C Programming Guide
"Arithmetic Instructions" throughput table) is below the time the HBM needs to
deliver the element. The next tile is loaded before the current one is
consumed (software prefetch), and loads use ``evict_first`` since every byte
is read exactly once.

The draft token's logit is one extra scalar load; the epilogue
(:func:`.epilogue.finish_rows`) forms the log-prob, draws the Philox uniform,
applies the test and lowers the sample's rejection index with an int32 atomic
min (order-independent, hence deterministic).

Row addressing, without copying the logits:

* padded  (PACKED=False): logits [B, T, V] with strides (stride_b, stride_t, 1);
  row r -> (b, t) = (r // T, r % T); rows with t >= lengths[b] are skipped
  (no logits read, so garbage or NaN at padded positions is ignored).
* packed  (PACKED=True): logits [N, V] with row stride stride_t; row r belongs
  to sample row_sample[r] (-1 = padding row, skipped) at token index
  row_token[r].

:func:`launch_from_logits` picks the layout from the logits' rank and
launches the kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import INTERPRET, NEG_FLT_MAX, DraftRows
from .configs import LogitsConfig, default_logits_config
from .epilogue import finish_rows


@triton.jit
def _lane_update(m, s, x, c):
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
    # (No tl.where(valid, row_off, 0) here: it hides the offsets' 16-byte
    # divisibility from Triton and the loads stop being vectorised; loads of
    # rows that are not valid are masked anyway.)
    ptrs = logits_ptr + row_off[:, None] + tl.arange(0, BLOCK_V)[None, :]
    row_mask = valid[:, None]

    m = tl.full([BLOCK_R, BLOCK_V], NEG_FLT_MAX, tl.float32)
    s = tl.zeros([BLOCK_R, BLOCK_V], tl.float32)
    # Skip the stream entirely when no row of this program is a draft token.
    n_full = (V // BLOCK_V) * tl.max(valid.to(tl.int32), axis=0)
    if n_full > 0:
        x = tl.load(ptrs, mask=row_mask, other=float("-inf"), eviction_policy="evict_first").to(tl.float32)
        for i in range(1, n_full):
            x_next = tl.load(ptrs + i * BLOCK_V, mask=row_mask, other=float("-inf"), eviction_policy="evict_first").to(
                tl.float32
            )
            m, s = _lane_update(m, s, x, c_exp2)
            x = x_next
        m, s = _lane_update(m, s, x, c_exp2)
    # Ragged tail (V not a multiple of BLOCK_V, or V < BLOCK_V): columns past
    # V load -inf, which leaves (m, s) unchanged since m > -inf.
    tail = n_full * BLOCK_V + tl.arange(0, BLOCK_V)
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
    """Run the from-logits kernel over ``rows``; inputs are validated by the caller.

    Args:
        logits: [N, V] (packed: ``rows`` has row tags) or [B, R, V] (padded),
            bf16/fp16/fp32 with unit stride over V.
        rows: the draft tokens, N or B * R of them.
        config: tiles (default :func:`~.configs.default_logits_config`).

    Returns:
        (log-probs [n_rows] float32, accept [n_rows] int8, rejection index
        [B] int32, NaN flag [1] int32), see :meth:`DraftRows.buffers`.
    """
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
    k0, k1, l_lo, l_hi, t_lo, t_hi, c = rows.scalars()
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
        k0,
        k1,
        l_lo,
        l_hi,
        t_lo,
        t_hi,
        c,
        PACKED=packed,
        MODE=rows.mode,
        BLOCK_R=cfg.block_r,
        BLOCK_V=cfg.block_v,
        USE_LIBDEVICE=not INTERPRET,
        num_warps=cfg.num_warps,
    )
    return lp, acc, n, flag
