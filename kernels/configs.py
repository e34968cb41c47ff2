"""Tile sizes for the verification kernels, chosen by a deterministic rule.

Why not ``triton.autotune``: autotuning picks the fastest config by timing,
which can differ between processes; a different BLOCK_V / BLOCK_N changes
the floating-point summation order of the normaliser, hence the last bits of
the log-probs, and a borderline accept/reject decision could flip between
two runs on the same inputs (DESIGN.md: "Borderline accept/reject decisions
must not flip between runs"). So the config is a pure function of
(device capability, dtype, shapes), and ``benchmarks/gpu_suite.py --sweep``
times the candidates below so the defaults can be pinned from measurements.

Reasoning for the H100/H200 defaults (not yet measured on the device):

* from-logits (memory-bound, 1 exp per element): BLOCK_V=2048 over 8 warps
  = 8 elements per thread per tile (one 16-byte load for bf16/fp16, two for
  fp32; HOPPER.md: "16-byte accesses per thread"). The kernel prefetches the
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


def _next_pow2(x: int) -> int:
    return 1 << max(0, int(x - 1).bit_length())


def default_logits_config(vocab: int, dtype: torch.dtype, interpret: bool) -> LogitsConfig:
    """Deterministic from-logits config (see module docstring)."""
    if interpret:
        # The interpreter runs one numpy op per Triton op: big 2-D tiles are fastest.
        block_v = max(16, min(1024, _next_pow2(vocab)))
        return LogitsConfig(block_v=block_v, num_warps=4, block_r=max(1, min(64, 8192 // block_v)))
    per_thread = 8
    tile = 2048
    block_v = max(16, min(tile, _next_pow2(vocab)))
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
