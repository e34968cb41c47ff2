"""Paged KV-cache ops. Layer 1: may import util (and spec_rl._C).

The compiled ``spec_rl._C`` ops (csrc/: C++, CUDA; they range-check their indices, and under CUDA-graph capture the
CUDA kernels skip out-of-range rows). Without the extension for a device, :mod:`spec_rl.ops.torch_kv` runs, warned
once.
"""

from __future__ import annotations

import warnings

import torch

from . import torch_kv

_native = None  # None: not tried yet; False: not available; True: loaded
_native_error = ""  # why spec_rl._C did not load (shown in the fallback warning)
_OPS = ("write_kv", "copy_blocks", "gather_kv")


def _register_fakes() -> None:
    """Shape-only ("fake") implementations, so torch.compile / FakeTensor can trace the ops."""

    def _gather_fake(kv_cache, block_tables, lengths, max_len):
        shape = (block_tables.shape[0], kv_cache.shape[3], max_len, kv_cache.shape[4])
        return kv_cache.new_empty(shape), kv_cache.new_empty(shape)

    for name in ("write_kv", "copy_blocks"):
        torch.library.register_fake(f"spec_rl::{name}")(lambda *args, **kwargs: None)
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
    key = {"cuda": "CUDA", "cpu": "CPU"}.get(torch.device(device).type)
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


def write_kv(kv_cache, key, value, slot_mapping, *, max_slot: int | None = None) -> None:
    """Scatter ``key``, ``value`` [T, H, D] into ``kv_cache`` [num_blocks, 2, block_size, H, D] at ``slot_mapping`` [T]
    (block * block_size + offset; negative: skipped). ``max_slot``: the largest slot when the caller knows it, so the
    native op skips its device sync (it never writes out of bounds either way)."""
    write = _impl("write_kv", kv_cache.device)
    write(kv_cache, key.contiguous(), value.contiguous(), slot_mapping.contiguous(), max_slot is None)


def copy_blocks(kv_cache, block_mapping) -> None:
    """kv_cache[dst] = kv_cache[src] per row (src, dst) of ``block_mapping`` [M, 2]."""
    if block_mapping.numel():
        _impl("copy_blocks", kv_cache.device)(kv_cache, block_mapping.long().contiguous())


def gather_kv(kv_cache, block_tables, lengths, max_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Paged -> dense keys and values [B, H, max_len, D] (zeros past lengths[b]) from ``block_tables`` [B, max_blocks]
    and ``lengths`` [B] (tokens); ``max_len`` defaults to max(lengths)."""
    if max_len is None:
        max_len = int(lengths.max()) if lengths.numel() else 0
    gather = _impl("gather_kv", kv_cache.device)
    return tuple(gather(kv_cache, block_tables.int().contiguous(), lengths.long().contiguous(), int(max_len)))
