"""Triton building blocks shared by the verification kernels.

* :func:`philox_uniform_tl` -- the in-kernel Philox4x32-10 uniform, the exact
  contract of :mod:`spec_rl.philox` (key = (seed lo, seed hi), counter =
  (token index, uid lo, uid hi, stream), u = ((x0 >> 8) + 1) * 2**-24).
* :func:`finish_rows` -- the shared epilogue: new log-prob from (max, sum,
  target logit), the lenient acceptance test of SPEC-RL (arXiv 2509.23232,
  Alg. 1: accept iff ``log u <= log l + lp_new - lp_old``), the per-sample
  first rejected index (an int32 atomic min, order-independent hence
  deterministic) and the NaN flag.
* host helpers that turn Python scalars into kernel arguments whose Triton
  type never depends on the value (so one compiled kernel serves every seed).

Numerics (all choices are here so both kernels agree):

* logits stay in raw units; the softmax of ``z = x / T`` is accumulated as
  ``exp2((x - m) * c)`` with ``c = log2(e) / T`` (one multiply per element,
  no per-element division), and the log-prob is formed in float64 as
  ``(x_target - m) / T - log(S)`` -- so the only fp32 rounding is in the
  running sum S (relative error ~1e-7 per term, summed).
* the running maximum starts at ``-FLT_MAX`` instead of ``-inf``, so a row
  or lane that has only seen ``-inf`` logits never evaluates ``-inf - -inf``.
* the acceptance margin is evaluated in float64 in the reference's exact
  order ``(lp_new - lp_old) + log_l`` with ``lp_new`` rounded to float32
  first, as :func:`spec_rl.acceptance.acceptance_test` does; ``log u`` is
  the float64 log (libdevice ``__nv_log`` on the GPU, numpy's in the
  interpreter; both are within 1 ulp of the exact value).
"""

from __future__ import annotations

import struct

import triton
import triton.language as tl

from .philox import philox_uniform_tl

try:  # generic dispatch module (triton >= 3.0); only used on the GPU path
    from triton.language.extra import libdevice as _libdevice
except Exception:  # pragma: no cover - very old triton
    _libdevice = None

# Largest finite float32 (IEEE 754 binary32): initial running maximum.
NEG_FLT_MAX = tl.constexpr(-3.4028234663852886e38)

# Lenience modes (constexpr): finite log l, +inf (accept all), -inf (reject
# all) -- the reference's conventions at the extremes -- and "score only"
# (no decisions: the random-reuse strategy computes n on the host side).
MODE_FINITE = 0
MODE_ACCEPT_ALL = 1
MODE_REJECT_ALL = 2
MODE_SCORE_ONLY = 3


@triton.jit
def u32_from_i32_tl(word):
    """Kernel scalar (passed as a signed int32) -> uint32 with the same bits."""
    return word.to(tl.int32).to(tl.uint32, bitcast=True)


@triton.jit
def f64_from_words_tl(lo, hi):
    """Rebuild a float64 from its IEEE bits passed as two signed int32 words."""
    lo_u = lo.to(tl.int32).to(tl.uint32, bitcast=True).to(tl.int64)
    bits = (hi.to(tl.int32).to(tl.int64) << 32) | lo_u
    return bits.to(tl.float64, bitcast=True)


@triton.jit
def log_f64_tl(x, USE_LIBDEVICE: tl.constexpr):
    """Natural log in float64 (libdevice on the GPU; the interpreter has no externs)."""
    if USE_LIBDEVICE:
        return _libdevice.log(x)
    else:
        return tl.log(x)


@triton.jit
def finish_rows(
    row,
    in_range,
    valid,
    sample,
    token,
    m,
    s,
    tgt,
    lp_out_ptr,
    acc_out_ptr,
    n_ptr,
    flag_ptr,
    old_ptr,
    uids_ptr,
    k0,
    k1,
    log_l,
    temperature,
    MODE: tl.constexpr,
    USE_LIBDEVICE: tl.constexpr,
):
    """Epilogue for a row (scalar) or a block of rows.

    in_range: rows that exist (stores are masked by it); valid: rows that
    are draft tokens (a subset).
    m, s: float32 running max (raw logit units) and sum of exp((x - m) / T);
    tgt: float32 raw logit of the draft token. Writes lp_out[row] (0 where not
    valid), acc_out[row] (int8), lowers n[sample] to the first rejected token
    index, and raises flag[0] when the row's scores contain NaN (or +inf,
    which makes the normaliser NaN).
    """
    bad = valid & ((s != s) | (tgt != tgt))  # noqa: PLR0124 (x != x is the NaN test)
    lp64 = (tgt.to(tl.float64) - m.to(tl.float64)) / temperature - log_f64_tl(s.to(tl.float64), USE_LIBDEVICE)
    # A draft token with a -inf logit has log-prob -inf (also when the whole
    # row is -inf, where the formula gives -inf + inf).
    lp64 = tl.where(tgt == float("-inf"), float("-inf"), lp64)
    lp = lp64.to(tl.float32)
    lp = tl.where(bad, float("nan"), lp)
    tl.store(lp_out_ptr + row, tl.where(valid, lp, 0.0), mask=in_range)
    if MODE != 3:  # MODE_SCORE_ONLY: no decisions here
        sample_safe = tl.where(valid, sample, 0)
        if MODE == 0:
            uid = tl.load(uids_ptr + sample_safe)
            u = philox_uniform_tl(k0, k1, token, uid, 0)  # stream 0 = STREAM_ACCEPT
            old = tl.load(old_ptr + row, mask=valid, other=0.0).to(tl.float64)
            margin = (lp.to(tl.float64) - old) + log_l
            # NaN margins (e.g. -inf - -inf) compare False: rejected, as in the reference.
            accept = log_f64_tl(u.to(tl.float64), USE_LIBDEVICE) <= margin
        elif MODE == 1:
            accept = valid
        else:
            accept = valid & (token < 0)  # all False, with the right shape
        accept = accept & valid & (bad == 0)
        tl.store(acc_out_ptr + row, accept.to(tl.int8), mask=in_range)
        tl.atomic_min(n_ptr + sample_safe, token, mask=valid & (accept == 0), sem="relaxed")
    tl.atomic_max(flag_ptr + sample * 0, 1, mask=bad, sem="relaxed")


# ----------------------------------------------------------------------------
# host-side helpers


def split_u64(value: int) -> tuple[int, int]:
    """(low, high) 32-bit words of ``value`` modulo 2**64 (spec_rl.philox's key/uid split)."""
    v = int(value) % (1 << 64)
    return v & 0xFFFFFFFF, v >> 32


def as_i32(word: int) -> int:
    """uint32 -> the signed int32 with the same bits (a kernel argument typed i32 for every value)."""
    word &= 0xFFFFFFFF
    return word - (1 << 32) if word >= (1 << 31) else word


def f64_words(x: float) -> tuple[int, int]:
    """IEEE-754 bits of a Python float as two signed int32 words (lo, hi)."""
    (bits,) = struct.unpack("<Q", struct.pack("<d", float(x)))
    return as_i32(bits & 0xFFFFFFFF), as_i32(bits >> 32)


def lenience_mode(log_lenience: float) -> int:
    if log_lenience == float("inf"):
        return MODE_ACCEPT_ALL
    if log_lenience == float("-inf"):
        return MODE_REJECT_ALL
    return MODE_FINITE
