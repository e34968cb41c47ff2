"""Philox4x32-10 inside Triton kernels, bit-identical to spec_rl/sampling/philox.py (Salmon et al., SC'11).

The mapping must match the reference: key = (seed lo, seed hi), counter = (token index, uid lo, uid hi, stream),
u = ((x0 >> 8) + 1) * 2**-24 in float32. ``tl.umulhi`` is PTX ``mul.hi.u32`` and uint32 arithmetic wraps, so the
words equal the reference's int64 emulation exactly."""

from __future__ import annotations

import triton
import triton.language as tl

# The constants of spec_rl/sampling/philox.py (the kernels import nothing of spec_rl; tests check they agree), as
# Triton compile-time values.
PHILOX_M0 = tl.constexpr(0xD2511F53)
PHILOX_M1 = tl.constexpr(0xCD9E8D57)
PHILOX_W0 = tl.constexpr(0x9E3779B9)
PHILOX_W1 = tl.constexpr(0xBB67AE85)
U24_SCALE = tl.constexpr(2.0**-24)  # exact in float32: u in [2**-24, 1]
U_FLOOR = tl.constexpr(2.0**-25)  # the Gumbel uniform u = 0 is read as this
STREAM_ACCEPT = tl.constexpr(0)


@triton.jit
def u32_from_i32_tl(word):
    return word.to(tl.int32).to(tl.uint32, bitcast=True)


@triton.jit
def philox_words_tl(k0, k1, c0, c1, c2, c3):
    """Ten Philox4x32 rounds on uint32 values -> the four output words."""
    for _ in tl.static_range(10):
        hi0 = tl.umulhi(c0, PHILOX_M0)
        lo0 = c0 * PHILOX_M0
        hi1 = tl.umulhi(c2, PHILOX_M1)
        lo1 = c2 * PHILOX_M1
        n0 = hi1 ^ c1 ^ k0
        n2 = hi0 ^ c3 ^ k1
        c0 = n0
        c1 = lo1
        c2 = n2
        c3 = lo0
        k0 = k0 + PHILOX_W0
        k1 = k1 + PHILOX_W1
    return c0, c1, c2, c3


@triton.jit
def philox_uniform_tl(k0, k1, token, uid, stream):
    """float32 u in (0, 1], bit-identical to the reference. k0, k1, stream: uint32; token: int32/uint32 (mod
    2**32); uid: int64 (two's complement read as unsigned, as the reference does)."""
    c0 = token.to(tl.uint32, bitcast=True)
    c1 = uid.to(tl.uint32)  # truncation keeps the low word
    c2 = (uid >> 32).to(tl.uint32)  # arithmetic shift then truncate == (uid >> 32) & 0xFFFFFFFF
    c3 = tl.zeros_like(c0) + stream
    x0, _x1, _x2, _x3 = philox_words_tl(k0, k1, c0, c1, c2, c3)
    return ((x0 >> 8) + 1).to(tl.float32) * U24_SCALE
