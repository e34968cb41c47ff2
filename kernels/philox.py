"""Philox4x32-10 inside Triton kernels, bit-identical to :mod:`spec_rl.sampling.philox`.

Contract (spec_rl/sampling/philox.py): key = (seed & 0xFFFFFFFF, seed >> 32), counter =
(token_index, uid lo, uid hi, stream), ten rounds of

    (hi0, lo0) = mulhilo32(M0, c0);  (hi1, lo1) = mulhilo32(M1, c2)
    c = (hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0);  k += (W0, W1)

(Salmon, Moraes, Dror, Shaw, "Parallel random numbers: as easy as 1, 2, 3",
SC'11; constants from Random123's philox.h), then u = ((x0 >> 8) + 1) * 2**-24
as float32. On the GPU ``tl.umulhi`` is the PTX ``mul.hi.u32`` and uint32
multiplication/addition wrap modulo 2**32, so the words equal the
reference's int64 emulation exactly.

Host wrappers (:func:`philox_uniform_triton`, :func:`philox4x32_triton`) exist
for the tests and for anyone who wants the verifier's uniforms on device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import as_i32, seed_words

PHILOX_M0 = tl.constexpr(0xD2511F53)
PHILOX_M1 = tl.constexpr(0xCD9E8D57)
PHILOX_W0 = tl.constexpr(0x9E3779B9)
PHILOX_W1 = tl.constexpr(0xBB67AE85)
# 2**-24 is exact in float32; u = ((x0 >> 8) + 1) * 2**-24 lies in [2**-24, 1].
U24_SCALE = tl.constexpr(5.9604644775390625e-08)
# Streams (the counter's last word), as in spec_rl.sampling.philox: 0 acceptance test, 1 random reuse.
STREAM_ACCEPT = tl.constexpr(0)


@triton.jit
def u32_from_i32_tl(word):
    """Kernel scalar (passed as a signed int32) -> uint32 with the same bits."""
    return word.to(tl.int32).to(tl.uint32, bitcast=True)


@triton.jit
def philox_words_tl(k0, k1, c0, c1, c2, c3):
    """Ten Philox4x32 rounds on uint32 values; returns the four output words."""
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
    """u(seed, uid, token, stream) in (0, 1], float32, bit-identical to spec_rl.sampling.philox.

    k0, k1: uint32 seed words; token: int32/uint32 token index (taken modulo
    2**32); uid: int64 (two's complement reinterpreted as unsigned, as the
    reference does); stream: uint32.
    """
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
    # in: [n, 6] int64 (c0, c1, c2, c3, k0, k1) as uint32 values; out: [n, 4] int64.
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
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
    """In-kernel counterpart of :func:`spec_rl.sampling.philox.philox_uniform` (same broadcasting).

    Args:
        seed: Python int (modulo 2**64). uids: int64 tensor. token_index:
        integer tensor (values taken modulo 2**32). stream: 0 accept, 1 random reuse.

    Returns:
        float32 uniforms with the broadcast shape, on uids' device.
    """
    shape = torch.broadcast_shapes(uids.shape, token_index.shape)
    u = uids.to(torch.int64).expand(shape).contiguous().view(-1)
    t = (token_index.to(torch.int64).to(u.device) & 0xFFFFFFFF).expand(shape).contiguous().view(-1)
    t = torch.where(t >= 2**31, t - 2**32, t).to(torch.int32)
    out = torch.empty(u.numel(), dtype=torch.float32, device=u.device)
    n = u.numel()
    if n:
        block = 256
        k0, k1 = seed_words(seed)
        _philox_uniform_kernel[(triton.cdiv(n, block),)](out, u, t, n, k0, k1, as_i32(int(stream)), BLOCK=block)
    return out.view(shape)


def philox4x32_triton(counter: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """Raw Philox4x32-10 block function: counter [n, 4], key [n, 2] (uint32 values in int64) -> [n, 4] int64."""
    inp = torch.cat([counter.to(torch.int64), key.to(torch.int64)], dim=1).contiguous()
    n = inp.shape[0]
    out = torch.empty(n, 4, dtype=torch.int64, device=inp.device)
    if n:
        _philox_words_kernel[(triton.cdiv(n, 64),)](out, inp, n, BLOCK=64)
    return out
