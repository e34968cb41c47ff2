"""How much memory a cache or a batch may take: one rule for every bound (K/V caches, update micro-batches)."""

from __future__ import annotations

import torch

from .validation import check_int

#: The share of free CUDA memory, and of the memory available on a CPU, that one bound may take by default. On a CPU
#: the same memory also holds the weights, AdamW's moments and the drafts: with a quarter, the decode batches of
#: epoch 2 took SmolLM2-135M's trainer past 8 GB on a 24 GB machine. A K/V cache takes a sixteenth there: its bound
#: is all it adds, while the update's (an eighth) includes the gradients and moments it holds anyway
#: (benchmarks/RESULTS.md "Training memory").
CUDA_FREE_MEMORY_SHARE = 0.4
CPU_AVAILABLE_MEMORY_SHARE = 0.125
CPU_KV_SHARE = 0.0625


def available_bytes(device: torch.device) -> int:
    """Free CUDA memory of ``device``, or the memory available to a new allocation on a CPU."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    import psutil

    return int(psutil.virtual_memory().available)


def memory_budget(
    device: torch.device, nbytes: int | None = None, name: str = "kv_cache_bytes", cpu_share: float = CPU_KV_SHARE
) -> int:
    """``nbytes`` (an integer >= 1, checked as ``name``), or by default 40% of the free CUDA memory, ``cpu_share`` of
    the memory available on a CPU (a sixteenth: a K/V cache). TypeError or ValueError for a bad value."""
    if nbytes is not None:
        return check_int(name, nbytes, low=1)
    share = CUDA_FREE_MEMORY_SHARE if device.type == "cuda" else cpu_share
    return int(share * available_bytes(device))
