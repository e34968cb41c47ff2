"""In-kernel Philox4x32-10 uniforms: bit-identical to spec_rl.sampling.philox."""

from __future__ import annotations

import pytest
import torch
from _kernel_helpers import (  # first: skips this module when triton is missing
    DEVICE,
    philox4x32_triton,
    philox_uniform_triton,
    triton,
)

from spec_rl.sampling.philox import STREAM_ACCEPT, STREAM_RANDOM_REUSE, philox4x32, philox_uniform

# Known-answer vectors of Philox4x32-10 from Random123 (kat_vectors, "philox4x32 10"):
# counter (c0..c3), key (k0, k1) -> output (x0..x3).
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    (
        (0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF),
        (0xFFFFFFFF, 0xFFFFFFFF),
        (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD),
    ),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


def test_known_answer_vectors_kernel_and_reference():
    counter = torch.tensor([c for c, _, _ in KAT], dtype=torch.int64)
    key = torch.tensor([k for _, k, _ in KAT], dtype=torch.int64)
    expected = torch.tensor([x for _, _, x in KAT], dtype=torch.int64)
    got = philox4x32_triton(counter.to(DEVICE), key.to(DEVICE)).cpu()
    assert torch.equal(got, expected)
    ref = torch.stack(philox4x32(tuple(counter.T), tuple(key.T)), dim=1)
    assert torch.equal(ref, expected)


@pytest.mark.parametrize(
    "seed", [0, 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**63 + 12345, 2**64 - 1, -1, -(2**40)]
)
def test_uniforms_bit_identical_to_reference(seed):
    gen = torch.Generator().manual_seed(seed % 1000)
    uids = torch.randint(-(2**63), 2**63 - 1, (64,), generator=gen, dtype=torch.int64)
    uids[:6] = torch.tensor([0, 1, -1, 2**63 - 1, -(2**63), 2**32])
    tokens = torch.randint(0, 2**31 - 1, (64,), generator=gen)
    tokens[:4] = torch.tensor([0, 1, 2**31 - 1, 4095])
    for stream in (STREAM_ACCEPT, STREAM_RANDOM_REUSE):
        ref = philox_uniform(seed, uids, tokens, stream=stream)
        got = philox_uniform_triton(seed, uids.to(DEVICE), tokens.to(DEVICE), stream=stream).cpu()
        assert got.dtype == torch.float32
        assert torch.equal(got, ref)
        assert bool(((got > 0) & (got <= 1)).all())


def test_uniforms_broadcast_like_reference():
    uids = torch.tensor([[3], [-7], [2**62]])
    idx = torch.arange(300).unsqueeze(0)
    ref = philox_uniform(2**63 + 99, uids, idx)
    got = philox_uniform_triton(2**63 + 99, uids.to(DEVICE), idx.to(DEVICE)).cpu()
    assert got.shape == (3, 300)
    assert torch.equal(got, ref)


tl = triton.language


@triton.jit
def _tl_randint_kernel(out_ptr, seed, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tl.randint(seed, offs).to(tl.int64, bitcast=False), mask=offs < n)


def test_matches_triton_randint_on_its_counter():
    """tl.randint(seed, offset) is Philox4x32-10 with counter (offset, 0, 0, 0), key (seed lo, seed hi).

    Our uniform with uid = 0, stream = 0 uses the same counter, so its bits
    (x0 >> 8) must match randint's first word (triton/language/random.py).
    """
    seed = 123456789
    n = 64
    out = torch.empty(n, dtype=torch.int64, device=DEVICE)
    _tl_randint_kernel[(1,)](out, seed, n, BLOCK=64)
    x0 = out.cpu() & 0xFFFFFFFF  # int32 -> uint32 bits
    u_from_randint = ((x0 >> 8) + 1).float() * 2.0**-24
    ours = philox_uniform_triton(seed, torch.zeros(n, dtype=torch.int64, device=DEVICE), torch.arange(n, device=DEVICE))
    assert torch.equal(ours.cpu(), u_from_randint)


def test_the_kernels_constants_are_the_references():
    # kernels/ imports nothing of spec_rl: it keeps its own copy of the generator's constants
    import spec_rl.kernels.philox as device
    import spec_rl.sampling.philox as reference

    for name in ("PHILOX_M0", "PHILOX_M1", "PHILOX_W0", "PHILOX_W1", "U24_SCALE", "U_FLOOR", "STREAM_ACCEPT"):
        assert getattr(device, name).value == getattr(reference, name), name
