"""Paged attention registered in transformers' ``AttentionInterface`` and used only inside
:func:`paged_attention_active`: write the new K/V through the slot mapping, then the CUDA decode kernel (one query per
sequence) or gather + SDPA."""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ... import ops
from ..decode_attention import attention_implementation, sdpa

ATTN_NAME = "spec_rl_paged"


@dataclass
class PagedBatch:
    """Index tensors of one packed forward (``kv_lens`` count this forward's writes; ``mask`` None: none needed;
    ``q_valid`` None: every row has one query)."""

    kv_caches: list[torch.Tensor]
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    kv_lens: torch.Tensor
    max_kv: int
    q_index: torch.Tensor
    q_valid: torch.Tensor | None
    mask: torch.Tensor | None
    decode_kernel: object | None = None
    kv_lens_i32: torch.Tensor | None = None
    max_slot: int | None = None


_ACTIVE: PagedBatch | None = None


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Query [1, Hq, T, D], key/value [1, H_kv, T, D] -> ([1, T, Hq, D], None); SDPA when no batch is active."""
    batch = _ACTIVE
    if batch is None:
        return sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    assert query.shape[0] == 1, f"paged attention takes packed input of batch 1, got query {tuple(query.shape)}"
    cache = batch.kv_caches[module.layer_idx]
    k = key[0].transpose(0, 1).to(cache.dtype)  # [T, H_kv, D]
    v = value[0].transpose(0, 1).to(cache.dtype)
    # max_slot comes from the host: no device sync per layer.
    ops.write_kv(cache, k, v, batch.slot_mapping, max_slot=batch.max_slot)
    q = query[0].transpose(0, 1)  # [T, Hq, D]
    scale = float(scaling) if scaling is not None else q.shape[-1] ** -0.5
    if batch.decode_kernel is not None:
        out = batch.decode_kernel(
            q.contiguous(), cache, batch.block_tables, batch.kv_lens_i32, scale, max_seq_len=batch.max_kv
        )
        return out.to(query.dtype).unsqueeze(0), None
    keys, values = ops.gather_kv(cache, batch.block_tables, batch.kv_lens, batch.max_kv)
    qp = q[batch.q_index].transpose(1, 2)  # [B, Hq, max_q, D]
    out = F.scaled_dot_product_attention(
        qp,
        keys.to(q.dtype),
        values.to(q.dtype),
        attn_mask=batch.mask,
        scale=scale,
        enable_gqa=qp.shape[1] != keys.shape[1],
    )
    out = out.transpose(1, 2)  # [B, max_q, Hq, D]
    # [T, Hq, D], packed order; q_valid None: one query per row (the static decode step: no boolean index, no sync)
    out = out.reshape(-1, *out.shape[2:]) if batch.q_valid is None else out[batch.q_valid]
    return out.unsqueeze(0), None


@functools.cache  # once
def register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, paged_attention_forward)


@contextlib.contextmanager
def paged_attention_active(model: torch.nn.Module, batch: PagedBatch):
    """Run ``model`` with paged attention over ``batch``; restores every config afterwards."""
    global _ACTIVE
    register()
    previous = _ACTIVE
    try:
        with attention_implementation(model, ATTN_NAME):
            _ACTIVE = batch
            yield
    finally:
        _ACTIVE = previous


def build_batch(
    kv_caches: list[torch.Tensor],
    slot_mapping: list[int],
    block_tables: list[list[int]],
    starts: list[int],
    q_lens: list[int],
    device: torch.device,
    decode_kernel=None,
) -> PagedBatch:
    """The :class:`PagedBatch` of one packed forward; every block table covers its tokens (asserted)."""
    kv_lens = [s + q for s, q in zip(starts, q_lens)]
    capacity = kv_caches[0].shape[0] if kv_caches else 0
    block_size = kv_caches[0].shape[2] if kv_caches else 1
    for b, (t, n) in enumerate(zip(block_tables, kv_lens)):
        assert len(t) * block_size >= n and all(0 <= x < capacity for x in t[: -(-n // block_size)]), (b, t, n)
    max_kv, max_q = max(kv_lens), max(q_lens)
    width = max(len(t) for t in block_tables)
    tables = torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.int32)
    q_lens_t = torch.tensor(q_lens, dtype=torch.long)
    starts_t = torch.tensor(starts, dtype=torch.long)
    kv_t = torch.tensor(kv_lens, dtype=torch.long)
    cu = torch.cumsum(q_lens_t, 0) - q_lens_t
    i = torch.arange(max_q)
    q_valid = i.unsqueeze(0) < q_lens_t.unsqueeze(1)
    q_index = torch.where(q_valid, cu.unsqueeze(1) + i.unsqueeze(0), torch.zeros((), dtype=torch.long))
    use_kernel = decode_kernel is not None and max_q == 1
    if use_kernel or (max_q == 1 and min(kv_lens) == max_kv):
        mask = None
    else:
        j = torch.arange(max_kv)
        qpos = starts_t.unsqueeze(1) + i.unsqueeze(0)
        allowed = (j.view(1, 1, -1) <= qpos.unsqueeze(-1)) & (j.view(1, 1, -1) < kv_t.view(-1, 1, 1))
        # Padding queries attend to key 0 only: no all-masked row, no NaN.
        allowed = torch.where(q_valid.unsqueeze(-1), allowed, j.view(1, 1, -1) == 0)
        mask = allowed.unsqueeze(1).to(device)
    return PagedBatch(
        kv_caches=kv_caches,
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=device),
        block_tables=tables.to(device),
        kv_lens=kv_t.to(device),
        max_kv=max_kv,
        q_index=q_index.to(device),
        q_valid=q_valid.to(device),
        mask=mask,
        decode_kernel=decode_kernel if use_kernel else None,
        kv_lens_i32=kv_t.to(device=device, dtype=torch.int32) if use_kernel else None,
        max_slot=max(slot_mapping) if slot_mapping else None,
    )
