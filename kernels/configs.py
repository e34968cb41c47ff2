"""Tile sizes and launch plans of every kernel: pure functions of (device capability, dtype, shapes).

No ``triton.autotune``: another tile changes the normaliser's summation order, hence the last bits of the
log-probs and possibly a borderline decision, from run to run (docs/design.md "Randomness")."""

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
        assert _pow2(self.block_v, 16) and _pow2(self.block_r, 1), f"block_v, block_r must be powers of two: {self}"
        assert self.num_warps in (1, 2, 4, 8, 16), self


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
    flatten: bool = False  # tl.range(flatten=True): pipeline across vocab tiles

    def __post_init__(self) -> None:
        tiles = (self.block_m, self.block_n, self.block_k, self.merge_block)
        assert all(_pow2(v, 16) for v in tiles), f"tiles must be powers of two >= 16 (tl.dot minimum): {self}"
        assert self.target_splits >= 1, self

    def splits(self, vocab: int) -> tuple[int, int, int]:
        """(vocab tiles, tiles per split, splits) for a vocabulary of ``vocab``."""
        n_vtiles = -(-vocab // self.block_n)
        per = -(-n_vtiles // min(self.target_splits, n_vtiles))
        return n_vtiles, per, -(-n_vtiles // per)


def _pow2(x: int, low: int) -> bool:
    return x >= low and not x & (x - 1)


def next_pow2(x: int) -> int:
    """Smallest power of two >= x (1 for x <= 1)."""
    return 1 << max(0, int(x - 1).bit_length())


def default_logits_config(vocab: int, dtype: torch.dtype, interpret: bool) -> LogitsConfig:
    """Deterministic from-logits config: 2048-wide tiles, 8 elements per thread (16-byte bf16 loads)."""
    if interpret:
        block_v = max(16, min(1024, next_pow2(vocab)))  # interpreter: one numpy op per Triton op, big tiles
        return LogitsConfig(block_v=block_v, num_warps=4, block_r=max(1, min(64, 8192 // block_v)))
    per_thread = 8
    tile = 2048
    block_v = max(16, min(tile, next_pow2(vocab)))
    block_r = max(1, min(16, tile // block_v))  # small vocabularies: more rows, same tile size
    warps = max(1, min(8, block_r * block_v // (32 * per_thread)))
    return LogitsConfig(block_v=block_v, num_warps=warps, block_r=block_r)


def default_lm_head_config(d: int, vocab: int, dtype: torch.dtype, interpret: bool) -> LMHeadConfig:
    """Deterministic fused LM-head config (Hopper: 128x256x64, 8 warps, 3 stages)."""
    if interpret:
        bk = 32 if d >= 32 else 16
        return LMHeadConfig(
            block_m=32, block_n=64, block_k=bk, num_warps=4, num_stages=1, target_splits=4, merge_block=64
        )
    if dtype == torch.float32:
        return LMHeadConfig(block_m=64, block_n=64, block_k=32, num_warps=4, num_stages=3)  # IEEE fp32 dot
    major = torch.cuda.get_device_capability()[0] if torch.cuda.is_available() else 0
    if major >= 9:
        return LMHeadConfig(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3)
    return LMHeadConfig(block_m=128, block_n=128, block_k=32, num_warps=4, num_stages=4)  # Ampere/Ada


@dataclass(frozen=True)
class PagedAttentionConfig:
    """Paged decode tiles: ``block_n`` tokens per tile, ``num_stages`` of K/V pipelining (``tl.dot`` path)."""

    block_n: int
    num_warps: int = 4
    use_dot: bool = False
    num_stages: int = 1

    def __post_init__(self) -> None:
        assert _pow2(self.block_n, 16 if self.use_dot else 1), f"block_n must be a power of two (tl.dot: >= 16): {self}"
        assert self.num_warps in (1, 2, 4, 8, 16) and self.num_stages >= 1, self


def default_paged_attention_config(group: int, head_dim: int, dtype: torch.dtype) -> PagedAttentionConfig:
    """Deterministic paged decode tiles: the ``tl.dot`` path for bf16/fp16 (or groups >= 8) and head_dim >= 16,
    else fp32 broadcast-and-sum, its [G_PAD, BLOCK_N, D_PAD] product capped at 8192 elements."""
    g_pad = next_pow2(group)
    d_pad = next_pow2(max(head_dim, 8))
    if d_pad >= 16 and (dtype != torch.float32 or g_pad >= 8):
        if d_pad <= 64:
            return PagedAttentionConfig(block_n=128, num_warps=4, use_dot=True, num_stages=2)
        return PagedAttentionConfig(block_n=64 if d_pad <= 128 else 32, num_warps=8, use_dot=True, num_stages=2)
    block_n = max(8, min(128, 8192 // (g_pad * d_pad)))
    return PagedAttentionConfig(block_n=block_n, num_warps=4, use_dot=False, num_stages=1)


def plan_splits(
    batch: int, kv_heads: int, max_seq_len: int, block_n: int, sm_count: int, min_tokens_per_split: int = 256
) -> tuple[int, int]:
    """Automatic split-K (num_splits, tokens_per_split, a multiple of ``block_n``): none when batch * kv_heads
    fills the SMs or the context is short, else ~2 waves of partitions of >= ``min_tokens_per_split`` tokens."""
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
    """(actual splits <= num_splits, tokens_per_split) for a requested ``num_splits`` (no empty partitions)."""
    tiles = max(1, -(-max_seq_len // block_n))
    per = -(-tiles // max(1, min(num_splits, tiles)))
    return -(-tiles // per), per * block_n


_SM_COUNT: dict[int, int] = {}


def sm_count(device: torch.device) -> int:
    """SM count of a CUDA device (cached); 4 elsewhere, so small interpreter runs exercise both split paths."""
    if device.type != "cuda":
        return 4
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


@dataclass(frozen=True)
class PagedDecodePlan:
    """One paged decode launch: tiles, padded sizes, contraction path and split-K partitions."""

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
    """Plan a decode launch. ``capacity``: block-table width (tokens); ``max_seq_len``: a host bound of the
    lengths, only sizes the partitions; ``num_splits``: None plans automatically (:func:`plan_splits`)."""
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
