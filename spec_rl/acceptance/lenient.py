"""Verified prefixes under the lenient rule or random reuse (docs/design.md "The rule"). The token at the rejection
index n comes from the scoring output at n, keyed like every decoded token: from pi_t as in the paper, or without the
rejected token ("without-draft"; only q(y_n) is stored, so exact sampling's residual max(0, p - q) cannot be formed).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..sampling.distribution import SamplingSettings, keyed_sample
from ..sampling.groups import int64_tensor
from .dispatch import VerifyOptions, verify_scores
from .exact_walk import WalkResult
from .mode import RolloutMode
from .reference import lengths_mask


@dataclass
class LenientOutcome:
    """Prefixes over each row's own draft, and ``drift``: mean |lp_new - lp_old| (nats) over the accepted tokens."""

    walk: WalkResult
    drift: float


def accepted_drift(
    lp_new: torch.Tensor, lp_old: torch.Tensor, lengths: torch.Tensor, accepted_len: torch.Tensor
) -> float:
    """Mean |lp_new - lp_old| (nats) over the accepted tokens (0 when none): [B, R], [B, R], [B], [B]."""
    mask = lengths_mask(torch.minimum(accepted_len, lengths), lp_new.shape[1])
    if not bool(mask.any()):
        return 0.0
    return float((lp_new.double() - lp_old.double()).abs()[mask].mean())


def lenient_prefixes(
    draft_ids: Sequence[Sequence[int]],
    old_logprobs: Sequence[torch.Tensor],
    prompt_lens: Sequence[int],
    uids: Sequence[int],
    scores,
    settings: SamplingSettings,
    mode: RolloutMode,
    seeds: tuple[int, int],
    verify_backend: str = "auto",
) -> LenientOutcome:
    """Rejection index and token at n of every drafted row (its draft and stored log-probs) under ``mode`` (lenient
    or random); ``scores``: their DraftScores; ``seeds``: (acceptance seed, seed of the sampled tokens)."""
    seed, sample_seed = seeds
    device = scores.device
    max_r = max([len(d) for d in draft_ids] + [1])
    # one host tensor per field, then one copy to the device (not one small tensor per row)
    lengths = int64_tensor([len(d) for d in draft_ids])
    valid = torch.arange(max_r).unsqueeze(0) < lengths.unsqueeze(1)
    ids_t = torch.zeros((len(draft_ids), max_r), dtype=torch.long)
    ids_t[valid] = int64_tensor([t for d in draft_ids for t in d])
    old_t = torch.zeros((len(draft_ids), max_r), dtype=torch.float32)
    if draft_ids:
        old_t[valid] = torch.cat([old[: len(d)].float() for d, old in zip(draft_ids, old_logprobs)])
    ids_t, old_t, lengths = ids_t.to(device), old_t.to(device), lengths.to(device)
    uids_t = torch.tensor(list(uids), dtype=torch.long, device=device)
    options = VerifyOptions.for_mode(mode, sampling=settings, backend=verify_backend)
    result = verify_scores(ids_t, old_t, scores, lengths, seed=seed, uids=uids_t, options=options)
    n, lp_new = result.accepted_len.tolist(), result.new_logprobs.cpu()
    walk = WalkResult(
        n,
        list(range(len(n))),
        [list(d[:k]) for d, k in zip(draft_ids, n)],
        [lp_new[row, : n[row]].tolist() for row in range(len(n))],
        [None] * len(n),
        [None] * len(n),
    )
    rows = [row for row in range(len(draft_ids)) if n[row] < len(draft_ids[row])]
    if rows:  # the token at n, from the scoring output there (rule step 4)
        rows_t, n_t = torch.tensor(rows, device=device), torch.tensor([n[r] for r in rows], device=device)
        logits = scores.logits_at(rows_t, n_t)
        positions = torch.tensor([prompt_lens[r] + n[r] for r in rows], device=device)
        # the random-reuse ablation's n is not a rejection: its token at n comes from pi_t
        exclude = (
            ids_t[rows_t, n_t] if mode.acceptance == "lenient" and mode.rejection_draw == "without-draft" else None
        )
        tok, tok_lp = keyed_sample(logits, settings, sample_seed, uids_t[rows], positions, exclude=exclude)
        for r, t, lp in zip(rows, tok.tolist(), tok_lp.tolist()):
            walk.next_token[r], walk.next_logprob[r] = t, lp
    drift = accepted_drift(result.new_logprobs, old_t, lengths, result.accepted_len)
    return LenientOutcome(walk, drift)
