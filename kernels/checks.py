"""Argument checks of the public entry points, one helper per kind of check; every error names the argument
and the fix. Only :func:`raise_if_flagged` and :func:`check_block_ranges` synchronise with the device."""

from __future__ import annotations

import math
import numbers

import torch

from ._common import FLOAT_DTYPES, INTERPRET, DraftRows
from .configs import PagedAttentionConfig

MAX_HEAD_DIM = 256  # the largest head size of paged decode attention


def is_available(device: torch.device | str | None = None) -> bool:
    """Whether the kernels can run on ``device`` (default: CUDA if present); CPU needs TRITON_INTERPRET=1."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available()
    if device.type == "cpu":
        return INTERPRET
    return False


def check_device(*tensors: torch.Tensor | None) -> None:
    """RuntimeError unless the kernels run on the first tensor's device; ValueError for a tensor elsewhere."""
    dev = tensors[0].device
    if not is_available(dev):
        hint = (
            "set TRITON_INTERPRET=1 before importing spec_rl.kernels to run them on CPU (slow; tests only)"
            if dev.type == "cpu"
            else "no usable CUDA device"
        )
        raise RuntimeError(f"Triton verification kernels cannot run on {dev}: {hint}")
    for t in tensors[1:]:
        if t is not None and t.device != dev:
            raise ValueError(f"all inputs must be on {dev}; got a tensor on {t.device}")


def raise_if_flagged(flag: torch.Tensor, source: str, lp: torch.Tensor, tags=None) -> None:
    """If the flag is set, ValueError naming the NaN rows of ``lp`` ([B, R], or [N] with ``tags`` = (row_sample,
    row_token)) as (sample, token), worded as the reference backend's (spec_rl.acceptance.dispatch). One sync."""
    if not int(flag.item()):
        return
    rows = torch.nonzero(torch.isnan(lp))
    total = rows.shape[0]
    first = rows[:8] if lp.dim() == 2 else torch.stack([tags[0][rows[:8, 0]], tags[1][rows[:8, 0]]], 1)
    listing = ", ".join(f"({b}, {t})" for b, t in first.tolist()) + (", ..." if total > 8 else "")
    raise ValueError(
        f"{source} give no valid distribution at {total} scored position{'s' if total != 1 else ''} (sample, token): "
        f"{listing}: NaN, +inf, or every logit -inf. The policy forward produced invalid "
        "scores: check it for overflow (fp16/bf16, huge hidden states), or mask those positions out with lengths"
    )


def unit_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def row_vector(t: torch.Tensor, n: int, name: str) -> torch.Tensor:
    """``t`` as a contiguous [n] vector, or a ValueError naming it."""
    if t.shape != (n,):
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected ({n},)")
    return t.contiguous()


def packed_rows(n_rows: int, draft_ids, old_logprobs, row_sample, row_token, lengths, uids, **settings) -> DraftRows:
    """Checked packed inputs as :class:`DraftRows`; ``settings``: seed, log_lenience, temperature, mode."""
    draft_ids = row_vector(draft_ids, n_rows, "draft_ids")
    old_logprobs = row_vector(old_logprobs, n_rows, "old_logprobs")
    if draft_ids.is_floating_point():
        raise TypeError(f"draft_ids must be an integer tensor, got {draft_ids.dtype}")
    if not old_logprobs.is_floating_point():
        raise TypeError(f"old_logprobs must be a float tensor, got {old_logprobs.dtype}")
    row_sample = row_vector(row_sample, n_rows, "row_sample").to(torch.int32)
    row_token = row_vector(row_token, n_rows, "row_token").to(torch.int32)
    if lengths.dim() != 1 or uids.shape != lengths.shape:
        raise ValueError(f"lengths and uids must both be [B]; got {tuple(lengths.shape)} and {tuple(uids.shape)}")
    uids = uids.to(torch.int64).contiguous()
    return DraftRows(draft_ids, old_logprobs, lengths.contiguous(), uids, row_sample, row_token, **settings)


def check_tensor(name: str, t, dims: int, shape_doc: str, kind: str, device: torch.device | None = None) -> None:
    """A ``dims``-D tensor of ``kind`` ("float": the kernels' dtypes, or "int32") on ``device``."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {shape_doc}, got {type(t).__name__}")
    if t.dim() != dims:
        raise ValueError(f"{name} must be {dims}-D {shape_doc}, got shape {tuple(t.shape)}")
    if kind == "float" and t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} dtype must be float32, float16 or bfloat16, got {t.dtype}")
    if kind == "int32" and t.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {t.dtype}; convert with .to(torch.int32)")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but kv_cache is on {device}; move it with .to(kv_cache.device)")


def _check_strides(query, kv_cache, block_tables, seq_lens) -> None:
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be contiguous (allocate it with torch.empty/zeros)")
    if query.stride(2) != 1:
        raise ValueError("query must have unit stride over head_dim (call .contiguous())")
    if block_tables.numel() and block_tables.stride(1) != 1:
        raise ValueError("block_tables must have unit stride over blocks (call .contiguous())")
    if seq_lens.numel() and seq_lens.stride(0) != 1:
        raise ValueError("seq_lens must be contiguous (call .contiguous())")


def _check_out(out, query) -> None:
    if out is None:
        return
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor or None, got {type(out).__name__}")
    if out.shape != query.shape or out.dtype != query.dtype or out.device != query.device:
        raise ValueError(
            f"out must match query (shape {tuple(query.shape)}, {query.dtype}, {query.device}); "
            f"got {tuple(out.shape)}, {out.dtype}, {out.device}"
        )
    if out.stride(2) != 1:
        raise ValueError("out must have unit stride over head_dim")


def validate_paged_decode(query, kv_cache, block_tables, seq_lens, scale, out, max_seq_len) -> None:
    """Shapes, dtypes, devices, strides and scalars (no sync)."""
    check_tensor("kv_cache", kv_cache, 5, "[num_blocks, 2, block_size, kv_heads, head_dim]", "float")
    dev = kv_cache.device
    check_tensor("query", query, 3, "[batch, q_heads, head_dim]", "float", dev)
    check_tensor("block_tables", block_tables, 2, "[batch, max_blocks]", "int32", dev)
    check_tensor("seq_lens", seq_lens, 1, "[batch]", "int32", dev)
    if kv_cache.shape[1] != 2:
        raise ValueError(
            f"kv_cache must have shape [num_blocks, 2, block_size, kv_heads, head_dim], got {tuple(kv_cache.shape)}"
        )
    _check_strides(query, kv_cache, block_tables, seq_lens)
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
    _check_out(out, query)


def check_block_ranges(kv_cache, block_tables, seq_lens, max_seq_len) -> None:
    """seq_lens and the block ids they read within range (one device->host transfer)."""
    if seq_lens.numel() == 0:
        return
    num_blocks, _, block_size, _, _ = kv_cache.shape
    max_blocks = block_tables.shape[1]
    capacity = max_blocks * block_size
    lens = seq_lens.long()
    pages = (lens + block_size - 1) // block_size
    used = torch.arange(max_blocks, device=lens.device).unsqueeze(0) < pages.unsqueeze(1)
    bad_block = used & ((block_tables < 0) | (block_tables >= num_blocks))  # unread entries may be padding (-1)
    lo, hi, bad = torch.stack([lens.min(), lens.max(), bad_block.any().long()]).tolist()
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


def check_paged_device(dev: torch.device) -> None:
    """RuntimeError naming the missing switch unless the kernels run on ``dev`` (CUDA compiled, CPU interpreted)."""
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


def check_paged_options(num_splits, config) -> None:
    if num_splits is not None and (not isinstance(num_splits, int) or num_splits < 1):
        raise ValueError(f"num_splits must be None or an int >= 1, got {num_splits!r}")
    if config is not None and not isinstance(config, PagedAttentionConfig):
        raise TypeError(f"config must be a PagedAttentionConfig or None, got {type(config).__name__}")
