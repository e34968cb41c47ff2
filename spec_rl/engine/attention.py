"""Paged attention plugged into transformers' attention extension point.

transformers (>= 4.48, 5.x) looks the attention function up by name in
``AttentionInterface`` on every forward (``config._attn_implementation``);
a name without a registered mask function makes the model skip mask creation
(masking_utils ``_preprocess_mask_arguments``: "custom attention without
equivalent mask creation"), which is what its own continuous-batching path
relies on. We register :func:`paged_attention_forward` under
:data:`ATTN_NAME` and switch a model to it only inside
:func:`paged_attention_active`; outside, the model runs exactly as before, and
the function itself falls back to SDPA if it is ever called without an active
paged batch.

Inputs are packed: the model sees one row ``[1, T]`` holding the new tokens of
every sequence, with explicit ``position_ids``. Per layer the function writes
the new K/V through the slot mapping (:func:`spec_rl.ops.write_kv`), then
attends each sequence's queries over its paged K/V:

- CPU, and on every device for prefill and multi-query (speculative) decode
  steps: :func:`spec_rl.ops.gather_kv` to dense
  [B, H_kv, L, D] + ``torch.nn.functional.scaled_dot_product_attention`` with a
  causal + length mask and GQA;
- CUDA decode (one query per sequence): ``spec_rl.kernels.paged_decode_attention``
  when that Triton kernel is available.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .. import ops

ATTN_NAME = "spec_rl_paged"


@dataclass
class PagedBatch:
    """Everything one packed forward needs to read and write the paged cache.

    Attributes:
        kv_caches: one [num_blocks, 2, block_size, H_kv, D] tensor per layer.
        slot_mapping: [T] int64, slot of each new token (packed order).
        block_tables: [B, max_blocks] int32.
        kv_lens: [B] int64, tokens in each sequence's cache *after* this forward's writes.
        max_kv: max(kv_lens).
        q_index: [B, max_q] int64, packed index of query i of sequence b (padding points to 0).
        q_valid: [B, max_q] bool.
        mask: [B, 1, max_q, max_kv] bool (True = attend) or None (no masking needed).
        decode_kernel: callable for one-query-per-sequence batches on CUDA, else None.
    """

    kv_caches: list[torch.Tensor]
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    kv_lens: torch.Tensor
    max_kv: int
    q_index: torch.Tensor
    q_valid: torch.Tensor
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
    """transformers attention function: query [1, Hq, T, D], key/value [1, H_kv, T, D] -> ([1, T, Hq, D], None)."""
    batch = _ACTIVE
    if batch is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if kwargs.get("sliding_window") is not None:
        raise NotImplementedError("the paged engine does not support sliding-window attention layers")
    if kwargs.get("softcap") is not None:
        raise NotImplementedError("the paged engine does not support attention logit soft-capping")
    if query.shape[0] != 1:
        raise RuntimeError(f"paged attention expects packed input of batch 1, got query {tuple(query.shape)}")
    cache = batch.kv_caches[module.layer_idx]
    k = key[0].transpose(0, 1).to(cache.dtype)  # [T, H_kv, D]
    v = value[0].transpose(0, 1).to(cache.dtype)
    # max_slot from the host-built mapping: no device->host sync per layer on CUDA.
    ops.write_kv(cache, k, v, batch.slot_mapping, max_slot=batch.max_slot)
    q = query[0].transpose(0, 1)  # [T, Hq, D]
    scale = float(scaling) if scaling is not None else q.shape[-1] ** -0.5
    if batch.decode_kernel is not None:
        # The block manager built the tables on the host and build_batch checked their ranges,
        # so the kernel's own range check (one host sync per layer) is skipped.
        out = batch.decode_kernel(
            q.contiguous(),
            cache,
            batch.block_tables,
            batch.kv_lens_i32,
            scale,
            max_seq_len=batch.max_kv,
            validate=False,
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
    out = out.transpose(1, 2)[batch.q_valid]  # [T, Hq, D], packed order
    return out.unsqueeze(0), None


_registered = False


def register() -> None:
    """Register :func:`paged_attention_forward` with transformers (idempotent)."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface

        AttentionInterface.register(ATTN_NAME, paged_attention_forward)
        _registered = True


@contextlib.contextmanager
def paged_attention_active(model: torch.nn.Module, batch: PagedBatch):
    """Run ``model`` with paged attention over ``batch``; restores every config's implementation afterwards."""
    global _ACTIVE
    register()
    configs = {}
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(cfg, "_attn_implementation") and id(cfg) not in configs:
            configs[id(cfg)] = (cfg, cfg._attn_implementation)
    previous = _ACTIVE
    try:
        for cfg, _ in configs.values():
            cfg._attn_implementation = ATTN_NAME
        _ACTIVE = batch
        yield
    finally:
        _ACTIVE = previous
        for cfg, impl in configs.values():
            cfg._attn_implementation = impl


def build_batch(
    kv_caches: list[torch.Tensor],
    slot_mapping: list[int],
    block_tables: list[list[int]],
    starts: list[int],
    q_lens: list[int],
    device: torch.device,
    decode_kernel=None,
) -> PagedBatch:
    """Index tensors for one packed forward.

    Args:
        slot_mapping: slot of every new token, packed in sequence order.
        block_tables: block ids per sequence.
        starts: cached tokens per sequence before this forward (its first new token's position).
        q_lens: new tokens per sequence (>= 1).
    """
    bsz = len(q_lens)
    kv_lens = [s + q for s, q in zip(starts, q_lens)]
    capacity = kv_caches[0].shape[0] if kv_caches else 0
    block_size = kv_caches[0].shape[2] if kv_caches else 1
    for b, (t, n) in enumerate(zip(block_tables, kv_lens)):
        # Host-side range check of everything the kernels will read: -(-n // bs) blocks per sequence.
        if len(t) * block_size < n or any(not 0 <= x < capacity for x in t[: -(-n // block_size)]):
            raise ValueError(f"sequence {b}: block table {t} does not cover {n} tokens in a cache of {capacity} blocks")
    max_kv, max_q = max(kv_lens), max(q_lens)
    width = max(len(t) for t in block_tables)
    tables = torch.zeros((bsz, width), dtype=torch.int32)
    for b, t in enumerate(block_tables):
        tables[b, : len(t)] = torch.tensor(t, dtype=torch.int32)
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
        qpos = starts_t.unsqueeze(1) + i.unsqueeze(0)  # [B, max_q] absolute position of each query
        allowed = (j.view(1, 1, -1) <= qpos.unsqueeze(-1)) & (j.view(1, 1, -1) < kv_t.view(-1, 1, 1))
        # Padding queries attend to key 0 only (their output is dropped): no all-masked rows, no NaN.
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
