"""Paged KV-cache ops. Layer 1: may import util (and spec_rl._C).

Validated entry points of the compiled ``spec_rl._C`` ops (csrc/: C++, CUDA). Every index is range-checked here
before native code runs (the native ops check again; under CUDA-graph capture the CUDA
kernels skip out-of-range rows). Without the extension for a device, :mod:`spec_rl.ops.torch_kv` runs, warned once.
"""

from __future__ import annotations

import warnings

import torch

from . import torch_kv

_native = None  # None: not tried yet; False: not available; True: loaded
_native_error = ""  # why spec_rl._C did not load (shown in the fallback warning)
_OPS = ("write_kv", "splice_from_dense", "copy_blocks", "gather_kv")


def _register_fakes() -> None:
    """Shape-only ("fake") implementations, so torch.compile / FakeTensor can trace the ops."""

    def _noop(*args, **kwargs):
        return None

    def _gather_fake(kv_cache, block_tables, lengths, max_len):
        shape = (block_tables.shape[0], kv_cache.shape[3], max_len, kv_cache.shape[4])
        return kv_cache.new_empty(shape), kv_cache.new_empty(shape)

    for name in ("write_kv", "splice_from_dense", "copy_blocks"):
        torch.library.register_fake(f"spec_rl::{name}")(_noop)
    torch.library.register_fake("spec_rl::gather_kv")(_gather_fake)


def native_available(device: torch.device | str | None = None) -> bool:
    """Whether ``spec_rl._C`` loaded and, given ``device``, has kernels for its type (CUDA only if built with CUDA)."""
    global _native, _native_error
    if _native is None:
        try:
            from spec_rl import _C  # noqa: F401  (registers torch.ops.spec_rl.*)

            _native = all(hasattr(torch.ops.spec_rl, name) for name in _OPS)
            if _native:
                _register_fakes()
            else:
                _native_error = "spec_rl._C imported but does not register all of " + ", ".join(_OPS)
        except ImportError as exc:  # not built, or built against another torch (undefined symbol)
            _native = False
            _native_error = str(exc)
    if not _native:
        return False
    if device is None:
        return True
    key = "CUDA" if torch.device(device).type == "cuda" else "CPU" if torch.device(device).type == "cpu" else None
    return key is not None and torch._C._dispatch_has_kernel_for_dispatch_key("spec_rl::write_kv", key)


_warned: set[str] = set()


def _impl(name: str, device: torch.device):
    if native_available(device):
        return getattr(torch.ops.spec_rl, name)
    if device.type not in _warned:
        reason = _native_error or f"it was built without {device.type} kernels"
        warnings.warn(
            f"spec_rl._C is not available for {device.type} ({reason}); paged KV ops run the (slow) pure-torch "
            "reference. Reinstall with `pip install --no-build-isolation .` and a C++ compiler (plus a CUDA "
            "toolkit and a CUDA build of torch for the GPU ops) to build them.",
            RuntimeWarning,
            stacklevel=3,
        )
        _warned.add(device.type)
    return getattr(torch_kv, name)


def _check_cache(kv_cache: torch.Tensor) -> None:
    if not isinstance(kv_cache, torch.Tensor):
        raise TypeError(f"kv_cache must be a torch.Tensor, got {type(kv_cache).__name__}")
    if kv_cache.dim() != 5 or kv_cache.shape[1] != 2:
        raise ValueError(
            f"kv_cache must have shape [num_blocks, 2, block_size, kv_heads, head_dim], got {tuple(kv_cache.shape)}"
        )
    if kv_cache.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"kv_cache dtype must be float32, float16 or bfloat16, got {kv_cache.dtype}")
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be contiguous (allocate it with torch.empty/zeros)")
    if kv_cache.shape[2] == 0:
        raise ValueError("kv_cache block_size (dim 2) must be > 0")


def _check_index(name: str, t: torch.Tensor, device: torch.device, dims: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be int32 or int64, got {t.dtype}")
    if t.dim() != dims:
        raise ValueError(f"{name} must be {dims}-D, got shape {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but kv_cache is on {device}; move it with .to(kv_cache.device)")


def _check_kv(name: str, t: torch.Tensor, kv_cache: torch.Tensor, dims: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != dims:
        raise ValueError(f"{name} must be {dims}-D, got shape {tuple(t.shape)}")
    if t.device != kv_cache.device:
        raise ValueError(f"{name} is on {t.device} but kv_cache is on {kv_cache.device}")
    if t.dtype != kv_cache.dtype:
        raise TypeError(f"{name} dtype {t.dtype} differs from kv_cache dtype {kv_cache.dtype}; cast it first")


def write_kv(
    kv_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    max_slot: int | None = None,
) -> None:
    """Scatter ``key``, ``value`` [T, H, D] into ``kv_cache`` [num_blocks, 2, block_size, H, D] (float32/16, bf16;
    same dtype and device) at ``slot_mapping`` [T] int32/int64 (block * block_size + offset; negative: skipped;
    non-negative slots must be distinct, as in vLLM). ``max_slot``: the largest slot, when known on the host:
    checked instead of the tensor, so no device sync (a wrong value cannot write out of bounds: kernels skip).
    ValueError: shape/device mismatch, a slot >= num_blocks * block_size; TypeError: wrong dtypes."""
    _check_cache(kv_cache)
    _check_kv("key", key, kv_cache, 3)
    _check_kv("value", value, kv_cache, 3)
    _check_index("slot_mapping", slot_mapping, kv_cache.device, 1)
    heads, dim = kv_cache.shape[3], kv_cache.shape[4]
    if key.shape != value.shape or key.shape[1:] != (heads, dim) or key.shape[0] != slot_mapping.shape[0]:
        raise ValueError(
            f"key {tuple(key.shape)} and value {tuple(value.shape)} must both be [T, {heads}, {dim}] "
            f"with T = len(slot_mapping) = {slot_mapping.shape[0]}"
        )
    capacity = kv_cache.shape[0] * kv_cache.shape[2]
    if slot_mapping.numel() == 0:
        return
    top = int(slot_mapping.max()) if max_slot is None else int(max_slot)
    if top >= capacity:
        raise ValueError(f"slot_mapping has slot {top} >= cache capacity {capacity} (num_blocks * block_size)")
    _impl("write_kv", kv_cache.device)(
        kv_cache, key.contiguous(), value.contiguous(), slot_mapping.contiguous(), max_slot is None
    )


def _check_tables(block_tables: torch.Tensor, kv_cache: torch.Tensor, bsz: int) -> None:
    _check_index("block_tables", block_tables, kv_cache.device, 2)
    if block_tables.shape[0] != bsz:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows, expected one per sequence ({bsz})")


def _check_blocks_used(block_tables: torch.Tensor, ends: torch.Tensor, kv_cache: torch.Tensor) -> None:
    """Every block a sequence touches (positions < ends[b]) must be a valid block id."""
    block_size = kv_cache.shape[2]
    needed = (ends + block_size - 1) // block_size
    if needed.numel() and int(needed.max()) > block_tables.shape[1]:
        raise ValueError(
            f"a sequence needs {int(needed.max())} blocks but block_tables has {block_tables.shape[1]} columns"
        )
    cols = torch.arange(block_tables.shape[1], device=block_tables.device)
    used = cols.unsqueeze(0) < needed.unsqueeze(1)
    ids = block_tables[used]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= kv_cache.shape[0]):
        raise ValueError(f"block_tables uses block id out of range [0, {kv_cache.shape[0]})")


def splice_from_dense(
    kv_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    block_tables: torch.Tensor,
    src_starts: torch.Tensor,
    dst_starts: torch.Tensor,
    lengths: torch.Tensor,
) -> None:
    """Copy dense, left-padded K/V [B, H, S, D] (a transformers cache layer) into paged blocks: dense position
    src_starts[b] + j, j < lengths[b], goes to logical position dst_starts[b] + j through ``block_tables[b]`` ([B]
    int32/int64 each). ValueError: a range outside [0, S), a block id out of range, too few table columns."""
    _check_cache(kv_cache)
    _check_kv("key", key, kv_cache, 4)
    _check_kv("value", value, kv_cache, 4)
    bsz, heads, seq, dim = key.shape
    if value.shape != key.shape or (heads, dim) != tuple(kv_cache.shape[3:]):
        raise ValueError(
            f"key {tuple(key.shape)} and value {tuple(value.shape)} must be "
            f"[B, {kv_cache.shape[3]}, S, {kv_cache.shape[4]}]"
        )
    _check_tables(block_tables, kv_cache, bsz)
    for name, t in (("src_starts", src_starts), ("dst_starts", dst_starts), ("lengths", lengths)):
        _check_index(name, t, kv_cache.device, 1)
        if t.shape[0] != bsz:
            raise ValueError(f"{name} must have one entry per sequence ({bsz}), got {t.shape[0]}")
        if t.numel() and int(t.min()) < 0:
            raise ValueError(f"{name} must be >= 0")
    # Compare without adding first: src_starts + lengths could wrap around in int64.
    if bsz and (bool((src_starts > seq).any()) or bool((lengths > seq - src_starts).any())):
        raise ValueError(f"src_starts + lengths exceeds the dense length S={seq}")
    limit = block_tables.shape[1] * kv_cache.shape[2]  # positions the block tables can address
    # Each bounded alone, so the sum below cannot wrap; _check_blocks_used then gives the exact need.
    if bsz and (bool((dst_starts > limit).any()) or bool((lengths > limit).any())):
        raise ValueError(f"dst_starts + lengths exceeds the {limit} positions block_tables can address")
    _check_blocks_used(block_tables, dst_starts + lengths, kv_cache)
    if bsz == 0:
        return
    _impl("splice_from_dense", kv_cache.device)(
        kv_cache,
        key.contiguous(),
        value.contiguous(),
        block_tables.int().contiguous(),
        src_starts.long().contiguous(),
        dst_starts.long().contiguous(),
        lengths.long().contiguous(),
    )


def copy_blocks(kv_cache: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """kv_cache[dst] = kv_cache[src] per row (src, dst) of ``block_mapping`` [M, 2]; ValueError: bad id, dst twice."""
    _check_cache(kv_cache)
    _check_index("block_mapping", block_mapping, kv_cache.device, 2)
    if block_mapping.shape[1] != 2:
        raise ValueError(f"block_mapping must be [M, 2] (src, dst), got {tuple(block_mapping.shape)}")
    if block_mapping.numel() == 0:
        return
    if int(block_mapping.min()) < 0 or int(block_mapping.max()) >= kv_cache.shape[0]:
        raise ValueError(f"block_mapping has a block id out of range [0, {kv_cache.shape[0]})")
    if block_mapping[:, 1].unique().numel() != block_mapping.shape[0]:
        raise ValueError("block_mapping lists a destination block twice")
    _impl("copy_blocks", kv_cache.device)(kv_cache, block_mapping.long().contiguous())


def gather_kv(
    kv_cache: torch.Tensor, block_tables: torch.Tensor, lengths: torch.Tensor, max_len: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Paged -> dense keys and values [B, H, max_len, D] (zeros past lengths[b]) from ``block_tables`` [B, max_blocks]
    and ``lengths`` [B] (tokens); max_len defaults to, and must reach, max(lengths). ValueError for bad ranges."""
    _check_cache(kv_cache)
    _check_tables(block_tables, kv_cache, block_tables.shape[0] if isinstance(block_tables, torch.Tensor) else -1)
    _check_index("lengths", lengths, kv_cache.device, 1)
    if lengths.shape[0] != block_tables.shape[0]:
        raise ValueError(f"lengths has {lengths.shape[0]} entries, block_tables {block_tables.shape[0]} rows")
    if lengths.numel() and int(lengths.min()) < 0:
        raise ValueError("lengths must be >= 0")
    longest = int(lengths.max()) if lengths.numel() else 0
    if max_len is None:
        max_len = longest
    if max_len < longest:
        raise ValueError(f"max_len={max_len} is shorter than the longest sequence ({longest})")
    _check_blocks_used(block_tables, lengths, kv_cache)
    return tuple(
        _impl("gather_kv", kv_cache.device)(
            kv_cache, block_tables.int().contiguous(), lengths.long().contiguous(), int(max_len)
        )
    )
