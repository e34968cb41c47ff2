"""Verified prefixes under the paper's lenient rule (or random reuse), for :mod:`spec_rl.rollout.speculative`.

Token i of a draft is accepted iff ``log u_i <= log l + lp_new_i - lp_old_i`` (paper Sec. 3, Alg. 1;
:func:`spec_rl.acceptance.dispatch.verify` decides), and the token at the rejection index n is then drawn from the
scoring pass's own output at position n, keyed by (uid, absolute position) like every decoded token.
The paper draws that token from pi_t itself, so the rejected draft token can be drawn again; with
``rejection_draw="without-draft"`` it is drawn from pi_t with the rejected token removed (renormalised).
Only q(y_n) of the draft is stored, not the whole old distribution q, so exact speculative sampling's
residual max(0, p - q) cannot be formed; at l = 1, removing y_n is that residual when the vocabulary has two
tokens, and in general it stops the rule from drawing the token it just rejected (docs/design.md
"The rule"; its effect on learning: "The demo recipe").
With ``log_lenience=None`` the lenience is chosen for this step by :mod:`spec_rl.acceptance.adaptive`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..sampling.distribution import SamplingSettings, keyed_sample
from ..sampling.groups import int64_tensor
from .adaptive import accepted_drift, choose_log_lenience
from .dispatch import verify
from .exact_walk import WalkResult
from .reference import REJECTION_DRAWS


@dataclass
class LenientOutcome:
    """The prefixes (as a :class:`~spec_rl.acceptance.exact_walk.WalkResult` over each row's own draft), the log l
    used and the mean |lp_new - lp_old| of the accepted tokens (nats)."""

    walk: WalkResult
    log_lenience: float
    drift: float


def check_rejection_draw(draw: str, strategy: str, acceptance: str, log_lenience: float | None) -> None:
    """Refuse a draw that would not mean what it says (``log_lenience`` None: adaptive, whose l is >= 1).

    Raises:
        ValueError: an unknown draw; "without-draft" with a strategy other than "spec" or exact acceptance (they
            draw no token at a lenient rejection), or below l = 1, where a token can be rejected although pi_t gives
            it more than the draft did, and the residual keeps it.
    """
    if not isinstance(draw, str) or draw not in REJECTION_DRAWS:  # an array would compare element-wise
        raise ValueError(f"rejection_draw must be one of {REJECTION_DRAWS}, got {draw!r}")
    if draw != "policy" and (strategy != "spec" or acceptance != "lenient"):
        raise ValueError(f"rejection_draw={draw!r} applies to the lenient rule (strategy 'spec', acceptance 'lenient'), "
                         f"not strategy {strategy!r} with acceptance {acceptance!r}; drop it")  # fmt: skip
    if draw != "policy" and log_lenience is not None and log_lenience < 0:
        raise ValueError(f"rejection_draw={draw!r} needs lenience l >= 1, got l = {math.exp(log_lenience):.3g} "
                         f"(log l = {log_lenience:.3g}): below 1 the residual keeps the rejected token; drop it")  # fmt: skip


def lenient_prefixes(
    draft_ids: Sequence[Sequence[int]],
    old_logprobs: Sequence[torch.Tensor],
    prompt_lens: Sequence[int],
    uids: Sequence[int],
    scores,
    settings: SamplingSettings,
    *,
    log_lenience: float | None,
    target_drift: float,
    seed: int,
    sample_seed: int,
    strategy: str,
    verify_backend: str,
    device: torch.device,
    rejection_draw: str = "policy",
) -> LenientOutcome:
    """Rejection index and token at n of every drafted row (``log_lenience`` None: adaptive; ``rejection_draw``:
    "policy" or "without-draft", see module docstring)."""
    max_r = max([len(d) for d in draft_ids] + [1])
    # one host tensor per field, then one copy to the device (per-row torch.tensor calls cost ~7% of scoring)
    lengths = int64_tensor([len(d) for d in draft_ids])
    valid = torch.arange(max_r).unsqueeze(0) < lengths.unsqueeze(1)
    ids_t = torch.zeros((len(draft_ids), max_r), dtype=torch.long)
    ids_t[valid] = int64_tensor([t for d in draft_ids for t in d])
    old_t = torch.zeros((len(draft_ids), max_r), dtype=torch.float32)
    if draft_ids:
        old_t[valid] = torch.cat([old[: len(d)].float() for d, old in zip(draft_ids, old_logprobs)])
    ids_t, old_t, lengths = ids_t.to(device), old_t.to(device), lengths.to(device)
    uids_t = torch.tensor(list(uids), dtype=torch.long, device=device)
    common = dict(lengths=lengths, seed=seed, uids=uids_t, strategy=strategy, backend=verify_backend)
    result = verify(
        ids_t, old_t, logits=scores.logits, hidden_states=scores.hidden_states, lm_head_weight=scores.lm_head_weight,
        lm_head_bias=scores.lm_head_bias, same_as=scores.same_as, temperature=settings.temperature, top_k=settings.top_k,
        top_p=settings.top_p, log_lenience=0.0 if log_lenience is None else log_lenience, **common,
    )  # fmt: skip
    if log_lenience is None and strategy == "spec":  # adaptive: decide again at the chosen l (same uniforms)
        log_lenience = choose_log_lenience(result.new_logprobs, old_t, lengths, uids_t, seed, target_drift)
        result = verify(ids_t, old_t, new_logprobs=result.new_logprobs, log_lenience=log_lenience, **common)
    n, lp_new = result.accepted_len.tolist(), result.new_logprobs.cpu()
    walk = WalkResult(n, list(range(len(n))), [list(d[:k]) for d, k in zip(draft_ids, n)],
                      [lp_new[row, : n[row]].tolist() for row in range(len(n))], [None] * len(n), [None] * len(n))  # fmt: skip
    rows = [row for row in range(len(draft_ids)) if n[row] < len(draft_ids[row])]
    if rows:  # the token at n, from the scoring output there (rule step 4)
        rows_t, n_t = torch.tensor(rows, device=device), torch.tensor([n[r] for r in rows], device=device)
        logits = scores.logits_at(rows_t, n_t)
        positions = torch.tensor([prompt_lens[r] + n[r] for r in rows], device=device)
        # the random-reuse ablation's n is not a rejection: its token at n comes from pi_t
        exclude = ids_t[rows_t, n_t] if rejection_draw == "without-draft" and strategy == "spec" else None
        tok, tok_lp = keyed_sample(logits, settings, sample_seed, uids_t[rows], positions, exclude=exclude)
        for r, t, lp in zip(rows, tok.tolist(), tok_lp.tolist()):
            walk.next_token[r], walk.next_logprob[r] = t, lp
    drift = accepted_drift(result.new_logprobs, old_t, lengths, result.accepted_len)
    return LenientOutcome(walk, float(log_lenience if log_lenience is not None else 0.0), drift)
