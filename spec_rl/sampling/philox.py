"""Counter-based uniforms for the acceptance test (Philox4x32-10).

Every accept/reject decision of SPEC-RL draws one uniform u_i per draft token
(docs/design.md, "Randomness"). The uniform is a pure function of
``(seed, uid, token_index, stream)``, so a decision never depends on batch
order, padding, or which backend (torch reference, Triton kernel) ran it.

Exact mapping (the contract a kernel must reproduce bit for bit):

* key     = (seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF)          [k0, k1]
* counter = (token_index, uid & 0xFFFFFFFF, (uid >> 32) & 0xFFFFFFFF,
             stream)                                                  [c0..c3]
* 10 rounds of Philox4x32 (Salmon et al., SC'11; the Random123 constants
  M0=0xD2511F53, M1=0xCD9E8D57, W0=0x9E3779B9, W1=0xBB67AE85), key bumped
  after every round. This is the same generator as ``triton.language.randint``
  (which uses counter (offset, 0, 0, 0)).
* the first output word x0 becomes ``u = ((x0 >> 8) + 1) * 2**-24`` as a
  float32: 2**24 equally spaced values in [2**-24, 1], all exactly
  representable, so ``log(u)`` is finite and u == 1 is possible (the
  interval is (0, 1]).

``seed`` and ``uid`` are taken modulo 2**64 (negative Python ints are
reinterpreted as unsigned); ``token_index`` and ``stream`` modulo 2**32.

Streams: :data:`STREAM_ACCEPT` (0) keys the per-token acceptance uniforms;
:data:`STREAM_RANDOM_REUSE` (1) keys the one uniform per sample used by the
random-reuse ablation; :data:`STREAM_SAMPLE` (2) keys the inverse-CDF sampling of generated tokens
(:func:`spec_rl.sampling.distribution.keyed_sample`), indexed by absolute position in the sequence.
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

#: XORed into a step's seed to seed the continuation's sampler, so the decode
#: loop draws from a different generator state than the token at n.
SEED_SALT_CONTINUATION = 0x5EED

_MASK32 = 0xFFFFFFFF
_U24_SCALE = 2.0**-24


def _mulhilo32(a: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32-bit words of ``a * m`` for uint32 values held in int64.

    ``a * m`` can reach 2**64 and overflow int64, so the product is formed
    from 16-bit halves of ``a``: both partial products stay below 2**48.
    """
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
    """Philox4x32 block function on int64 tensors holding uint32 values.

    Args:
        counter: four broadcastable int64 tensors with values in [0, 2**32).
        key: two broadcastable int64 tensors with values in [0, 2**32).
        rounds: number of rounds (10 is the standard, used everywhere here).

    Returns:
        The four output words as int64 tensors with values in [0, 2**32).
    """
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
    """Split a Python int or an int64 tensor into (low, high) uint32 words."""
    if isinstance(value, torch.Tensor):
        if value.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
            raise TypeError(f"expected an integer tensor, got dtype {value.dtype}")
        v = value.to(device=device, dtype=torch.int64)
        lo = v & _MASK32
        hi = (v >> 32) & _MASK32  # arithmetic shift then mask == two's complement reinterpretation
        return lo, hi
    v = int(value) % (1 << 64)
    return (
        torch.tensor(v & _MASK32, dtype=torch.int64, device=device),
        torch.tensor(v >> 32, dtype=torch.int64, device=device),
    )


def bits_to_uniform(x0: torch.Tensor) -> torch.Tensor:
    """Map uint32 words (int64 storage) to float32 uniforms in (0, 1].

    ``u = ((x0 >> 8) + 1) * 2**-24``; exact in float32.
    """
    return ((x0 >> 8) + 1).to(torch.float32) * _U24_SCALE


def philox_uniform(
    seed: int, uids: torch.Tensor, token_index: torch.Tensor, stream: int = STREAM_ACCEPT
) -> torch.Tensor:
    """Keyed uniforms u(seed, uid, token_index, stream) in (0, 1], float32.

    Args:
        seed: run/step seed (Python int, taken modulo 2**64).
        uids: int64 tensor of per-sample ids, broadcastable against
            ``token_index`` (e.g. shape [B, 1]).
        token_index: int64 tensor of 0-based token positions in the response
            (e.g. shape [1, R]).
        stream: which independent stream to draw from.

    Returns:
        float32 tensor with the broadcast shape of ``uids`` and
        ``token_index``, on ``uids``' device.
    """
    device = uids.device
    k0, k1 = _as_u64_words(seed, device)
    u_lo, u_hi = _as_u64_words(uids, device)
    idx = token_index.to(device=device, dtype=torch.int64) & _MASK32
    c3 = torch.tensor(int(stream) & _MASK32, dtype=torch.int64, device=device)
    shape = torch.broadcast_shapes(u_lo.shape, idx.shape)
    c0 = idx.expand(shape)
    x0, _, _, _ = philox4x32((c0, u_lo.expand(shape), u_hi.expand(shape), c3.expand(shape)), (k0, k1))
    return bits_to_uniform(x0)


def mix_seed(seed: int, step: int) -> int:
    """Derive a per-step 64-bit seed from a run seed (SplitMix64 finaliser).

    Keeps uniforms of different training steps independent while staying a
    pure function of (seed, step).
    """
    z = (int(seed) + 0x9E3779B97F4A7C15 * (int(step) + 1)) % (1 << 64)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % (1 << 64)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % (1 << 64)
    return z ^ (z >> 31)
