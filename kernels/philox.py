"""Philox4x32-10 inside Triton kernels, bit-identical to spec_rl/sampling/philox.py (Salmon et al., SC'11).

The mapping must match the reference: key = (seed lo, seed hi), counter = (token index, uid lo, uid hi, stream),
u = ((x0 >> 8) + 1) * 2**-24 in float32. ``tl.umulhi`` is PTX ``mul.hi.u32`` and uint32 arithmetic wraps, so the
words equal the reference's int64 emulation exactly."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..sampling import philox as reference
from ._common import as_i32, seed_words

# The reference's constants (spec_rl/sampling/philox.py), as Triton compile-time values.
PHILOX_M0 = tl.constexpr(reference.PHILOX_M0)
PHILOX_M1 = tl.constexpr(reference.PHILOX_M1)
PHILOX_W0 = tl.constexpr(reference.PHILOX_W0)
PHILOX_W1 = tl.constexpr(reference.PHILOX_W1)
U24_SCALE = tl.constexpr(reference.U24_SCALE)  # 2**-24, exact in float32: u in [2**-24, 1]
STREAM_ACCEPT = tl.constexpr(reference.STREAM_ACCEPT)


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


@triton.jit(do_not_specialize=["k0_w", "k1_w", "stream_w"])
def _philox_uniform_kernel(out_ptr, uids_ptr, tokens_ptr, n, k0_w, k1_w, stream_w, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    uid = tl.load(uids_ptr + offs, mask=ok, other=0)
    tok = tl.load(tokens_ptr + offs, mask=ok, other=0).to(tl.int32)
    k0 = u32_from_i32_tl(k0_w)
    k1 = u32_from_i32_tl(k1_w)
    stream = u32_from_i32_tl(stream_w)
    tl.store(out_ptr + offs, philox_uniform_tl(k0, k1, tok, uid, stream), mask=ok)


@triton.jit
def _philox_words_kernel(out_ptr, in_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # in: [n, 6] (c0..c3, k0, k1) uint32 in int64; out: [n, 4]
    ok = offs < n
    c0 = tl.load(in_ptr + offs * 6 + 0, mask=ok, other=0).to(tl.uint32)
    c1 = tl.load(in_ptr + offs * 6 + 1, mask=ok, other=0).to(tl.uint32)
    c2 = tl.load(in_ptr + offs * 6 + 2, mask=ok, other=0).to(tl.uint32)
    c3 = tl.load(in_ptr + offs * 6 + 3, mask=ok, other=0).to(tl.uint32)
    k0 = tl.load(in_ptr + offs * 6 + 4, mask=ok, other=0).to(tl.uint32)
    k1 = tl.load(in_ptr + offs * 6 + 5, mask=ok, other=0).to(tl.uint32)
    x0, x1, x2, x3 = philox_words_tl(k0, k1, c0, c1, c2, c3)
    tl.store(out_ptr + offs * 4 + 0, x0.to(tl.int64), mask=ok)
    tl.store(out_ptr + offs * 4 + 1, x1.to(tl.int64), mask=ok)
    tl.store(out_ptr + offs * 4 + 2, x2.to(tl.int64), mask=ok)
    tl.store(out_ptr + offs * 4 + 3, x3.to(tl.int64), mask=ok)


def philox_uniform_triton(seed: int, uids: torch.Tensor, token_index: torch.Tensor, stream: int = 0) -> torch.Tensor:
    """Kernel twin of :func:`spec_rl.sampling.philox.philox_uniform`: float32 uniforms of the broadcast shape on
    uids' device. seed: int (mod 2**64); uids: int64; token_index: integer (mod 2**32); stream: 0 accept, 1 reuse."""
    shape = torch.broadcast_shapes(uids.shape, token_index.shape)
    u = uids.to(torch.int64).expand(shape).contiguous().view(-1)
    t = (token_index.to(torch.int64).to(u.device) & 0xFFFFFFFF).expand(shape).contiguous().view(-1)
    t = torch.where(t >= 2**31, t - 2**32, t).to(torch.int32)
    n = u.numel()
    out = torch.empty(n, dtype=torch.float32, device=u.device)
    if n:
        _philox_uniform_kernel[(triton.cdiv(n, 256),)](out, u, t, n, *seed_words(seed), as_i32(int(stream)), BLOCK=256)
    return out.view(shape)


def philox4x32_triton(counter: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """Raw Philox4x32-10 block function: counter [n, 4], key [n, 2] (uint32 values in int64) -> [n, 4] int64."""
    inp = torch.cat([counter.to(torch.int64), key.to(torch.int64)], dim=1).contiguous()
    n = inp.shape[0]
    out = torch.empty(n, 4, dtype=torch.int64, device=inp.device)
    if n:
        _philox_words_kernel[(triton.cdiv(n, 64),)](out, inp, n, BLOCK=64)
    return out
