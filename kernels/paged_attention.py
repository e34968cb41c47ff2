"""Paged decode attention in Triton: one new query token per sequence against a paged KV cache.

The GPU attention path of the paged generation engine (docs/design.md
"Paged KV cache"). Cache layout, one tensor per layer (vLLM / FlashInfer
"NHD", see :mod:`spec_rl.ops.torch_kv`): ``kv_cache[num_blocks, 2, block_size,
kv_heads, head_dim]``, keys at ``[:, 0]``, values at ``[:, 1]``; token
position ``p`` of sequence ``b`` lives in block ``block_tables[b, p //
block_size]`` at offset ``p % block_size``.

Work split (why):

* One program per (sequence, kv head): it loads the group of
  ``G = Hq / kv_heads`` query heads that share that kv head (transformers'
  ``repeat_kv`` convention: query head ``h`` reads kv head ``h // G``), so
  each K/V tile is read from memory once for the whole group (GQA; the
  FlashDecoding / vLLM GQA-decode observation that decode is bound by K/V
  bytes, not FLOPs).
* Online softmax over tiles of ``BLOCK_N`` tokens (Milakov & Gimelshein
  2018; FlashAttention, Dao et al. 2022): running max ``m``, running sum
  ``l`` and an unnormalised float32 accumulator, all in float32. A tile
  may straddle cache blocks: every token looks up its own block id, so
  ``BLOCK_N`` and ``block_size`` are independent.
* Contractions, two paths (see
  :func:`~.configs.default_paged_attention_config`): ``tl.dot`` with
  the group padded to >= 16 rows (tensor cores for bf16/fp16; the padding
  rows are free in a kernel bound by K/V bytes; the probabilities are
  rounded to the cache dtype before the P @ V product, as FlashAttention
  does; IEEE fp32 dot for fp32 caches), or ``q * k`` broadcast and summed
  in float32 (exact products, fp32 probabilities; no padding of the group;
  the default for fp32 caches with groups of up to 4 and for head_dim < 16).
* Split-K ("flash-decoding", Dao et al. 2023) for small batches with long
  contexts: the context is cut into ``num_splits`` partitions of a fixed
  number of tokens (the last one takes the rest), each program writes
  float32 partials ``(acc, m, l)``, and a second kernel merges the
  partials of each (sequence, head) in a fixed sequential order, so the
  result is bit-reproducible run to run (docs/design.md "Randomness").
  The partition plan is :func:`~.configs.plan_paged_decode`.

Numerics: scores are kept in log2 units (``q . k * scale * log2(e)``, then
``exp2``); the running maximum starts at ``-FLT_MAX`` rather than ``-inf``
so a tile or split with no valid token never evaluates ``-inf - -inf``.
Masked tokens (positions ``>= seq_len``, including the unused tail of the
last block) are never loaded, so whatever is stored there (NaN in freed
blocks) cannot leak into the result. A sequence with ``seq_len == 0``
attends to nothing and gets an all-zero output row (the empty-sum
convention; FlashAttention-style kernels do the same).

Accuracy (asserted in tests/kernels/test_kernels_paged_attention.py against a
float64 gather + softmax over the same inputs): fp32 caches within ~1e-5;
bf16 / fp16 within a few units of the output dtype's rounding (the final
rounding of the output, plus the rounding of the probabilities before the
tensor-core P @ V product on the ``tl.dot`` path).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import INTERPRET, LOG2E, NEG_FLT_MAX
from .checks import check_block_ranges, check_paged_device, check_paged_options, validate_paged_decode
from .configs import PagedAttentionConfig, PagedDecodePlan, plan_paged_decode, plan_splits, sm_count, splits_for


@triton.jit
def _prepare_query(q, kv_ptr, qk_scale, USE_DOT: tl.constexpr, DOT_F32: tl.constexpr):
    """The query group as the contraction wants it (scaled once on the broadcast path)."""
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
    """Program (b, kv head, split): attention of the G query heads of one kv head over one partition.

    SPLIT=False: num_splits == 1, writes the normalised output rows.
    SPLIT=True: writes float32 partials part_acc[b, h, split, :D_PAD] (unnormalised)
    and part_ml[b, h, split, 0:2] = (running max in log2 units, running sum).
    """
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    start = split * tokens_per_split
    # The last partition takes everything up to seq_len, so coverage never
    # depends on how the host sized the partitions.
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
    """Program (b, h): merge the split partials of one query head in split order (deterministic)."""
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


# ----------------------------------------------------------------------------
# launch


def _launch(query, kv_cache, block_tables, seq_lens, scale: float, out, plan: PagedDecodePlan) -> None:
    """Run the decode kernel (and, with split-K, the merge kernel) into ``out``."""
    batch, q_heads, head_dim = query.shape
    kv_heads = kv_cache.shape[3]
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
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        block_tables.stride(0) if block_tables.numel() else 0,
        plan.tokens_per_split,
        splits,
        G=plan.group,
        G_PAD=plan.g_pad,
        D=head_dim,
        D_PAD=plan.d_pad,
        BLOCK_SIZE=kv_cache.shape[2],
        BLOCK_N=plan.config.block_n,
        USE_DOT=plan.use_dot,
        # fp32 caches: IEEE fp32 dot (never TF32). The interpreter's tl.dot
        # multiplies bf16 operands as their raw uint16 bits (triton 3.9
        # interpreter.create_dot), so it gets fp32 operands there too.
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
    validate: bool = True,
) -> torch.Tensor:
    """Decode attention of one query token per sequence over its paged K/V.

    out[b, h] = sum_p softmax_p(scale * q[b, h] . K[b, p, h // G]) V[b, p, h // G]
    over positions p in [0, seq_lens[b]), where K/V[b, p, j] = kv_cache[
    block_tables[b, p // block_size], 0/1, p % block_size, j] and
    G = q_heads // kv_heads (GQA, transformers' repeat_kv head order).

    Args:
        query: [B, Hq, D] float32/bf16/fp16, unit stride over D (any batch /
            head strides). The new token's own K/V must already be written
            into the cache (its position is seq_lens[b] - 1).
        kv_cache: [num_blocks, 2, block_size, kv_heads, D] contiguous,
            float32/bf16/fp16; D <= 256 (powers of two are the fast path,
            others are masked). It may differ from query's dtype; on the
            ``tl.dot`` path the query is then rounded to the cache dtype.
        block_tables: [B, max_blocks] int32. Only entries
            [0, ceil(seq_lens[b] / block_size)) of row b are read; the rest
            may hold any padding value.
        seq_lens: [B] int32, 0 <= seq_lens[b] <= max_blocks * block_size
            (tokens). A length of 0 gives an all-zero output row.
        scale: softmax scale (Python number), typically D ** -0.5.
        out: optional [B, Hq, D] output of query's dtype/device (unit stride
            over D); written and returned.
        max_seq_len: an upper bound of seq_lens known on the host (tokens);
            only sizes the split-K partitions (never affects which tokens are
            attended to). Default: the block-table capacity.
        num_splits: split-K partitions: None chooses automatically
            (:func:`~.configs.plan_splits`: splits only when B * kv_heads does
            not fill the GPU), 1 disables split-K, n > 1 asks for up to n
            partitions.
        config: tile override (:class:`~.configs.PagedAttentionConfig`);
            default :func:`~.configs.default_paged_attention_config`.
        validate: run the range checks (seq_lens within [0, capacity],
            read block ids within [0, num_blocks)); they cost one
            device->host sync. Pass False only when the caller guarantees
            the ranges (e.g. inside CUDA-graph capture); shape, dtype and
            device checks always run.

    Returns:
        [B, Hq, D] tensor of query's dtype (``out`` when given).

    Raises:
        TypeError / ValueError naming the argument for bad shapes, dtypes,
        devices, strides, out-of-range seq_lens or block ids;
        RuntimeError when the kernels cannot run on the device (CPU tensors
        need TRITON_INTERPRET=1 set before spec_rl.kernels is imported).

    The result is a deterministic function of the inputs and of
    (num_splits, config); the automatic choices depend only on shapes,
    max_seq_len and the device's SM count, so a different batch size can
    change the last bits (not the math).
    """
    validate_paged_decode(query, kv_cache, block_tables, seq_lens, scale, out, max_seq_len)
    check_paged_device(kv_cache.device)
    check_paged_options(num_splits, config)
    if validate:
        check_block_ranges(kv_cache, block_tables, seq_lens, max_seq_len)
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    if query.shape[0] == 0:
        return out
    if block_tables.shape[1] == 0:  # no blocks: every seq_len is 0 (checked above when validate=True)
        return out.zero_()
    batch, q_heads, head_dim = query.shape
    _, _, block_size, kv_heads, _ = kv_cache.shape
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
    _launch(query, kv_cache, block_tables, seq_lens, scale, out, plan)
    return out


__all__ = [
    "INTERPRET",
    "PagedAttentionConfig",
    "paged_decode_attention",
    "paged_decode_kernel",
    "paged_decode_merge_kernel",
    "plan_splits",
    "splits_for",
]
