"""Pure-torch references of the paged KV-cache ops: the semantics csrc/ must match (no argument checks). Layout per
layer (vLLM "NHD"): ``kv_cache[num_blocks, 2 (keys, values), block_size, kv_heads, head_dim]``; position p with block
table bt is slot ``bt[p // block_size] * block_size + p % block_size``; negative slots are padding, skipped.
"""

from __future__ import annotations

import torch


def write_kv(
    kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor, check_range: bool = True
) -> None:
    """Scatter ``key``/``value`` [T, H, D] into ``kv_cache`` at ``slot_mapping`` [T]; ``check_range``: unused here."""
    block_size = kv_cache.shape[2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    blocks, offsets = slots // block_size, slots % block_size
    kv_cache[blocks, 0, offsets] = key[keep].to(kv_cache.dtype)
    kv_cache[blocks, 1, offsets] = value[keep].to(kv_cache.dtype)


def copy_blocks(kv_cache: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Copy-on-write: kv_cache[dst] = kv_cache[src] per row of ``block_mapping`` [M, 2] (int64); all sources are read
    before any destination is written, so a block may be both (in different rows)."""
    if block_mapping.numel() == 0:
        return
    src, dst = block_mapping.long().unbind(1)
    kv_cache[dst] = kv_cache[src].clone()


def gather_kv(
    kv_cache: torch.Tensor, block_tables: torch.Tensor, lengths: torch.Tensor, max_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Paged -> dense K and V [B, H, max_len, D]: positions [0, lengths[b]) via ``block_tables[b]``, zeros after."""
    num_blocks, _, block_size, heads, dim = kv_cache.shape
    bsz = block_tables.shape[0]
    key = kv_cache.new_zeros((bsz, heads, max_len, dim))
    value = kv_cache.new_zeros((bsz, heads, max_len, dim))
    for b in range(bsz):
        n = int(lengths[b])
        pos = torch.arange(n, device=kv_cache.device)
        blocks = block_tables[b].long()[pos // block_size]
        offsets = pos % block_size
        key[b, :, :n] = kv_cache[blocks, 0, offsets].transpose(0, 1)
        value[b, :, :n] = kv_cache[blocks, 1, offsets].transpose(0, 1)
    return key, value
