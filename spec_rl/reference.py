"""The SPEC-RL acceptance rule in plain torch: the executable specification.

Rule (SPEC-RL, Liu et al. 2025, arXiv 2509.23232, Section 3 and Algorithm 1;
DESIGN.md "The rule"): for a draft response y_1..y_R with stored log-probs
lp_old_i, the current policy scores every draft token in one forward pass
(lp_new_i), and token i is accepted iff

    log u_i <= log(l) + lp_new_i - lp_old_i,     u_i ~ U(0, 1]  (keyed Philox)

The rejection index n is the number of leading accepted tokens (0..R); the
verified prefix y_<n is kept and the policy generates the rest. Everything is
computed in log space; the ratio is never exponentiated.

This module does no input validation (see :func:`spec_rl.verify.verify`);
kernels are tested against it, in float64 for logprob accuracy.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from .philox import STREAM_ACCEPT, STREAM_RANDOM_REUSE, philox_uniform
from .sampling import sampling_log_softmax

# Rows of logits materialised at once in the hidden-state path (bounds the
# reference's extra memory to about this many rows x V x 4 bytes).
_LOGIT_ROWS_PER_CHUNK = 1024


@dataclass
class VerifyStats:
    """Summary of one verification call (counts are tokens or samples)."""

    num_samples: int
    draft_tokens: int
    accepted_tokens: int
    full_reuse_count: int

    @property
    def full_reuse_ratio(self) -> float:
        """Fraction of samples whose whole draft was accepted."""
        return self.full_reuse_count / self.num_samples if self.num_samples else 0.0

    @property
    def mean_accepted_len(self) -> float:
        """Mean verified-prefix length in tokens."""
        return self.accepted_tokens / self.num_samples if self.num_samples else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted tokens / draft tokens."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    def to_dict(self) -> dict:
        return {
            "num_samples": self.num_samples,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "full_reuse_count": self.full_reuse_count,
            "full_reuse_ratio": self.full_reuse_ratio,
            "mean_accepted_len": self.mean_accepted_len,
            "acceptance_rate": self.acceptance_rate,
        }


@dataclass
class VerifyResult:
    """Output of verification for a batch of B drafts padded to length R.

    Attributes:
        new_logprobs: [B, R] float32, log pi_t(y_i | x, y_<i) under the
            sampling distribution; 0 at padded positions.
        accepted_len: [B] int64, the rejection index n (number of leading
            accepted tokens, 0..length).
        full_reuse: [B] bool, n == length (the whole draft is kept).
        accept_mask: [B, R] bool per-token test outcome (False at padding),
            or None when not requested.
        stats: counts over the batch.
    """

    new_logprobs: torch.Tensor
    accepted_len: torch.Tensor
    full_reuse: torch.Tensor
    accept_mask: torch.Tensor | None
    stats: VerifyStats


def lenience_to_log(lenience: float | None, log_lenience: float | None) -> float:
    """Return log(l) from either form (default l = 1, vanilla speculative decoding)."""
    if lenience is not None and log_lenience is not None:
        raise ValueError("pass either lenience or log_lenience, not both")
    for name, value in (("lenience", lenience), ("log_lenience", log_lenience)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real)):
            raise TypeError(f"{name} must be a real number (e.g. {name}=1.65), got {type(value).__name__} {value!r}")
    if log_lenience is not None:
        if math.isnan(log_lenience):
            raise ValueError("log_lenience must not be NaN (use -inf to disable reuse, +inf to reuse everything)")
        return float(log_lenience)
    if lenience is None:
        return 0.0
    if math.isnan(lenience) or lenience < 0:
        raise ValueError(
            f"lenience must be >= 0 (0 disables reuse, 1 is vanilla speculative decoding, inf reuses everything), got {lenience!r}"
        )
    return math.log(lenience) if lenience > 0 else float("-inf")


def lengths_mask(lengths: torch.Tensor, max_len: int) -> torch.Tensor:
    """[B] lengths -> [B, max_len] bool mask of valid (leading) positions."""
    return torch.arange(max_len, device=lengths.device).unsqueeze(0) < lengths.unsqueeze(1)


def _chunked_token_logprobs(logits_of, token_ids, temperature, top_k, top_p, dtype) -> torch.Tensor:
    """Gather sampling log-probs of ``token_ids`` [N], forming logits ``logits_of(slice)`` chunk by chunk."""
    out = torch.empty(token_ids.shape[0], dtype=dtype, device=token_ids.device)
    for start in range(0, token_ids.shape[0], _LOGIT_ROWS_PER_CHUNK):
        sl = slice(start, start + _LOGIT_ROWS_PER_CHUNK)
        logp = sampling_log_softmax(logits_of(sl), temperature, top_k, top_p, dtype=dtype)
        out[sl] = logp.gather(-1, token_ids[sl].long().unsqueeze(-1)).squeeze(-1)
    return out


def packed_logprobs_from_logits(
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Sampling log-probs of ``token_ids`` [N] from ``logits`` [N, V]."""
    return _chunked_token_logprobs(lambda sl: logits[sl], token_ids, temperature, top_k, top_p, dtype)


def packed_logprobs_from_hidden(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    token_ids: torch.Tensor,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Sampling log-probs of ``token_ids`` [N] from hidden states [N, d] and an LM head [V, d].

    Logits are formed chunk by chunk in ``dtype`` (the float32 or float64
    reference), never for all N rows at once.
    """
    w = weight.to(dtype)
    b = bias.to(dtype) if bias is not None else None
    return _chunked_token_logprobs(
        lambda sl: torch.nn.functional.linear(hidden[sl].to(dtype), w, b), token_ids, temperature, top_k, top_p, dtype
    )


def acceptance_test(
    new_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    uniforms: torch.Tensor,
    log_lenience: float,
) -> torch.Tensor:
    """Per-token test ``log u <= log l + lp_new - lp_old`` (paper Alg. 1), in float64.

    Conventions at the extremes: log l = +inf accepts every token; log l =
    -inf rejects every token; lp_new = -inf (token impossible now) is
    rejected for any finite l.
    """
    if log_lenience == float("inf"):
        return torch.ones_like(new_logprobs, dtype=torch.bool)
    if log_lenience == float("-inf"):
        return torch.zeros_like(new_logprobs, dtype=torch.bool)
    margin = new_logprobs.double() - old_logprobs.double() + log_lenience
    # NaN margin (e.g. -inf - -inf) compares False: rejected.
    return torch.log(uniforms.double()) <= margin


def rejection_index(accept: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """First rejected position within each row's length: [B, R] bool, [B] -> [B] int64."""
    valid = lengths_mask(lengths, accept.shape[1])
    rejected = valid & ~accept
    # Positions past the length count as "rejected" at index `length`.
    first = torch.where(rejected, torch.arange(accept.shape[1], device=accept.device), accept.shape[1])
    n = first.min(dim=1).values if accept.shape[1] else torch.zeros_like(lengths)
    return torch.minimum(n, lengths).to(torch.int64)


def random_reuse_index(seed: int, uids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Random-reuse ablation (paper Table 2): n uniform over {0, ..., length}.

    n = min(floor(u * (length + 1)), length) with u from the random-reuse
    Philox stream at token index 0.
    """
    u = philox_uniform(seed, uids, torch.zeros_like(uids), stream=STREAM_RANDOM_REUSE).double()
    n = torch.floor(u * (lengths.double() + 1)).to(torch.int64)
    return torch.minimum(n, lengths.to(torch.int64))


def reference_verify(
    draft_ids: torch.Tensor,
    old_logprobs: torch.Tensor,
    lengths: torch.Tensor,
    *,
    seed: int,
    uids: torch.Tensor,
    log_lenience: float,
    new_logprobs: torch.Tensor | None = None,
    logits: torch.Tensor | None = None,
    hidden_states: torch.Tensor | None = None,
    lm_head_weight: torch.Tensor | None = None,
    lm_head_bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    strategy: str = "spec",
    return_accept_mask: bool = False,
    compute_dtype: torch.dtype = torch.float32,
) -> VerifyResult:
    """Verify B padded drafts; inputs are assumed valid (see ``spec_rl.verify``).

    Shapes: draft_ids/old_logprobs [B, R]; lengths [B]; uids [B] int64;
    new_logprobs [B, R] or logits [B, R, V] or hidden_states [B, R, d] with
    lm_head_weight [V, d]. Row i of logits/hidden scores draft token i.
    ``strategy`` is "spec" (the lenient test) or "random" (random reuse).
    """
    bsz, max_len = draft_ids.shape
    valid = lengths_mask(lengths, max_len)
    if new_logprobs is not None:
        lp_new = torch.where(valid, new_logprobs.to(compute_dtype), torch.zeros((), dtype=compute_dtype, device=valid.device))
    else:
        flat_ids = draft_ids[valid]
        if logits is not None:
            packed = packed_logprobs_from_logits(logits[valid], flat_ids, temperature, top_k, top_p, compute_dtype)
        else:
            packed = packed_logprobs_from_hidden(
                hidden_states[valid], lm_head_weight, lm_head_bias, flat_ids, temperature, top_k, top_p, compute_dtype
            )
        lp_new = torch.zeros(bsz, max_len, dtype=compute_dtype, device=draft_ids.device)
        lp_new[valid] = packed

    token_index = torch.arange(max_len, device=draft_ids.device, dtype=torch.int64).unsqueeze(0)
    if strategy == "spec":
        u = philox_uniform(seed, uids.unsqueeze(1), token_index, stream=STREAM_ACCEPT)
        accept = acceptance_test(lp_new, old_logprobs, u, log_lenience) & valid
        n = rejection_index(accept, lengths)
    elif strategy == "random":
        n = random_reuse_index(seed, uids, lengths)
        accept = lengths_mask(n, max_len)
    else:
        raise ValueError(f"strategy must be 'spec' or 'random', got {strategy!r}")

    full = n == lengths
    stats = VerifyStats(
        num_samples=bsz,
        draft_tokens=int(lengths.sum()),
        accepted_tokens=int(n.sum()),
        full_reuse_count=int(full.sum()),
    )
    return VerifyResult(
        new_logprobs=lp_new.to(torch.float32),
        accepted_len=n,
        full_reuse=full,
        accept_mask=accept if return_accept_mask else None,
        stats=stats,
    )
