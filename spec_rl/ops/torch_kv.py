"""Pure-torch references of the paged KV-cache ops (the semantics csrc/ must match).

Cache layout, one tensor per layer (vLLM / FlashInfer "NHD"):
``kv_cache[num_blocks, 2, block_size, kv_heads, head_dim]``; ``kv_cache[:, 0]``
holds keys, ``kv_cache[:, 1]`` values. Token position ``p`` of a sequence with
block table ``bt`` lives in slot ``bt[p // block_size] * block_size + p % block_size``
(block = slot // block_size, offset = slot % block_size). Negative slots are
padding and are skipped (vLLM's convention).

These functions do no argument checking: :mod:`spec_rl.ops` validates before
calling either them or the compiled ops.
"""

from __future__ import annotations

import torch


def write_kv(
    kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor, check_range: bool = True
) -> None:
    """Scatter ``key``/``value`` [T, H, D] into ``kv_cache`` at ``slot_mapping`` [T] (in place).

    ``check_range`` exists for signature parity with the native op (the wrapper checks ranges).
    """
    block_size = kv_cache.shape[2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    blocks, offsets = slots // block_size, slots % block_size
    kv_cache[blocks, 0, offsets] = key[keep].to(kv_cache.dtype)
    kv_cache[blocks, 1, offsets] = value[keep].to(kv_cache.dtype)


def splice_from_dense(
    kv_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    block_tables: torch.Tensor,
    src_starts: torch.Tensor,
    dst_starts: torch.Tensor,
    lengths: torch.Tensor,
) -> None:
    """Copy dense K/V [B, H, S, D] positions into each sequence's blocks (in place).

    For sequence b and j in [0, lengths[b]): dense position ``src_starts[b] + j``
    (a left-padded transformers cache puts sequence b's first real token at
    ``src_starts[b]``) goes to logical position ``dst_starts[b] + j`` of the
    sequence whose block table is ``block_tables[b]`` [max_blocks] (int32).
    ``dst_starts`` lets a sequence skip prompt blocks it shares with others.
    """
    block_size = kv_cache.shape[2]
    for b in range(key.shape[0]):
        n = int(lengths[b])
        if n == 0:
            continue
        src = torch.arange(int(src_starts[b]), int(src_starts[b]) + n, device=key.device)
        pos = torch.arange(int(dst_starts[b]), int(dst_starts[b]) + n, device=key.device)
        blocks = block_tables[b].long()[pos // block_size]
        offsets = pos % block_size
        kv_cache[blocks, 0, offsets] = key[b][:, src].transpose(0, 1).to(kv_cache.dtype)
        kv_cache[blocks, 1, offsets] = value[b][:, src].transpose(0, 1).to(kv_cache.dtype)


def copy_blocks(kv_cache: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """For each row (src, dst) of ``block_mapping`` [M, 2] (int64): kv_cache[dst] = kv_cache[src].

    Copy-on-write of shared blocks. All sources are read before any destination
    is written, so a block may be both a source and (in another row) a destination.
    """
    if block_mapping.numel() == 0:
        return
    src = block_mapping[:, 0].long()
    dst = block_mapping[:, 1].long()
    kv_cache[dst] = kv_cache[src].clone()


def gather_kv(
    kv_cache: torch.Tensor, block_tables: torch.Tensor, lengths: torch.Tensor, max_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Paged -> dense: keys and values [B, H, max_len, D], right-padded with zeros.

    Row b holds positions [0, lengths[b]) of the sequence with block table
    ``block_tables[b]``; positions >= lengths[b] are zero.
    """
    num_blocks, _, block_size, heads, dim = kv_cache.shape
    bsz = block_tables.shape[0]
    key = kv_cache.new_zeros((bsz, heads, max_len, dim))
    value = kv_cache.new_zeros((bsz, heads, max_len, dim))
    for b in range(bsz):
        n = int(lengths[b])
        if n == 0:
            continue
        pos = torch.arange(n, device=kv_cache.device)
        blocks = block_tables[b].long()[pos // block_size]
        offsets = pos % block_size
        key[b, :, :n] = kv_cache[blocks, 0, offsets].transpose(0, 1)
        value[b, :, :n] = kv_cache[blocks, 1, offsets].transpose(0, 1)
    return key, value
