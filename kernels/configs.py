"""Tile sizes and launch plans of every kernel, chosen by deterministic rules.

Why not ``triton.autotune``: autotuning picks the fastest config by timing,
which can differ between processes; a different BLOCK_V / BLOCK_N changes
the floating-point summation order of the normaliser, hence the last bits of
the log-probs, and a borderline accept/reject decision could flip between
two runs on the same inputs (docs/design.md "Randomness": the same seed gives
the same decisions). So every config is a pure function of (device
capability, dtype, shapes), and ``benchmarks/gpu_suite.py --sweep`` (and
``benchmarks/bench_paged_attention.py --sweep``) time the candidates below so
the defaults can be pinned from measurements.

Contents: :class:`LogitsConfig`, :class:`LMHeadConfig` (verification) and
:class:`PagedAttentionConfig` with the split-K planner of paged decode
attention (:func:`plan_paged_decode`). This module needs torch only.

Reasoning for the H100/H200 defaults (not yet measured on the device):

* from-logits (memory-bound, 1 exp per element): BLOCK_V=2048 over 8 warps
  = 8 elements per thread per tile (one 16-byte load for bf16/fp16, two for
  fp32: 16-byte accesses per thread). The kernel prefetches the
  next tile, so 2 tiles per program are in flight. ptxas (sm_90a) gives ~40
  registers -> 6 programs = 48 warps per SM -> 6 * 2 * 4 KiB = 48 KiB of
  bf16 loads in flight per SM. Little's law: 4.8 TB/s / 132 SMs = 36 GB/s
  per SM, times an assumed ~1 us loaded latency = ~36 KiB needed. (A
  4096-wide tile needs ~98 registers -> 2 programs -> 32 KiB in flight.)
  Instruction budget: ~9 instructions per element (cvt, sub, mul, ex2,
  fma/add/select, max) = 0.75 ms of issue slots at N=16384, V=151936 on 132
  SMs, against a 1.39 ms memory time at 85% of 4.2 TB/s: it fits, but not
  by a wide margin.
* fused LM head (tensor-core bound): 128x256x64 tiles with 8 warps (two
  warpgroups, each issuing 64-row wgmma) and 3 pipeline stages, a common
  large Hopper GEMM tile: arithmetic intensity 128*256/(128+256) = 85
  FLOP/byte of operand traffic per tile, smem = 3 * (128*64 + 256*64) * 2 B
  = 144 KiB (< 227 KiB per SM on sm_90, CUDA C Programming Guide, compute
  capability 9.0 limits). ``benchmarks/compile_check.py`` compiles every
  sweep config for sm_90 on a machine without a GPU and reports registers
  and spills from ptxas. ~16 vocabulary splits keep >= 15 waves of
  programs at N=16384 (128 row blocks x 16 splits over 132 SMs) while the
  resident programs (~8 row blocks) share each W tile through L2.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LogitsConfig:
    """From-logits kernel: BLOCK_V vocabulary columns per tile, BLOCK_R rows and num_warps per program."""

    block_v: int
    num_warps: int
    block_r: int = 1

    def __post_init__(self) -> None:
        if self.block_v < 16 or self.block_v & (self.block_v - 1):
            raise ValueError(f"block_v must be a power of two >= 16, got {self.block_v}")
        if self.block_r < 1 or self.block_r & (self.block_r - 1):
            raise ValueError(f"block_r must be a power of two >= 1, got {self.block_r}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps must be 1, 2, 4, 8 or 16, got {self.num_warps}")


@dataclass(frozen=True)
class LMHeadConfig:
    """Fused LM-head kernel tiles; vocab splits = ceil(V_tiles / ceil(V_tiles / target_splits))."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    target_splits: int = 16
    merge_block: int = 256
    flatten: bool = False  # tl.range(flatten=True): pipeline across vocab tiles (spills at 128x256)

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k", "merge_block"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two >= 16 (tl.dot minimum), got {v}")
        if self.target_splits < 1:
            raise ValueError(f"target_splits must be >= 1, got {self.target_splits}")

    def splits(self, vocab: int) -> tuple[int, int, int]:
        """(number of vocab tiles, tiles per split, number of splits) for a vocabulary of ``vocab``."""
        n_vtiles = -(-vocab // self.block_n)
        per = -(-n_vtiles // min(self.target_splits, n_vtiles))
        return n_vtiles, per, -(-n_vtiles // per)


def next_pow2(x: int) -> int:
    """Smallest power of two >= x (1 for x <= 1)."""
    return 1 << max(0, int(x - 1).bit_length())


def default_logits_config(vocab: int, dtype: torch.dtype, interpret: bool) -> LogitsConfig:
    """Deterministic from-logits config (see module docstring)."""
    if interpret:
        # The interpreter runs one numpy op per Triton op: big 2-D tiles are fastest.
        block_v = max(16, min(1024, next_pow2(vocab)))
        return LogitsConfig(block_v=block_v, num_warps=4, block_r=max(1, min(64, 8192 // block_v)))
    per_thread = 8
    tile = 2048
    block_v = max(16, min(tile, next_pow2(vocab)))
    # Small vocabularies: several rows per program keep the tile (and the
    # bytes in flight per thread) at the same size.
    block_r = max(1, min(16, tile // block_v))
    warps = max(1, min(8, block_r * block_v // (32 * per_thread)))
    return LogitsConfig(block_v=block_v, num_warps=warps, block_r=block_r)


def default_lm_head_config(d: int, vocab: int, dtype: torch.dtype, interpret: bool) -> LMHeadConfig:
    """Deterministic fused LM-head config (see module docstring)."""
    if interpret:
        bk = 32 if d >= 32 else 16
        return LMHeadConfig(
            block_m=32, block_n=64, block_k=bk, num_warps=4, num_stages=1, target_splits=4, merge_block=64
        )
    if dtype == torch.float32:
        # IEEE fp32 dot (no tensor cores): small tiles keep registers in check.
        return LMHeadConfig(block_m=64, block_n=64, block_k=32, num_warps=4, num_stages=3)
    major = torch.cuda.get_device_capability()[0] if torch.cuda.is_available() else 0
    if major >= 9:
        return LMHeadConfig(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3)
    # Ampere/Ada: 128x128x32, 4 stages (A100 smem 164 KiB).
    return LMHeadConfig(block_m=128, block_n=128, block_k=32, num_warps=4, num_stages=4)


# Candidates timed by benchmarks/gpu_suite.py --sweep (H100/H200).
LOGITS_SWEEP = [
    LogitsConfig(2048, 8),  # default: ~40 registers, 6 programs per SM
    LogitsConfig(1024, 4),
    LogitsConfig(2048, 4),
    LogitsConfig(4096, 8),
    LogitsConfig(4096, 16),
    LogitsConfig(8192, 16),
]
LM_HEAD_SWEEP = [
    LMHeadConfig(128, 256, 64, 8, 3),  # default: 254 regs, 144 KiB smem -> 1 CTA/SM
    LMHeadConfig(128, 256, 64, 8, 4),
    LMHeadConfig(128, 128, 64, 8, 3),  # 128 regs, 96 KiB smem -> 2 CTAs/SM (one's epilogue overlaps the other's MMA)
    LMHeadConfig(128, 128, 64, 8, 3, flatten=True),  # 224 regs, no spills
    LMHeadConfig(128, 128, 64, 8, 4),
    LMHeadConfig(128, 128, 64, 4, 4),
    LMHeadConfig(256, 128, 64, 8, 3),
    LMHeadConfig(128, 256, 64, 8, 3, target_splits=8),
    LMHeadConfig(128, 256, 64, 8, 3, target_splits=32),
]


# ----------------------------------------------------------------------------
# paged decode attention


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


def default_paged_attention_config(group: int, head_dim: int, dtype: torch.dtype) -> PagedAttentionConfig:
    """Deterministic tile rule for a query group of ``group`` heads, head size ``head_dim``, cache ``dtype``.

    Not yet timed on a GPU (benchmarks/bench_paged_attention.py --sweep times
    the candidates in :data:`PAGED_ATTENTION_SWEEP`); the reasoning, from
    ``ptxas -v`` for sm_90a (benchmarks/compile_check.py):

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
    g_pad = next_pow2(group)
    d_pad = next_pow2(max(head_dim, 8))
    if d_pad >= 16 and (dtype != torch.float32 or g_pad >= 8):
        if d_pad <= 64:
            return PagedAttentionConfig(block_n=128, num_warps=4, use_dot=True, num_stages=2)
        return PagedAttentionConfig(block_n=64 if d_pad <= 128 else 32, num_warps=8, use_dot=True, num_stages=2)
    block_n = max(8, min(128, 8192 // (g_pad * d_pad)))
    return PagedAttentionConfig(block_n=block_n, num_warps=4, use_dot=False, num_stages=1)


# Candidates timed by benchmarks/bench_paged_attention.py --sweep (and compiled by compile_check.py).
PAGED_ATTENTION_SWEEP = [
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


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (cached); 4 elsewhere (the interpreter's nominal device)."""
    if device.type != "cuda":
        return 4  # a nominal small device, so small interpreter tests exercise both split paths
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


@dataclass(frozen=True)
class PagedDecodePlan:
    """One paged decode launch: tiles, padded group / head sizes, contraction path and split-K partitions."""

    config: PagedAttentionConfig
    group: int  # query heads per kv head (G)
    g_pad: int  # G padded to a power of two (>= 16 on the tl.dot path)
    d_pad: int  # head_dim padded to a power of two (>= 8)
    use_dot: bool
    num_splits: int
    tokens_per_split: int


def plan_paged_decode(
    batch: int,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    capacity: int,
    *,
    max_seq_len: int | None,
    num_splits: int | None,
    config: PagedAttentionConfig | None,
    num_sms: int,
) -> PagedDecodePlan:
    """Plan a decode launch (a pure function of its arguments, so it is reproducible).

    ``capacity`` is the block-table width in tokens; ``max_seq_len`` (a host
    bound of the sequence lengths) only sizes the partitions. ``num_splits``
    None plans split-K automatically (:func:`plan_splits`), an int asks for up
    to that many partitions (:func:`splits_for`); ``num_sms`` is the device's
    SM count (:func:`sm_count`).
    """
    group = q_heads // kv_heads
    cfg = config or default_paged_attention_config(group, head_dim, dtype)
    d_pad = next_pow2(max(head_dim, 8))
    use_dot = cfg.use_dot and d_pad >= 16
    g_pad = max(16, next_pow2(group)) if use_dot else next_pow2(group)
    horizon = capacity if max_seq_len is None else min(max_seq_len, capacity)
    if num_splits is None:
        splits, per = plan_splits(batch, kv_heads, horizon, cfg.block_n, num_sms)
    else:
        splits, per = splits_for(num_splits, horizon, cfg.block_n)
    return PagedDecodePlan(cfg, group, g_pad, d_pad, use_dot, splits, per)
