"""Counter-based uniforms (Philox4x32-10) keyed by (seed, uid, token_index, stream): no decision depends on batch
order, padding or backend (docs/design.md "Randomness"). Exact mapping (kernels must reproduce it bit for bit):

* key = (seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF); counter = (token_index, uid & 0xFFFFFFFF,
  (uid >> 32) & 0xFFFFFFFF, stream); seed and uid modulo 2**64 (negative as unsigned), the rest modulo 2**32.
* 10 rounds of Philox4x32 (Salmon et al., SC'11; M0=0xD2511F53, M1=0xCD9E8D57, W0=0x9E3779B9, W1=0xBB67AE85), key
  bumped after every round: the generator of ``triton.language.randint`` (which uses counter (offset, 0, 0, 0)).
* the first output word x0 becomes ``u = ((x0 >> 8) + 1) * 2**-24`` in float32: 2**24 exact values in [2**-24, 1],
  so ``log(u)`` is finite and u == 1 is possible.

Streams: 0 per-token acceptance, 1 random reuse (one per sample), 2 keyed sampling (indexed by absolute position:
the words seed the generator of the row's per-token noise, :func:`philox_keys`).
"""

from __future__ import annotations

import torch

PHILOX_M0 = 0xD2511F53
PHILOX_M1 = 0xCD9E8D57
PHILOX_W0 = 0x9E3779B9
PHILOX_W1 = 0xBB67AE85
PHILOX_ROUNDS = 10

STREAM_ACCEPT = 0
STREAM_RANDOM_REUSE = 1
STREAM_SAMPLE = 2

#: Seed salts, XORed into a seed so that each use draws its own keys, in one place: the sampled tokens of a step
#: (apart from its acceptance uniforms), the held-out evaluation (apart from training), a server's continuation
#: attempts after a rejection (apart from the acceptance uniforms).
SEED_SALT_CONTINUATION = 0x5EED
SEED_SALT_HELDOUT = 0x4E1D_0E7A
SEED_SALT_RESIDUAL = 0x7E51D0A1

_MASK32 = 0xFFFFFFFF
U24_SCALE = 2.0**-24
#: The smallest uniform behind a Gumbel noise (keyed sampling): u = 0 is read as half a step, so no token's noise
#: -log(-log u) is -inf and a distribution with one token of all the mass always returns it.
U_FLOOR = 2.0**-25


def _mulhilo32(a: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32-bit words of ``a * m`` (uint32 in int64), formed from 16-bit halves so nothing overflows."""
    a_hi = a >> 16
    a_lo = a & 0xFFFF
    s = a_hi * m  # < 2**48
    t = a_lo * m  # < 2**48
    hi = (s + (t >> 16)) >> 16
    lo = (((s & 0xFFFF) << 16) + t) & _MASK32
    return hi, lo


def philox4x32(
    counter: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    key: tuple[torch.Tensor, torch.Tensor],
    rounds: int = PHILOX_ROUNDS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Philox4x32 block function on broadcastable int64 tensors of uint32 values: 4 counter, 2 key -> 4 words."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for _ in range(rounds):
        hi0, lo0 = _mulhilo32(c0, PHILOX_M0)
        hi1, lo1 = _mulhilo32(c2, PHILOX_M1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = (k0 + PHILOX_W0) & _MASK32
        k1 = (k1 + PHILOX_W1) & _MASK32
    return c0, c1, c2, c3


def _as_u64_words(value: int | torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(value, torch.Tensor):
        assert value.dtype in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8), value.dtype
        v = value.to(device=device, dtype=torch.int64)
        return v & _MASK32, (v >> 32) & _MASK32  # arithmetic shift then mask: two's complement reinterpretation
    v = int(value) % (1 << 64)
    return _constant(v & _MASK32, device), _constant(v >> 32, device)


def _constant(value: int, device: torch.device) -> torch.Tensor:
    """A 0-d int64 tensor filled on ``device``: no copy from host memory, so a CUDA graph can capture it (a tensor
    made from a Python value is copied from the host, which capture refuses)."""
    return torch.full((), value, dtype=torch.int64, device=device)


def bits_to_uniform(x0: torch.Tensor) -> torch.Tensor:
    """uint32 words (int64 storage) to float32 uniforms ``((x0 >> 8) + 1) * 2**-24`` in (0, 1], exact."""
    return ((x0 >> 8) + 1).to(torch.float32) * U24_SCALE


def _words(seed: int, uids: torch.Tensor, token_index: torch.Tensor, stream: int) -> tuple[torch.Tensor, ...]:
    """The four Philox output words of counter (token_index, uid, stream) under key ``seed``, broadcast."""
    device = uids.device
    k0, k1 = _as_u64_words(seed, device)
    u_lo, u_hi = _as_u64_words(uids, device)
    idx = token_index.to(device=device, dtype=torch.int64) & _MASK32
    c3 = _constant(int(stream) & _MASK32, device)
    shape = torch.broadcast_shapes(u_lo.shape, idx.shape)
    return philox4x32((idx.expand(shape), u_lo.expand(shape), u_hi.expand(shape), c3.expand(shape)), (k0, k1))


def philox_keys(seed: int, uids: torch.Tensor, token_index: torch.Tensor, stream: int) -> torch.Tensor:
    """Keyed 63-bit seeds ``(x1 << 32 | x0) & (2**63 - 1)`` int64, one per (uid, token_index): the seed of the
    generator that draws a sampled row's per-token noise (:func:`spec_rl.sampling.distribution.keyed_sample`)."""
    x0, x1, _, _ = _words(seed, uids, token_index, stream)
    return ((x1 & 0x7FFFFFFF) << 32) | x0


def philox_uniform(
    seed: int, uids: torch.Tensor, token_index: torch.Tensor, stream: int = STREAM_ACCEPT
) -> torch.Tensor:
    """Keyed float32 uniforms u(seed, uid, token_index, stream) in (0, 1], on ``uids``' device. seed: Python int, taken
    modulo 2**64; uids: int64 per-sample ids, e.g. [B, 1]; token_index: int64 0-based token positions broadcastable
    against them, e.g. [1, R]. The result has their broadcast shape (internal: callers pass integer tensors)."""
    x0, _, _, _ = _words(seed, uids, token_index, stream)
    return bits_to_uniform(x0)


def mix_seed(seed: int, step: int) -> int:
    """Per-step 64-bit seed from a run seed (SplitMix64 finaliser): independent steps, a pure function of both."""
    z = (int(seed) + 0x9E3779B97F4A7C15 * (int(step) + 1)) % (1 << 64)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % (1 << 64)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % (1 << 64)
    return z ^ (z >> 31)
