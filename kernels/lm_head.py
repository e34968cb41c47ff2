"""Fused LM-head verification: logits = h @ W^T (+ b) are never materialised.

``lm_head_partial_kernel`` folds tensor-core logit tiles into per-row online (max, sum) (Milakov & Gimelshein
2018), one partial per vocabulary split, that :mod:`.epilogue` merges in fixed order and finishes.
No float atomics and a split count set by V alone: bit-reproducible, batch-independent (docs/design.md)."""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from ._common import FLOAT_DTYPES, INTERPRET, NEG_FLT_MAX, DraftRows, kernel_results, unit_stride
from .configs import LMHeadConfig, default_lm_head_config
from .epilogue import exp2_scale_tl, launch_epilogue


@triton.jit
def lm_head_partial_kernel(
    h_ptr,
    w_ptr,
    bias_ptr,
    ids_ptr,
    row_off_ptr,
    part_m_ptr,
    part_s_ptr,
    tgt_ptr,
    N,
    V,
    D,
    stride_h,
    stride_w,
    n_vtiles,
    tiles_per_split,
    num_splits,
    params_ptr,
    HAS_BIAS: tl.constexpr,
    HAS_ROW_MAP: tl.constexpr,
    ROW_ALIGN: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FLATTEN: tl.constexpr,
):
    pid = tl.program_id(0)
    rb = pid // num_splits  # neighbouring programs share a row block of h (in L2), walking disjoint vocab ranges
    sp = pid - rb * num_splits
    rows = rb * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < N
    rows_ld = tl.where(row_ok, rows, 0)  # in-bounds loads; these rows' results are discarded
    if HAS_ROW_MAP:
        roff = tl.load(row_off_ptr + rows_ld)
        roff = tl.multiple_of(roff, ROW_ALIGN)
    else:
        roff = rows_ld.to(tl.int64) * stride_h
    tid = tl.load(ids_ptr + rows_ld).to(tl.int32)
    c_exp2 = exp2_scale_tl(params_ptr)
    rk = tl.arange(0, BLOCK_K)
    a_base = h_ptr + roff[:, None] + rk[None, :]
    m = tl.full([BLOCK_M], NEG_FLT_MAX, tl.float32)
    s = tl.zeros([BLOCK_M], tl.float32)
    tg = tl.zeros([BLOCK_M], tl.float32)
    t_lo = sp * tiles_per_split
    t_hi = tl.minimum(t_lo + tiles_per_split, n_vtiles)
    for vt in tl.range(t_lo, t_hi, flatten=FLATTEN):
        col0 = vt * BLOCK_N
        cols = col0 + tl.arange(0, BLOCK_N)
        col_ok = cols < V
        cols_ld = tl.where(col_ok, cols, 0)
        b_base = w_ptr + cols_ld.to(tl.int64)[None, :] * stride_w + rk[:, None]
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k in range(0, D, BLOCK_K):
            if EVEN_K:
                a = tl.load(a_base + k)
                b = tl.load(b_base + k)
            else:
                k_ok = (k + rk) < D
                a = tl.load(a_base + k, mask=k_ok[None, :], other=0.0)
                b = tl.load(b_base + k, mask=k_ok[:, None], other=0.0)
            if DOT_FP32:
                acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols_ld).to(tl.float32)[None, :]
        x = tl.where(col_ok[None, :], acc, float("-inf"))  # padded columns: out of max/sum, never a target
        m_new = tl.maximum(m, tl.max(x, axis=1))
        p = tl.exp2((x - m_new[:, None]) * c_exp2)
        s = s * tl.exp2((m - m_new) * c_exp2) + tl.sum(p, axis=1)
        m = m_new
        hit = (tid >= col0) & (tid < col0 + BLOCK_N)
        if tl.max(hit.to(tl.int32), axis=0) > 0:
            tg += tl.sum(tl.where(cols[None, :] == tid[:, None], x, 0.0), axis=1)
    part = sp * N + rows
    tl.store(part_m_ptr + part, m, mask=row_ok)
    tl.store(part_s_ptr + part, s, mask=row_ok)
    mine = row_ok & (tid >= t_lo * BLOCK_N) & (tid < t_hi * BLOCK_N)
    tl.store(tgt_ptr + rows, tg, mask=mine)


def offsets_alignment(elem_size: int, *strides: int) -> int:
    """Largest power of two p <= 16 bytes / elem_size dividing every stride (a tl.multiple_of hint)."""
    p = max(1, 16 // elem_size)
    while p > 1 and any(s % p for s in strides):
        p //= 2
    return p


def launch_lm_head(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    rows: DraftRows,
    *,
    row_offsets: torch.Tensor | None = None,
    row_align: int = 1,
    config: LMHeadConfig | None = None,
):
    """Run the partial kernel and the epilogue over the N tagged ``rows`` -> :meth:`DraftRows.buffers`. hidden:
    [N, d], or any tensor addressed by ``row_offsets`` [N] int64, unit stride over d; ``row_align`` divides every
    row offset."""
    device = hidden.device
    vocab, d = weight.shape
    n_rows = rows.ids.shape[0]
    tensor_core = hidden.dtype == weight.dtype and hidden.dtype in (torch.bfloat16, torch.float16)
    cfg = config or default_lm_head_config(d, vocab, hidden.dtype if tensor_core else torch.float32, INTERPRET)
    # The interpreter's bf16 tl.dot multiplies raw bits as integers; fp32 operands match the tensor cores.
    dot_fp32 = not tensor_core or (INTERPRET and hidden.dtype == torch.bfloat16)
    n_vtiles, per_split, n_splits = cfg.splits(vocab)
    part_m, part_s = torch.empty(2, n_splits, n_rows, dtype=torch.float32, device=device)
    tgt = torch.empty(n_rows, dtype=torch.float32, device=device)
    params = rows.params(device)
    if n_rows == 0:
        return launch_epilogue(rows, params, part_m, part_s, tgt, n_splits)
    lm_head_partial_kernel[(triton.cdiv(n_rows, cfg.block_m) * n_splits,)](
        hidden,
        weight,
        bias if bias is not None else tgt,  # unused pointer slots: any tensor
        rows.ids,
        row_offsets if row_offsets is not None else tgt,
        part_m,
        part_s,
        tgt,
        n_rows,
        vocab,
        d,
        hidden.stride(0) if row_offsets is None else 0,
        weight.stride(0),
        n_vtiles,
        per_split,
        n_splits,
        params,
        HAS_BIAS=bias is not None,
        HAS_ROW_MAP=row_offsets is not None,
        ROW_ALIGN=row_align,
        EVEN_K=d % cfg.block_k == 0,
        DOT_FP32=dot_fp32,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        FLATTEN=cfg.flatten,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return launch_epilogue(rows, params, part_m, part_s, tgt, n_splits)


def verify_hidden(hidden, weight, bias, rows: DraftRows, *, row_offsets=None, row_align: int = 1, config=None):
    """(new log-probs [N] f32, accept [N] bool, rejection index [B] int64) of the N tagged ``rows`` from hidden states
    [N, d] (or any tensor addressed by ``row_offsets``) and the LM head [V, d] (+ bias [V]); logits are never formed.
    Errors as :func:`~spec_rl.kernels.from_logits.verify_logits`."""
    if hidden.dtype not in FLOAT_DTYPES or weight.dtype not in FLOAT_DTYPES:
        raise NotImplementedError(
            f"Triton kernels take bf16/fp16/fp32 hidden states and LM head, got {hidden.dtype}/{weight.dtype}; "
            "use the reference"
        )
    assert hidden.shape[-1] == weight.shape[1], f"hidden [.., {hidden.shape[-1]}] vs lm_head [V, {weight.shape[1]}]"
    hidden, weight = unit_stride(hidden), unit_stride(weight)
    bias = bias.contiguous() if bias is not None else None
    launched = launch_lm_head(hidden, weight, bias, rows, row_offsets=row_offsets, row_align=row_align, config=config)
    return kernel_results(rows, *launched)


def verify_hidden_padded(hidden, weight, bias, draft_ids, old_logprobs, lengths, uids, config=None, **settings):
    """:func:`verify_hidden` of right-padded drafts [B, R] with hidden states [B, R, d]: the valid rows are read in
    place (row offsets into ``hidden``), padding never; results [B, R], [B, R], [B]. ``settings``: seed,
    log_lenience, temperature, score_only."""
    valid = torch.arange(draft_ids.shape[1], device=lengths.device).unsqueeze(0) < lengths.unsqueeze(1)
    b_idx, t_idx = valid.nonzero(as_tuple=True)
    hidden = unit_stride(hidden)
    rows = dataclasses.replace(
        DraftRows.padded(draft_ids, old_logprobs, lengths, uids, **settings),
        ids=draft_ids[b_idx, t_idx].contiguous(),
        old=old_logprobs[b_idx, t_idx].contiguous(),
        row_sample=b_idx.to(torch.int32),
        row_token=t_idx.to(torch.int32),
    )
    s_b, s_t = hidden.stride(0), hidden.stride(1)
    lp_p, acc_p, n = verify_hidden(
        hidden,
        weight,
        bias,
        rows,
        row_offsets=(b_idx * s_b + t_idx * s_t).contiguous(),
        row_align=offsets_alignment(hidden.element_size(), s_b, s_t),
        config=config,
    )
    lp = lp_p.new_zeros(draft_ids.shape).index_put_((b_idx, t_idx), lp_p)
    acc = acc_p.new_zeros(draft_ids.shape).index_put_((b_idx, t_idx), acc_p)
    return lp, acc, n
