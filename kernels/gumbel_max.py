"""Keyed Gumbel-max sampling on CUDA: one read of the race scores, the noise drawn in registers, no generator state,
so a CUDA graph can hold it (the paged engine's static decode step, docs/design.md "Randomness").

Row r's noise at token t is -log(-log u) with u = (x0 >> 8) * 2**-24 in [0, 1), x0 the first Philox4x32-10 word of
counter (t, 0, 0, 0) under key (keys[r] low word, high word), u = 0 read as 2**-25 (no noise is -inf, so a token of
probability 0 never wins), as the torch reference :func:`spec_rl.sampling.distribution.philox_gumbel_argmax` does bit
for bit."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import FLOAT_DTYPES, unit_stride
from .philox import U24_SCALE, U_FLOOR, philox_words_tl


@triton.jit
def gumbel_argmax_kernel(race_ptr, keys_ptr, out_ptr, vocab, stride_row, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    key = tl.load(keys_ptr + row)
    k0 = key.to(tl.uint32)  # truncation keeps the low word
    k1 = (key >> 32).to(tl.uint32)
    zero = tl.zeros([BLOCK], dtype=tl.uint32)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_idx = tl.zeros([BLOCK], dtype=tl.int32)
    base = race_ptr + row.to(tl.int64) * stride_row
    for start in range(0, vocab, BLOCK):
        t = start + tl.arange(0, BLOCK)
        inside = t < vocab
        x = tl.load(base + t, mask=inside, other=float("-inf")).to(tl.float32)
        x0, _x1, _x2, _x3 = philox_words_tl(k0, k1, t.to(tl.uint32), zero, zero, zero)
        u = tl.maximum((x0 >> 8).to(tl.float32) * U24_SCALE, U_FLOOR)
        score = x - tl.log(-tl.log(u))
        score = tl.where(inside, score, float("-inf"))
        better = score > best  # strict: each lane keeps its first maximum, as torch.argmax does
        best = tl.where(better, score, best)
        best_idx = tl.where(better, t, best_idx)
    top = tl.max(best, 0)
    idx = tl.min(tl.where(best == top, best_idx, vocab), 0)
    tl.store(out_ptr + row, tl.minimum(idx, vocab - 1).to(tl.int64))


def gumbel_argmax(race: torch.Tensor, keys: torch.Tensor, block: int | None = None) -> torch.Tensor:
    """Token ids [N] int64: argmax over tokens of ``race`` [N, V] (float, e.g. sampling log-probs) + keyed Gumbel
    noise, the noise of row r keyed by ``keys`` [N] int64 (the engine's trusted inputs: no checks, no host sync)."""
    out = torch.empty(race.shape[0], dtype=torch.int64, device=race.device)
    if race.shape[0] == 0:
        return out
    assert race.dtype in FLOAT_DTYPES and race.dim() == 2, (race.dtype, race.shape)
    race = unit_stride(race)
    vocab = race.shape[1]
    block = block or min(4096, triton.next_power_of_2(max(vocab, 16)))
    gumbel_argmax_kernel[(race.shape[0],)](
        race, keys.contiguous(), out, vocab, race.stride(0), BLOCK=block, num_warps=8 if block >= 2048 else 4
    )
    return out
