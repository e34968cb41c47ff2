"""Paged decode attention: one query token per sequence against a paged KV cache (docs/design.md "Paged KV cache").

A program per (sequence, kv head, split) reads each K/V tile once for the G query heads of its kv head; online
softmax in log2 units (Milakov & Gimelshein 2018), each token of a tile looking up its own block; split-K partials
merge in a fixed order (bit-reproducible). Positions >= seq_len are never loaded; seq_len 0 gives a zero row."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import INTERPRET, LOG2E, NEG_FLT_MAX
from .configs import PagedAttentionConfig, plan_paged_decode, sm_count


@triton.jit
def _prepare_query(q, kv_ptr, qk_scale, USE_DOT: tl.constexpr, DOT_F32: tl.constexpr):
    if USE_DOT:
        if DOT_F32:
            q = q.to(tl.float32)
        else:
            q = q.to(kv_ptr.dtype.element_ty)  # tl.dot needs matching operand types
    else:
        q = q.to(tl.float32) * qk_scale  # fold the scale once; products stay fp32
    return q


@triton.jit
def _tile_scores(q, k, qk_scale, USE_DOT: tl.constexpr, DOT_F32: tl.constexpr):
    """[G_PAD, BLOCK_N] scores q . k * scale * log2(e) of one K tile."""
    if USE_DOT:
        if DOT_F32:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * qk_scale
    else:
        s = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)
    return s


@triton.jit
def _tile_values(p, v, USE_DOT: tl.constexpr, DOT_F32: tl.constexpr):
    """[G_PAD, D_PAD] float32 P @ V of one V tile."""
    if USE_DOT:
        if DOT_F32:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
    else:
        pv = tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
    return pv


@triton.jit
def paged_decode_kernel(
    q_ptr,
    kv_ptr,
    bt_ptr,
    seq_lens_ptr,
    out_ptr,
    part_acc_ptr,
    part_ml_ptr,
    qk_scale,
    stride_qb,
    stride_qh,
    stride_ob,
    stride_oh,
    stride_blk,
    stride_kv,
    stride_tok,
    stride_head,
    stride_btb,
    tokens_per_split,
    num_splits,
    G: tl.constexpr,
    G_PAD: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_DOT: tl.constexpr,
    DOT_F32: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """Program (b, kv head, split). SPLIT=False: normalised output rows; SPLIT=True: f32 partials
    part_acc[b, h, split, :D_PAD] (unnormalised) and part_ml[b, h, split] = (max in log2 units, sum)."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    start = split * tokens_per_split
    # The last partition runs to seq_len: coverage never depends on the host's partition sizes.
    end = tl.where(split == num_splits - 1, seq_len, tl.minimum(seq_len, start + tokens_per_split))
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    g_ok = g < G
    d_ok = d < D
    heads = kvh * G + g
    q = tl.load(
        q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + d[None, :],
        mask=g_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    q = _prepare_query(q, kv_ptr, qk_scale, USE_DOT, DOT_F32)
    m = tl.full([G_PAD], NEG_FLT_MAX, tl.float32)
    l_sum = tl.zeros([G_PAD], dtype=tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], dtype=tl.float32)
    n = tl.arange(0, BLOCK_N)
    bt_row = bt_ptr + b.to(tl.int64) * stride_btb
    head_off = kvh.to(tl.int64) * stride_head
    for t0 in range(start, end, BLOCK_N):
        tok = t0 + n
        t_ok = tok < end
        blk = tl.load(bt_row + tok // BLOCK_SIZE, mask=t_ok, other=0)
        # int64: num_blocks * stride_blk may exceed 2**31 elements.
        row = blk.to(tl.int64) * stride_blk + (tok % BLOCK_SIZE).to(tl.int64) * stride_tok + head_off
        k_ptrs = kv_ptr + row[:, None] + d[None, :]
        if D == D_PAD:
            kv_mask = t_ok[:, None]
        else:
            kv_mask = t_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
        v = tl.load(k_ptrs + stride_kv, mask=kv_mask, other=0.0)
        s = tl.where(t_ok[None, :], _tile_scores(q, k, qk_scale, USE_DOT, DOT_F32), float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        pv = _tile_values(p, v, USE_DOT, DOT_F32)
        acc = acc * alpha[:, None] + pv
        m = m_new
    if SPLIT:
        hq = tl.num_programs(1) * G
        row_id = (b.to(tl.int64) * hq + heads) * num_splits + split  # [G_PAD]
        tl.store(part_acc_ptr + row_id[:, None] * D_PAD + d[None, :], acc, mask=g_ok[:, None])
        tl.store(part_ml_ptr + row_id * 2, m, mask=g_ok)
        tl.store(part_ml_ptr + row_id * 2 + 1, l_sum, mask=g_ok)
    else:
        # seq_len 0: l = 0 and the row is zeros (no 0/0 evaluated).
        out = tl.where(l_sum[:, None] > 0, acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None], 0.0)
        tl.store(
            out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=g_ok[:, None] & d_ok[None, :],
        )


@triton.jit
def paged_decode_merge_kernel(
    part_acc_ptr, part_ml_ptr, out_ptr, stride_ob, stride_oh, num_splits, D: tl.constexpr, D_PAD: tl.constexpr
):
    """Program (b, h): merge one query head's partials in split order (deterministic)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    base = (b.to(tl.int64) * tl.num_programs(1) + h) * num_splits
    d = tl.arange(0, D_PAD)
    m_all = tl.load(part_ml_ptr + base * 2)
    for s in range(1, num_splits):
        m_all = tl.maximum(m_all, tl.load(part_ml_ptr + (base + s) * 2))
    l_all = 0.0
    acc = tl.zeros([D_PAD], dtype=tl.float32)
    for s in range(num_splits):
        m_s = tl.load(part_ml_ptr + (base + s) * 2)
        l_s = tl.load(part_ml_ptr + (base + s) * 2 + 1)
        w = tl.exp2(m_s - m_all)  # an empty split has m_s = -FLT_MAX, l_s = 0: weight 0 (or 1 with l 0)
        l_all = l_all + w * l_s
        acc = acc + w * tl.load(part_acc_ptr + (base + s) * D_PAD + d)
    out = tl.where(l_all > 0, acc / tl.where(l_all > 0, l_all, 1.0), 0.0)
    tl.store(out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < D)


def paged_decode_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    config: PagedAttentionConfig | None = None,
) -> torch.Tensor:
    """Decode attention of one query token per sequence over its paged K/V (the engine's; inputs are trusted).

    out[b, h] = softmax(scale * q[b, h] . K[b, :seq_lens[b], h // G]) V[...], G = Hq // kv_heads (repeat_kv order).
    query: [B, Hq, D] f32/bf16/fp16, unit stride over D, its own K/V already in the cache; kv_cache: [num_blocks, 2,
    block_size, kv_heads, D] contiguous, D <= 256; block_tables: [B, max_blocks] int32, only the first
    ceil(seq_lens[b] / block_size) read; seq_lens: [B] int32; out: optional, like query; max_seq_len: host bound of
    seq_lens, sizes partitions only; num_splits: None auto, 1 off, n up to n. Deterministic given the inputs and
    (num_splits, config)."""
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    if query.shape[0] == 0:
        return out
    if block_tables.shape[1] == 0:  # every seq_len is 0
        return out.zero_()
    batch, q_heads, head_dim = query.shape
    _, _, block_size, kv_heads, kv_dim = kv_cache.shape
    assert q_heads % kv_heads == 0 and head_dim == kv_dim, f"query {tuple(query.shape)} vs kv_cache {kv_cache.shape}"
    plan = plan_paged_decode(
        batch,
        q_heads,
        kv_heads,
        head_dim,
        kv_cache.dtype,
        block_tables.shape[1] * block_size,
        max_seq_len=max_seq_len,
        num_splits=num_splits,
        config=config,
        num_sms=sm_count(kv_cache.device),
    )
    splits, split = plan.num_splits, plan.num_splits > 1
    if split:
        part_acc = torch.empty((batch, q_heads, splits, plan.d_pad), dtype=torch.float32, device=out.device)
        part_ml = torch.empty((batch, q_heads, splits, 2), dtype=torch.float32, device=out.device)
    else:
        part_acc = part_ml = out  # unused pointer slots
    paged_decode_kernel[(batch, kv_heads, splits)](
        query,
        kv_cache,
        block_tables,
        seq_lens,
        out,
        part_acc,
        part_ml,
        float(scale) * LOG2E,
        *query.stride()[:2],
        *out.stride()[:2],
        *kv_cache.stride()[:4],
        block_tables.stride(0) if block_tables.numel() else 0,
        plan.tokens_per_split,
        splits,
        G=plan.group,
        G_PAD=plan.g_pad,
        D=head_dim,
        D_PAD=plan.d_pad,
        BLOCK_SIZE=block_size,
        BLOCK_N=plan.config.block_n,
        USE_DOT=plan.use_dot,
        # fp32 caches: IEEE fp32 dot (never TF32); the interpreter's bf16 tl.dot multiplies raw bits as integers.
        DOT_F32=kv_cache.dtype == torch.float32 or (INTERPRET and kv_cache.dtype == torch.bfloat16),
        SPLIT=split,
        num_warps=plan.config.num_warps,
        num_stages=plan.config.num_stages,
    )
    if split:
        paged_decode_merge_kernel[(batch, q_heads)](
            part_acc,
            part_ml,
            out,
            out.stride(0),
            out.stride(1),
            splits,
            D=head_dim,
            D_PAD=plan.d_pad,
            num_warps=1 if plan.d_pad <= 64 else 2,
        )
    return out
