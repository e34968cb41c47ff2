"""The verification epilogue shared by the from-logits and the fused LM-head kernels.

:func:`finish_rows` turns a row's softmax statistics into the outputs: the
new log-prob from (max, sum, target logit), the lenient acceptance test of
SPEC-RL (paper Sec. 3, Eq. 4, Alg. 1; docs/design.md "The rule": accept iff
``log u <= log l + lp_new - lp_old``) with the in-kernel Philox uniform of
:mod:`.philox`, the per-sample first rejected index (an int32 atomic min,
order-independent hence deterministic) and the NaN flag.

Numerics (all choices are here so both kernels agree):

* logits stay in raw units; the softmax of ``z = x / T`` is accumulated as
  ``exp2((x - m) * c)`` with ``c = log2(e) / T`` (one multiply per element,
  no per-element division), and the log-prob is formed in float64 as
  ``(x_target - m) / T - log(S)`` -- so the only fp32 rounding is in the
  running sum S (relative error ~1e-7 per term, summed).
* the running maximum starts at ``-FLT_MAX`` instead of ``-inf``, so a row
  or lane that has only seen ``-inf`` logits never evaluates ``-inf - -inf``;
  a row whose logits are all ``-inf`` ends with sum 0 and is flagged.
* the acceptance margin is evaluated in float64 in the reference's exact
  order ``(lp_new - lp_old) + log_l`` with ``lp_new`` rounded to float32
  first, as :func:`spec_rl.acceptance.reference.acceptance_test` does; ``log u`` is
  the float64 log (libdevice ``__nv_log`` on the GPU, numpy's in the
  interpreter; both are within 1 ulp of the exact value).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._common import MODE_ACCEPT_ALL, MODE_FINITE, MODE_SCORE_ONLY
from .philox import STREAM_ACCEPT, philox_uniform_tl, u32_from_i32_tl

try:  # generic dispatch module (triton >= 3.0); only used on the GPU path
    from triton.language.extra import libdevice as _libdevice
except Exception:  # pragma: no cover - very old triton
    _libdevice = None


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
    k0_w,
    k1_w,
    log_l_lo,
    log_l_hi,
    temp_lo,
    temp_hi,
    MODE: tl.constexpr,
    USE_LIBDEVICE: tl.constexpr,
):
    """Epilogue for a row (scalar) or a block of rows.

    in_range: rows that exist (stores are masked by it); valid: rows that
    are draft tokens (a subset).
    m, s: float32 running max (raw logit units) and sum of exp((x - m) / T);
    tgt: float32 raw logit of the draft token. Writes lp_out[row] (0 where not
    valid), acc_out[row] (int8; not written in MODE_SCORE_ONLY), lowers
    n[sample] to the first rejected token index, and raises flag[0] (and writes a
    NaN log-prob) when the row has no valid distribution: its scores contain NaN
    (or +inf, which makes the normaliser NaN), or every logit is -inf (s == 0).
    k0_w, k1_w: the Philox key; (log_l_lo, log_l_hi), (temp_lo, temp_hi): log l
    and T as float64 bits in int32 words (the kernel scalars of
    :meth:`~._common.DraftRows.scalars`).
    """
    log_l = f64_from_words_tl(log_l_lo, log_l_hi)
    temperature = f64_from_words_tl(temp_lo, temp_hi)
    # No valid distribution: NaN somewhere (a +inf logit makes the normaliser NaN too), or s == 0,
    # i.e. every logit of the row is -inf (the running max never left -FLT_MAX).
    bad = valid & ((s != s) | (tgt != tgt) | (s == 0.0))  # noqa: PLR0124 (x != x is the NaN test)
    lp64 = (tgt.to(tl.float64) - m.to(tl.float64)) / temperature - log_f64_tl(s.to(tl.float64), USE_LIBDEVICE)
    # A draft token with a -inf logit has log-prob -inf (also when the whole
    # row is -inf, where the formula gives -inf + inf).
    lp64 = tl.where(tgt == float("-inf"), float("-inf"), lp64)
    lp = lp64.to(tl.float32)
    lp = tl.where(bad, float("nan"), lp)
    tl.store(lp_out_ptr + row, tl.where(valid, lp, 0.0), mask=in_range)
    if MODE != MODE_SCORE_ONLY:
        sample_safe = tl.where(valid, sample, 0)
        if MODE == MODE_FINITE:
            uid = tl.load(uids_ptr + sample_safe)
            u = philox_uniform_tl(u32_from_i32_tl(k0_w), u32_from_i32_tl(k1_w), token, uid, STREAM_ACCEPT)
            old = tl.load(old_ptr + row, mask=valid, other=0.0).to(tl.float64)
            margin = (lp.to(tl.float64) - old) + log_l
            # NaN margins (e.g. -inf - -inf) compare False: rejected, as in the reference.
            accept = log_f64_tl(u.to(tl.float64), USE_LIBDEVICE) <= margin
        elif MODE == MODE_ACCEPT_ALL:
            accept = valid
        else:  # MODE_REJECT_ALL
            accept = valid & (token < 0)  # all False, with the right shape
        accept = accept & valid & (bad == 0)
        tl.store(acc_out_ptr + row, accept.to(tl.int8), mask=in_range)
        tl.atomic_min(n_ptr + sample_safe, token, mask=valid & (accept == 0), sem="relaxed")
    tl.atomic_max(flag_ptr + sample * 0, 1, mask=bad, sem="relaxed")
