"""Constants and host-side helpers shared by every kernel module of spec_rl.kernels.

* :data:`INTERPRET` -- whether the kernels were created by the Triton
  interpreter (``TRITON_INTERPRET=1`` set before this package was imported).
* numeric constants: ``LOG2E``, the initial running maximum ``NEG_FLT_MAX``,
  the score dtypes the kernels take (``FLOAT_DTYPES``).
* the lenience modes of the verification epilogue (``MODE_*``).
* :class:`DraftRows` -- what a verification launch decides on, and helpers
  that turn its Python scalars into kernel arguments whose Triton type never
  depends on the value (so one compiled kernel serves every seed, lenience
  and temperature), and the output buffers of a verification launch.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@triton.jit
def _interpreter_probe():
    pass


# triton.jit returns an InterpretedFunction when TRITON_INTERPRET=1 was set
# before the decoration (triton reads the variable at that point, not later).
INTERPRET = type(_interpreter_probe).__name__ == "InterpretedFunction"

LOG2E = 1.4426950408889634  # log2(e): exp(x) = exp2(x * log2(e))
# Largest finite float32 (IEEE 754 binary32), negated: initial running maximum,
# so a row or tile that has only seen -inf never evaluates -inf - -inf.
NEG_FLT_MAX = tl.constexpr(-3.4028234663852886e38)
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# Lenience modes of the verification epilogue (its MODE constexpr): finite
# log l, +inf (accept all), -inf (reject all) -- the reference's conventions
# at the extremes -- and "score only" (log-probs, no decisions: the
# random-reuse strategy draws n on the host). tl.constexpr so the kernels can
# read them; launches pass the plain int from :func:`epilogue_mode`.
MODE_FINITE = tl.constexpr(0)
MODE_ACCEPT_ALL = tl.constexpr(1)
MODE_REJECT_ALL = tl.constexpr(2)
MODE_SCORE_ONLY = tl.constexpr(3)


def split_u64(value: int) -> tuple[int, int]:
    """(low, high) 32-bit words of ``value`` modulo 2**64 (spec_rl.sampling.philox's key/uid split)."""
    v = int(value) % (1 << 64)
    return v & 0xFFFFFFFF, v >> 32


def as_i32(word: int) -> int:
    """uint32 -> the signed int32 with the same bits (a kernel argument typed i32 for every value)."""
    word &= 0xFFFFFFFF
    return word - (1 << 32) if word >= (1 << 31) else word


def seed_words(seed: int) -> tuple[int, int]:
    """The Philox key (seed lo, seed hi) as two signed int32 kernel arguments."""
    lo, hi = split_u64(seed)
    return as_i32(lo), as_i32(hi)


def f64_words(x: float) -> tuple[int, int]:
    """IEEE-754 bits of a Python float as two signed int32 words (lo, hi)."""
    (bits,) = struct.unpack("<Q", struct.pack("<d", float(x)))
    return as_i32(bits & 0xFFFFFFFF), as_i32(bits >> 32)


def epilogue_mode(log_lenience: float, score_only: bool = False) -> int:
    """The MODE of a verification launch: score only, or the lenience mode of ``log_lenience``."""
    if score_only:
        mode = MODE_SCORE_ONLY
    elif log_lenience == float("inf"):
        mode = MODE_ACCEPT_ALL
    elif log_lenience == float("-inf"):
        mode = MODE_REJECT_ALL
    else:
        mode = MODE_FINITE
    return mode.value


@dataclass
class DraftRows:
    """The draft tokens of one verification launch, one per scored row, and the test's settings.

    Attributes:
        ids: [n_rows] integer draft token ids (padded layout: [B * R], row-major).
        old: [n_rows] float stored log-probs of those tokens.
        lengths: [B] int64 draft lengths (tokens); uids: [B] int64 sample ids.
        row_sample, row_token: [n_rows] int32 sample index (-1: padding row)
            and token index of each row; None in the padded layout, where
            row r is token r % R of sample r // R.
        seed: 64-bit seed; log_lenience: log(l); temperature: T > 0.
        mode: the epilogue's MODE (:func:`epilogue_mode`).
    """

    ids: torch.Tensor
    old: torch.Tensor
    lengths: torch.Tensor
    uids: torch.Tensor
    row_sample: torch.Tensor | None
    row_token: torch.Tensor | None
    seed: int
    log_lenience: float
    temperature: float
    mode: int

    def tensors(self) -> list[torch.Tensor]:
        """The tensors of the launch (for device checks)."""
        ts = (self.ids, self.old, self.lengths, self.uids, self.row_sample, self.row_token)
        return [t for t in ts if t is not None]

    def scalars(self) -> tuple:
        """Scalar kernel arguments (k0, k1, log_l lo, log_l hi, T lo, T hi, c) with c = log2(e) / T.

        float64 values travel as int32 word pairs (rebuilt in the kernel); an
        infinite log l is passed as 0 (the mode carries it).
        """
        k0, k1 = seed_words(self.seed)
        ll = self.log_lenience if math.isfinite(self.log_lenience) else 0.0
        l_lo, l_hi = f64_words(ll)
        t_lo, t_hi = f64_words(float(self.temperature))
        return k0, k1, l_lo, l_hi, t_lo, t_hi, LOG2E / float(self.temperature)

    def buffers(self, n_rows: int, device: torch.device):
        """Outputs of the launch over ``n_rows`` rows.

        Returns (log-probs [n_rows] float32, accept [n_rows] int8, rejection
        index [B] int32 initialised to the draft lengths and lowered by the
        kernel, NaN flag [1] int32).
        """
        lp = torch.empty(n_rows, dtype=torch.float32, device=device)
        acc = torch.empty(n_rows, dtype=torch.int8, device=device)
        n = self.lengths.to(device=device, dtype=torch.int32).clone()
        flag = torch.zeros(1, dtype=torch.int32, device=device)
        return lp, acc, n, flag
