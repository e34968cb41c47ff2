"""Constants and host helpers shared by the kernel modules.

A launch's rule (seed, lenience, temperature) travels as one int32 tensor of words (float64 as bit pairs), so no
kernel is specialised on a value and one compiled kernel serves every seed, lenience and temperature."""

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


INTERPRET = type(_interpreter_probe).__name__ == "InterpretedFunction"  # TRITON_INTERPRET=1 set before import

LOG2E = 1.4426950408889634  # log2(e): exp(x) = exp2(x * log2(e))
NEG_FLT_MAX = tl.constexpr(-3.4028234663852886e38)  # initial running max: all -inf never gives -inf - -inf
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# The epilogue's MODE: finite log l, +inf, -inf, or score only (no decisions); :meth:`DraftRows.padded` picks it.
MODE_FINITE = tl.constexpr(0)
MODE_ACCEPT_ALL = tl.constexpr(1)
MODE_REJECT_ALL = tl.constexpr(2)
MODE_SCORE_ONLY = tl.constexpr(3)


def as_i32(word: int) -> int:
    """uint32 -> the signed int32 with the same bits."""
    word &= 0xFFFFFFFF
    return word - (1 << 32) if word >= (1 << 31) else word


def seed_words(seed: int) -> tuple[int, int]:
    """The Philox key words (lo, hi) of ``seed`` mod 2**64 as signed int32, split as spec_rl/sampling/philox.py does."""
    v = int(seed) % (1 << 64)
    return as_i32(v & 0xFFFFFFFF), as_i32(v >> 32)


def f64_words(x: float) -> tuple[int, int]:
    """IEEE-754 bits of a Python float as two signed int32 words (lo, hi)."""
    (bits,) = struct.unpack("<Q", struct.pack("<d", float(x)))
    return as_i32(bits & 0xFFFFFFFF), as_i32(bits >> 32)


def is_available(device: torch.device | str | None = None) -> bool:
    """Whether the kernels can run on ``device`` (default: CUDA if present); CPU needs TRITON_INTERPRET=1."""
    device = torch.device(device if device is not None else "cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        return torch.cuda.is_available()
    return device.type == "cpu" and INTERPRET


def unit_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


class InvalidScores(ValueError):
    """Scored positions without a valid distribution (NaN, +inf, or every logit -inf): ``positions``, the first
    (sample, token) pairs, of ``total``. spec_rl's verify functions word it as the reference does."""

    def __init__(self, positions: list[list[int]], total: int):
        super().__init__(
            f"{total} scored position(s) without a valid distribution (a NaN or +inf logit, or all -inf), "
            f"first (sample, token): {positions}"
        )
        self.positions, self.total = positions, total


def kernel_results(rows: DraftRows, lp, acc, n, flag):
    """(new log-probs f32, accept bool, rejection index int64) of a launch over ``rows``. If the kernel set its flag,
    InvalidScores naming the NaN positions of ``lp`` ([B, R], or tagged [N]) as (sample, token) (one sync)."""
    if int(flag.item()):
        where = torch.nonzero(torch.isnan(lp))
        first = where[:8]
        if lp.dim() == 1:  # tagged rows
            first = torch.stack([rows.row_sample[first[:, 0]], rows.row_token[first[:, 0]]], 1)
        raise InvalidScores(first.tolist(), where.shape[0])
    acc = torch.zeros_like(acc, dtype=torch.bool) if rows.mode == MODE_SCORE_ONLY.value else acc.bool()
    return lp, acc, n.to(torch.int64)


@dataclass
class DraftRows:
    """Draft tokens of one verification launch (one per scored row) and the test's settings.

    ids, old: [n_rows] draft ids and stored log-probs (padded: [B * R] row-major); lengths, uids: [B] int64;
    row_sample, row_token: [n_rows] int32 sample (-1: padding) and token index; seed: 64-bit; log_lenience: log(l);
    temperature: T > 0; mode: the epilogue MODE."""

    ids: torch.Tensor
    old: torch.Tensor
    lengths: torch.Tensor
    uids: torch.Tensor
    row_sample: torch.Tensor
    row_token: torch.Tensor
    seed: int
    log_lenience: float
    temperature: float
    mode: int

    @classmethod
    def padded(cls, draft_ids, old_logprobs, lengths, uids, *, seed, log_lenience, temperature, score_only=False):
        """Rows of right-padded drafts [B, R]: row r is token r % R of sample r // R (sample -1 past its length)."""
        ids, old = draft_ids.reshape(-1).contiguous(), old_logprobs.reshape(-1).contiguous()
        infinite = {math.inf: MODE_ACCEPT_ALL, -math.inf: MODE_REJECT_ALL}
        mode = (MODE_SCORE_ONLY if score_only else infinite.get(log_lenience, MODE_FINITE)).value
        lengths, uids = lengths.to(torch.int64).contiguous(), uids.to(torch.int64).contiguous()
        token = torch.arange(draft_ids.shape[1], device=lengths.device).expand(draft_ids.shape)
        sample = torch.arange(draft_ids.shape[0], device=lengths.device)[:, None].expand(draft_ids.shape)
        sample = torch.where(token < lengths[:, None], sample, -1)
        row_sample, row_token = (x.reshape(-1).to(torch.int32).contiguous() for x in (sample, token))
        return cls(ids, old, lengths, uids, row_sample, row_token, seed, log_lenience, temperature, mode)

    def params(self, device: torch.device) -> torch.Tensor:
        """The rule as int32 words [k0, k1, log_l lo, hi, T lo, hi, c] on ``device``: the Philox key, float64 log l
        (an infinite one as 0: MODE decides) and T as bit pairs, c = log2(e) / T as float32 bits (the exp2 scale)."""
        ll = self.log_lenience if math.isfinite(self.log_lenience) else 0.0
        c_bits = torch.tensor(LOG2E / float(self.temperature), dtype=torch.float32).view(torch.int32).item()
        words = (*seed_words(self.seed), *f64_words(ll), *f64_words(float(self.temperature)), c_bits)
        return torch.tensor(words, dtype=torch.int32, device=device)

    def buffers(self, n_rows: int, device: torch.device):
        """(log-probs [n_rows] f32, accept [n_rows] int8, rejection index [B] int32 = lengths, flag [1] int32)."""
        lp = torch.empty(n_rows, dtype=torch.float32, device=device)
        acc = torch.empty(n_rows, dtype=torch.int8, device=device)
        n = self.lengths.to(device=device, dtype=torch.int32).clone()
        flag = torch.zeros(1, dtype=torch.int32, device=device)
        return lp, acc, n, flag
