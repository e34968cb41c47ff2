"""The SPEC-RL acceptance rule in plain torch (SPEC-RL Sec. 3, Alg. 1; docs/design.md "The rule", "Exact acceptance"):
the executable specification the kernels are tested against. No input validation here (``dispatch.verify_scores``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from ..sampling.distribution import SamplingSettings, sampling_log_softmax
from ..util.validation import invalid_scores_message
from .scores import DraftScores

#: How each score source is named in errors (the Triton kernels use the same names).
SCORE_NAMES = {"logits": "logits", "hidden_states": "logits (hidden_states @ lm_head_weight.T)"}

# Logits formed at once: at most 1024 rows, about 2**21 values and a quarter of the rows (memory: draft_logprobs).
_LOGIT_ROWS_PER_CHUNK = 1024
_LOGIT_ELEMENTS_PER_CHUNK = 1 << 21


@dataclass
class VerifyStats:
    """Summary of one verification call (counts are tokens or samples)."""

    num_samples: int
    draft_tokens: int
    accepted_tokens: int
    full_reuse_count: int

    @property
    def full_reuse_ratio(self) -> float:
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
        ratios = ("full_reuse_ratio", "mean_accepted_len", "acceptance_rate")
        return {**asdict(self), **{name: getattr(self, name) for name in ratios}}


@dataclass
class VerifyResult:
    """Verification of B drafts padded to R: ``new_logprobs`` [B, R] float32 (log pi_t(y_i | x, y_<i) under the
    sampling distribution, 0 at padding), ``accepted_len`` [B] int64 (rejection index n, 0..length), ``full_reuse``
    [B] bool (n == length), ``accept_mask`` [B, R] bool test outcomes (False at padding; None unless requested)."""

    new_logprobs: torch.Tensor
    accepted_len: torch.Tensor
    full_reuse: torch.Tensor
    accept_mask: torch.Tensor | None
    stats: VerifyStats


def lengths_mask(lengths: torch.Tensor, max_len: int) -> torch.Tensor:
    """[B] lengths -> [B, max_len] bool mask of valid (leading) positions."""
    return torch.arange(max_len, device=lengths.device).unsqueeze(0) < lengths.unsqueeze(1)


def draft_logprobs(
    draft_ids: torch.Tensor,
    lengths: torch.Tensor,
    scores: DraftScores,
    settings: SamplingSettings,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Sampling log-probs [B, R] in ``dtype`` of the draft tokens (0 at padding); logits are formed in chunks of rows,
    at valid positions only, once per distinct output (``scores.same_as``). A chunk holds at most a quarter of the
    valid rows (and about 2**21 values): the extra memory stays <= 1/4 of the [N, V] float32 logits."""
    bsz, max_len = draft_ids.shape
    valid = lengths_mask(lengths, max_len)
    zero = torch.zeros((), dtype=dtype, device=draft_ids.device)
    if scores.new_logprobs is not None:
        return torch.where(valid, scores.new_logprobs.to(dtype), zero)
    flat_valid = valid.reshape(-1).nonzero().squeeze(1)
    flat_ids = draft_ids.reshape(-1)[flat_valid]
    source = scores.logits if scores.logits is not None else scores.hidden_states
    outputs = source.reshape(-1, source.shape[-1])
    if scores.same_as is not None:  # one row per distinct output; index[k] says which one scores entry k
        distinct, index = torch.unique(scores.same_as.reshape(-1)[flat_valid], return_inverse=True)
    else:
        distinct, index = flat_valid, torch.arange(flat_valid.shape[0], device=draft_ids.device)
    vocab = scores.vocab_size
    if scores.logits is not None:

        def logits_of(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
            first, last = int(rows[0]), int(rows[-1])
            if last - first < 2 * len(rows):  # mostly valid rows: a view of their range, no copy
                return outputs[first : last + 1], rows - first
            return outputs[rows], None

    else:
        weight = scores.lm_head_weight.to(dtype)
        bias = scores.lm_head_bias.to(dtype) if scores.lm_head_bias is not None else None

        def logits_of(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
            return torch.nn.functional.linear(outputs[rows].to(dtype), weight, bias), None

    packed = torch.empty(flat_ids.shape[0], dtype=dtype, device=draft_ids.device)
    quarter = distinct.shape[0] // 4
    chunk = max(1, min(_LOGIT_ROWS_PER_CHUNK, _LOGIT_ELEMENTS_PER_CHUNK // vocab, quarter))
    order = torch.argsort(index, stable=True)  # entries grouped by output, so a chunk of outputs is a range
    sorted_index = index[order]
    starts = torch.arange(0, distinct.shape[0] + chunk, chunk, device=draft_ids.device)
    bounds = torch.searchsorted(sorted_index, starts).tolist()
    for c, start in enumerate(range(0, distinct.shape[0], chunk)):
        entries = order[bounds[c] : bounds[c + 1]]
        logits, at = logits_of(distinct[start : start + chunk])
        local = index[entries] - start
        rows = local if at is None else at[local]
        if settings.is_plain:  # log p = logit / T - logsumexp(logits / T), without forming log p over V
            packed[entries] = _plain_logprobs(logits, rows, flat_ids[entries], settings.temperature, dtype, at is None)
        else:
            logp = sampling_log_softmax(logits, settings.temperature, settings.top_k, settings.top_p, dtype=dtype)
            packed[entries] = logp[rows, flat_ids[entries]]
    out = torch.zeros(bsz * max_len, dtype=dtype, device=draft_ids.device)
    out[flat_valid] = packed
    return out.view(bsz, max_len)


def _plain_logprobs(logits, rows, ids, temperature: float, dtype: torch.dtype, owned: bool) -> torch.Tensor:
    """log softmax(logits / T)[rows, ids] in ``dtype``; ``owned``: ``logits`` may be overwritten."""
    picked = logits[rows, ids].to(dtype)
    x = logits if logits.dtype == dtype else logits.to(dtype)
    in_place = owned or x is not logits
    if temperature != 1.0:
        x = x.div_(temperature) if in_place else x / temperature
        picked, in_place = picked / temperature, True
    top = x.amax(-1, keepdim=True)
    shifted = x.sub_(top) if in_place else x - top
    lse = shifted.exp_().sum(-1).log_().add_(top.squeeze(-1))
    return picked - lse[rows]


def raise_if_no_distribution(lp_new: torch.Tensor, source: str) -> None:
    """ValueError naming the (sample, token) positions where [B, R] ``lp_new`` is NaN: logits without a distribution
    (a NaN or +inf logit, or all -inf). ``source``: a key of :data:`SCORE_NAMES`; "new_logprobs" is not checked."""
    bad = torch.isnan(lp_new)
    if source != "new_logprobs" and bool(bad.any()):
        where = torch.nonzero(bad)
        raise ValueError(invalid_scores_message(SCORE_NAMES[source], where[:8].tolist(), where.shape[0]))


def rejection_index(accept: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """First rejected position within each row's length: [B, R] bool, [B] -> [B] int64."""
    valid = lengths_mask(lengths, accept.shape[1])
    rejected = valid & ~accept
    # Positions past the length count as "rejected" at index `length`.
    first = torch.where(rejected, torch.arange(accept.shape[1], device=accept.device), accept.shape[1])
    n = first.min(dim=1).values if accept.shape[1] else torch.zeros_like(lengths)
    return torch.minimum(n, lengths).to(torch.int64)


def make_result(
    new_logprobs: torch.Tensor,
    accepted_len: torch.Tensor,
    accept: torch.Tensor,
    lengths: torch.Tensor,
    return_accept_mask: bool,
) -> VerifyResult:
    """:class:`VerifyResult` of per-token outcomes and rejection indices (one host sync for the stats)."""
    full = accepted_len == lengths
    counts = torch.stack([lengths.sum(), accepted_len.sum(), full.sum()]).tolist()  # draft, accepted, full reuse
    stats = VerifyStats(lengths.shape[0], *counts)
    mask = accept if return_accept_mask else None
    return VerifyResult(new_logprobs.to(torch.float32), accepted_len.to(torch.int64), full, mask, stats)


def reference_verify(
    draft_ids: torch.Tensor,
    old_logprobs: torch.Tensor,
    lengths: torch.Tensor,
    uids: torch.Tensor,
    scores: DraftScores,
    *,
    seed: int,
    options,
    compute_dtype: torch.dtype = torch.float32,
) -> VerifyResult:
    """Verify B padded drafts with validated inputs: draft_ids, old_logprobs [B, R]; lengths, uids [B] int64;
    ``scores`` with row i scoring draft token i; ``options`` a ``VerifyOptions`` (its rule decides). ValueError: see
    :func:`raise_if_no_distribution`."""
    lp_new = draft_logprobs(draft_ids, lengths, scores, options.sampling, compute_dtype)
    raise_if_no_distribution(lp_new, scores.source)
    accept, n = options.rule.decide(lp_new, old_logprobs, lengths, seed, uids)
    return make_result(lp_new, n, accept, lengths, options.return_accept_mask)
