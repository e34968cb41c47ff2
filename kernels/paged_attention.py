"""Paged decode attention in Triton: one new query token per sequence against a paged KV cache.

The GPU attention path of the paged generation engine (issue 4). Cache
layout, one tensor per layer (vLLM / FlashInfer "NHD", see
:mod:`spec_rl.ops.reference`): ``kv_cache[num_blocks, 2, block_size,
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
* Contractions, two paths (see :func:`default_config`): ``tl.dot`` with
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
  result is bit-reproducible run to run (DESIGN.md: prefer deterministic
  merges).

Numerics: scores are kept in log2 units (``q . k * scale * log2(e)``, then
``exp2``); the running maximum starts at ``-FLT_MAX`` rather than ``-inf``
so a tile or split with no valid token never evaluates ``-inf - -inf``.
Masked tokens (positions ``>= seq_len``, including the unused tail of the
last block) are never loaded, so whatever is stored there (NaN in freed
blocks) cannot leak into the result. A sequence with ``seq_len == 0``
attends to nothing and gets an all-zero output row (the empty-sum
convention; FlashAttention-style kernels do the same).

Accuracy (asserted in tests/test_kernels_paged_attention.py against a
float64 gather + softmax over the same inputs): fp32 caches within ~1e-5;
bf16 / fp16 within a few units of the output dtype's rounding (the final
rounding of the output, plus the rounding of the probabilities before the
tensor-core P @ V product on the ``tl.dot`` path).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# Largest finite float32 (IEEE 754 binary32): initial running maximum.
_NEG_FLT_MAX = tl.constexpr(-3.4028234663852886e38)
_LOG2E = 1.4426950408889634  # log2(e): exp(x) = exp2(x * log2(e))
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256


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
    if USE_DOT:
        if DOT_F32:
            q = q.to(tl.float32)
        else:
            q = q.to(kv_ptr.dtype.element_ty)  # tl.dot needs matching operand types
    else:
        q = q.to(tl.float32) * qk_scale  # fold the scale once; products stay fp32

    m = tl.full([G_PAD], _NEG_FLT_MAX, tl.float32)
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
        if USE_DOT:
            if DOT_F32:
                s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = s * qk_scale
        else:
            s = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)
        s = tl.where(t_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        if USE_DOT:
            if DOT_F32:
                pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
        else:
            pv = tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
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
    part_acc_ptr,
    part_ml_ptr,
    out_ptr,
    stride_ob,
    stride_oh,
    num_splits,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
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
    tl.store(
        out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + d,
        out.to(out_ptr.dtype.element_ty),
        mask=d < D,
    )


# The kernels were created by the interpreter when TRITON_INTERPRET=1 was set
# before this module was imported (triton reads it at decoration time).
INTERPRET = type(paged_decode_kernel).__name__ == "InterpretedFunction"


# ----------------------------------------------------------------------------
# configuration (a pure function of shapes and device: no autotuning, so the
# floating-point summation order -- hence the last bits -- never varies
# between runs; same reasoning as kernels/configs.py)


def _next_pow2(x: int) -> int:
    return 1 << max(0, int(x - 1).bit_length())


@dataclass(frozen=True)
class PagedAttentionConfig:
    """Tiles: ``block_n`` tokens per tile, ``num_warps``, ``num_stages`` (software pipelining of the
    K/V loads; used by Triton on the ``tl.dot`` path), and whether to contract with ``tl.dot``."""

    block_n: int
    num_warps: int = 4
    use_dot: bool = False
    num_stages: int = 1

    def __post_init__(self) -> None:
        if self.block_n < 1 or self.block_n & (self.block_n - 1):
            raise ValueError(f"block_n must be a power of two >= 1, got {self.block_n}")
        if self.use_dot and self.block_n < 16:
            raise ValueError(f"block_n must be >= 16 with use_dot=True (tl.dot minimum), got {self.block_n}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps must be 1, 2, 4, 8 or 16, got {self.num_warps}")
        if self.num_stages < 1:
            raise ValueError(f"num_stages must be >= 1, got {self.num_stages}")


def default_config(group: int, head_dim: int, dtype: torch.dtype) -> PagedAttentionConfig:
    """Deterministic tile rule for a query group of ``group`` heads, head size ``head_dim``, cache ``dtype``.

    Not yet timed on a GPU (benchmarks/bench_paged_attention.py --sweep times
    the candidates in :data:`SWEEP`); the reasoning, from ``ptxas -v`` for
    sm_90a (benchmarks/compile_check.py):

    * bf16/fp16 caches, head_dim >= 16: the ``tl.dot`` path (query group
      padded to 16 rows; the wasted MMA rows cost nothing in a kernel bound
      by K/V bytes) with 2 pipeline stages, which Triton lowers to cp.async
      prefetch of the next K/V tile into shared memory. At Qwen3-0.6B's
      shape (G=2, D=128): 64 tokens x 8 warps -> 66 registers, 38 KiB smem,
      no spills -> 3 programs (24 warps) per SM, 2 x 32 KiB of K/V in flight
      per program. head_dim 256: 32 tokens (64 registers, 41 KiB smem);
      head_dim <= 64: 128 tokens over 4 warps.
    * fp32 caches (and head_dim < 16): the fp32 broadcast-and-sum path for
      groups up to 4 -- the [G_PAD, BLOCK_N, D_PAD] float32 product capped at
      8192 elements (64 per thread over 4 warps; 16384 spills at G=2,
      D=128) -- and an IEEE fp32 ``tl.dot`` for larger groups.
    """
    g_pad = _next_pow2(group)
    d_pad = _next_pow2(max(head_dim, 8))
    if d_pad >= 16 and (dtype != torch.float32 or g_pad >= 8):
        if d_pad <= 64:
            return PagedAttentionConfig(block_n=128, num_warps=4, use_dot=True, num_stages=2)
        return PagedAttentionConfig(block_n=64 if d_pad <= 128 else 32, num_warps=8, use_dot=True, num_stages=2)
    block_n = max(8, min(128, 8192 // (g_pad * d_pad)))
    return PagedAttentionConfig(block_n=block_n, num_warps=4, use_dot=False, num_stages=1)


# Candidates timed by benchmarks/bench_paged_attention.py --sweep (and compiled by compile_check.py).
SWEEP = [
    PagedAttentionConfig(64, 8, True, 2),  # default at D=128, bf16
    PagedAttentionConfig(64, 8, True, 3),
    PagedAttentionConfig(64, 4, True, 3),
    PagedAttentionConfig(128, 8, True, 2),
    PagedAttentionConfig(32, 4, True, 3),
    PagedAttentionConfig(32, 4, False, 1),  # fp32-exact broadcast path
    PagedAttentionConfig(16, 4, False, 1),
]


def plan_splits(
    batch: int, kv_heads: int, max_seq_len: int, block_n: int, sm_count: int, min_tokens_per_split: int = 256
) -> tuple[int, int]:
    """(num_splits, tokens_per_split) for the automatic split-K choice.

    No split when the (sequence, kv head) programs already fill the device
    (``batch * kv_heads >= sm_count``) or the context is short; otherwise
    about two waves of programs, each partition at least
    ``min_tokens_per_split`` tokens (vLLM's v2 decode kernel uses 512-token
    partitions; 256 keeps the partials' traffic < 1% of the K/V bytes at
    head_dim 128). ``tokens_per_split`` is a multiple of ``block_n``. A pure
    function of its arguments, so the result is reproducible.
    """
    tiles = max(1, -(-max_seq_len // block_n))
    programs = max(1, batch * kv_heads)
    min_tiles = max(1, -(-min_tokens_per_split // block_n))
    if programs >= sm_count or tiles < 2 * min_tiles:
        return 1, tiles * block_n
    want = -(-2 * sm_count // programs)
    splits = max(1, min(want, tiles // min_tiles))
    per = -(-tiles // splits)
    return -(-tiles // per), per * block_n


def splits_for(num_splits: int, max_seq_len: int, block_n: int) -> tuple[int, int]:
    """(actual splits, tokens_per_split) for a requested ``num_splits`` (<= requested; empty partitions dropped)."""
    tiles = max(1, -(-max_seq_len // block_n))
    per = -(-tiles // max(1, min(num_splits, tiles)))
    return -(-tiles // per), per * block_n


_SM_COUNT: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # interpreter: a nominal small device, so small tests exercise both paths
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


# ----------------------------------------------------------------------------
# validation


def _check_tensor(name: str, t, dims: int, shape_doc: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {shape_doc}, got {type(t).__name__}")
    if t.dim() != dims:
        raise ValueError(f"{name} must be {dims}-D {shape_doc}, got shape {tuple(t.shape)}")


def _validate(query, kv_cache, block_tables, seq_lens, scale, out, max_seq_len):
    _check_tensor("query", query, 3, "[batch, q_heads, head_dim]")
    _check_tensor("kv_cache", kv_cache, 5, "[num_blocks, 2, block_size, kv_heads, head_dim]")
    _check_tensor("block_tables", block_tables, 2, "[batch, max_blocks]")
    _check_tensor("seq_lens", seq_lens, 1, "[batch]")
    if kv_cache.shape[1] != 2:
        raise ValueError(
            f"kv_cache must have shape [num_blocks, 2, block_size, kv_heads, head_dim], got {tuple(kv_cache.shape)}"
        )
    if query.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"query dtype must be float32, float16 or bfloat16, got {query.dtype}")
    if kv_cache.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"kv_cache dtype must be float32, float16 or bfloat16, got {kv_cache.dtype}")
    if block_tables.dtype != torch.int32:
        raise TypeError(f"block_tables must be int32, got {block_tables.dtype}; convert with .to(torch.int32)")
    if seq_lens.dtype != torch.int32:
        raise TypeError(f"seq_lens must be int32, got {seq_lens.dtype}; convert with .to(torch.int32)")
    dev = kv_cache.device
    for name, t in (("query", query), ("block_tables", block_tables), ("seq_lens", seq_lens)):
        if t.device != dev:
            raise ValueError(f"{name} is on {t.device} but kv_cache is on {dev}; move it with .to(kv_cache.device)")
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be contiguous (allocate it with torch.empty/zeros)")
    if query.stride(2) != 1:
        raise ValueError("query must have unit stride over head_dim (call .contiguous())")
    if block_tables.numel() and block_tables.stride(1) != 1:
        raise ValueError("block_tables must have unit stride over blocks (call .contiguous())")
    if seq_lens.numel() and seq_lens.stride(0) != 1:
        raise ValueError("seq_lens must be contiguous (call .contiguous())")
    batch, q_heads, head_dim = query.shape
    _, _, block_size, kv_heads, kv_dim = kv_cache.shape
    if head_dim != kv_dim:
        raise ValueError(f"query head_dim {head_dim} does not match kv_cache head_dim {kv_dim}")
    if head_dim < 1 or head_dim > MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be in [1, {MAX_HEAD_DIM}], got {head_dim}")
    if kv_heads < 1 or q_heads < 1 or q_heads % kv_heads:
        raise ValueError(
            f"query has {q_heads} heads, which must be a positive multiple of kv_cache's {kv_heads} kv heads (GQA)"
        )
    if block_size < 1:
        raise ValueError(f"kv_cache block_size (dim 2) must be >= 1, got {block_size}")
    if block_tables.shape[0] != batch:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows but query has batch {batch}")
    if seq_lens.shape[0] != batch:
        raise ValueError(f"seq_lens has shape {tuple(seq_lens.shape)}, expected ({batch},)")
    if not isinstance(scale, numbers.Real) or isinstance(scale, bool) or not math.isfinite(float(scale)):
        raise ValueError(f"scale must be a finite Python number (e.g. head_dim ** -0.5), got {scale!r}")
    if max_seq_len is not None and (not isinstance(max_seq_len, int) or max_seq_len < 0):
        raise ValueError(f"max_seq_len must be a non-negative int or None, got {max_seq_len!r}")
    if out is not None:
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"out must be a torch.Tensor or None, got {type(out).__name__}")
        if out.shape != query.shape or out.dtype != query.dtype or out.device != query.device:
            raise ValueError(
                f"out must match query (shape {tuple(query.shape)}, {query.dtype}, {query.device}); "
                f"got {tuple(out.shape)}, {out.dtype}, {out.device}"
            )
        if out.stride(2) != 1:
            raise ValueError("out must have unit stride over head_dim")


def _check_ranges(kv_cache, block_tables, seq_lens, max_seq_len) -> None:
    """Range checks with one device->host transfer (skip with validate=False, e.g. under CUDA-graph capture)."""
    if seq_lens.numel() == 0:
        return
    num_blocks, _, block_size, _, _ = kv_cache.shape
    max_blocks = block_tables.shape[1]
    capacity = max_blocks * block_size
    lens = seq_lens.long()
    # Only the entries a sequence actually reads are checked: unused table
    # entries may hold any padding value (e.g. -1).
    pages = (lens + block_size - 1) // block_size
    used = torch.arange(max_blocks, device=lens.device).unsqueeze(0) < pages.unsqueeze(1)
    bad_block = used & ((block_tables < 0) | (block_tables >= num_blocks))
    stats = torch.stack(
        [
            lens.min(),
            lens.max(),
            bad_block.any().long(),
        ]
    ).tolist()
    lo, hi, bad = stats
    if lo < 0:
        raise ValueError(f"seq_lens must be >= 0, got a minimum of {lo}")
    if hi > capacity:
        raise ValueError(
            f"seq_lens must be <= max_blocks * block_size = {max_blocks} * {block_size} = {capacity} "
            f"(the block_tables width), got a maximum of {hi}"
        )
    if max_seq_len is not None and hi > max_seq_len:
        raise ValueError(f"max_seq_len={max_seq_len} is smaller than max(seq_lens)={hi}")
    if bad:
        rows, cols = torch.nonzero(bad_block, as_tuple=True)
        r, c = int(rows[0]), int(cols[0])
        raise ValueError(
            f"block_tables[{r}, {c}] = {int(block_tables[r, c])} is outside [0, {num_blocks}) (kv_cache num_blocks) "
            f"but sequence {r} (seq_len {int(seq_lens[r])}) reads that block"
        )


# ----------------------------------------------------------------------------
# entry point


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
            (:func:`plan_splits`: splits only when B * kv_heads does not fill
            the GPU), 1 disables split-K, n > 1 asks for up to n partitions.
        config: tile override (:class:`PagedAttentionConfig`); default
            :func:`default_config`.
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
    _validate(query, kv_cache, block_tables, seq_lens, scale, out, max_seq_len)
    dev = kv_cache.device
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("paged_decode_attention: CUDA tensors but no usable CUDA device")
        if INTERPRET:
            raise RuntimeError(
                "paged_decode_attention: spec_rl.kernels was imported with TRITON_INTERPRET=1; "
                "unset it before importing to run on the GPU"
            )
    elif dev.type == "cpu":
        if not INTERPRET:
            raise RuntimeError(
                "paged_decode_attention on CPU tensors needs the Triton interpreter: set TRITON_INTERPRET=1 "
                "before importing spec_rl.kernels (slow; tests only), or use gather + SDPA on CPU"
            )
    else:
        raise RuntimeError(f"paged_decode_attention cannot run on device {dev}")
    if num_splits is not None and (not isinstance(num_splits, int) or num_splits < 1):
        raise ValueError(f"num_splits must be None or an int >= 1, got {num_splits!r}")
    if config is not None and not isinstance(config, PagedAttentionConfig):
        raise TypeError(f"config must be a PagedAttentionConfig or None, got {type(config).__name__}")
    if validate:
        _check_ranges(kv_cache, block_tables, seq_lens, max_seq_len)

    batch, q_heads, head_dim = query.shape
    _, _, block_size, kv_heads, _ = kv_cache.shape
    group = q_heads // kv_heads
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    if batch == 0:
        return out
    if block_tables.shape[1] == 0:  # no blocks: every seq_len is 0 (checked above when validate=True)
        return out.zero_()

    cfg = config or default_config(group, head_dim, kv_cache.dtype)
    d_pad = _next_pow2(max(head_dim, 8))
    use_dot = cfg.use_dot and d_pad >= 16
    g_pad = max(16, _next_pow2(group)) if use_dot else _next_pow2(group)
    cap = block_tables.shape[1] * block_size
    horizon = cap if max_seq_len is None else min(max_seq_len, cap)
    if num_splits is None:
        splits, per = plan_splits(batch, kv_heads, horizon, cfg.block_n, _sm_count(dev))
    else:
        splits, per = splits_for(num_splits, horizon, cfg.block_n)
    split = splits > 1

    if split:
        part_acc = torch.empty((batch, q_heads, splits, d_pad), dtype=torch.float32, device=dev)
        part_ml = torch.empty((batch, q_heads, splits, 2), dtype=torch.float32, device=dev)
    else:
        part_acc = part_ml = out  # unused pointer slots
    stride_btb = block_tables.stride(0) if block_tables.numel() else 0
    paged_decode_kernel[(batch, kv_heads, splits)](
        query,
        kv_cache,
        block_tables,
        seq_lens,
        out,
        part_acc,
        part_ml,
        float(scale) * _LOG2E,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        stride_btb,
        per,
        splits,
        G=group,
        G_PAD=g_pad,
        D=head_dim,
        D_PAD=d_pad,
        BLOCK_SIZE=block_size,
        BLOCK_N=cfg.block_n,
        USE_DOT=use_dot,
        # fp32 caches: IEEE fp32 dot (never TF32). The interpreter's tl.dot
        # multiplies bf16 operands as their raw uint16 bits (triton 3.9
        # interpreter.create_dot), so it gets fp32 operands there too.
        DOT_F32=kv_cache.dtype == torch.float32 or (INTERPRET and kv_cache.dtype == torch.bfloat16),
        SPLIT=split,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
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
            D_PAD=d_pad,
            num_warps=1 if d_pad <= 64 else 2,
        )
    return out


__all__ = [
    "INTERPRET",
    "SWEEP",
    "PagedAttentionConfig",
    "default_config",
    "paged_decode_attention",
    "paged_decode_kernel",
    "paged_decode_merge_kernel",
    "plan_splits",
    "splits_for",
]
