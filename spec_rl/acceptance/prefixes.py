"""Verified prefixes in a rollout (SPEC-RL Alg. 1, steps 2-4; docs/design.md "The rule", "Exact acceptance"): a rule
decides each drafted row's rejection index n through the verify functions and the token at n is drawn from the
scoring output there, keyed like every decoded token; a keyed-walk rule (exact) walks the policy's keyed samples down
the group's draft trie instead."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..sampling.distribution import SamplingSettings, keyed_sample
from ..sampling.groups import int64_tensor
from .dispatch import VerifyOptions, verify_scores
from .exact_walk import Prefixes, walk_tries
from .mode import RolloutMode
from .reference import lengths_mask
from .rules import Rule


@dataclass
class DraftRows:
    """The drafted rows of one rollout step: per row its prompt, its (budget-cut) draft ids and stored log-probs, its
    sample uid; ``seed`` keys the acceptance uniforms, ``sample_seed`` the sampled tokens; ``versions``: each draft's
    policy version and ``old_policy`` its logits (:class:`~spec_rl.rollout.old_policy.PolicyVersions`), read by a rule
    that draws from the residual."""

    prompts: list[list[int]]
    drafts: list[list[int]]
    old_logprobs: list[torch.Tensor]
    uids: list[int]
    seed: int
    sample_seed: int
    settings: SamplingSettings
    verify_backend: str = "auto"
    versions: list[int] | None = None
    old_policy: object = None
    behaviour: list[torch.Tensor] | None = None  # the drafts' behaviour log-probs (None: their stored log-probs)


def verified_prefixes(rule: Rule, rows: DraftRows, scores, progressive=None) -> Prefixes:
    """Rejection index and token at n of every drafted row under ``rule``; ``scores``: the rows' DraftScores
    (``progressive``: their progressive scores, read by a keyed walk)."""
    if rule.keyed_walk:
        return walk_tries(rows.prompts, rows.drafts, scores, rows.settings, rows.sample_seed, rows.uids, progressive)
    device = scores.device
    lengths = int64_tensor([len(d) for d in rows.drafts])
    max_r = max([len(d) for d in rows.drafts] + [1])
    valid = lengths_mask(lengths, max_r)
    ids = torch.zeros((len(rows.drafts), max_r), dtype=torch.long)
    ids[valid] = int64_tensor([t for d in rows.drafts for t in d])
    old = _padded(rows.drafts, rows.old_logprobs, valid)
    behaviour = None if rule.samples_policy else _padded(rows.drafts, rows.behaviour or rows.old_logprobs, valid)
    ids, old, lengths = ids.to(device), old.to(device), lengths.to(device)
    uids = torch.tensor(rows.uids, dtype=torch.long, device=device)
    options = VerifyOptions(RolloutMode(rule.verified_by(), tail=0), rows.settings, rows.verify_backend)
    result = verify_scores(ids, old, scores, lengths, seed=rows.seed, uids=uids, options=options)
    n, lp_new = result.accepted_len.tolist(), result.new_logprobs.cpu()
    out = Prefixes(
        n,
        list(range(len(n))),
        [list(d[:k]) for d, k in zip(rows.drafts, n)],
        [lp_new[row, : n[row]].tolist() for row in range(len(n))],
        [None] * len(n),
        [None] * len(n),
        accepted_drift(result.new_logprobs, old, lengths, result.accepted_len),
    )
    if behaviour is not None:  # the path that kept each token: drafted, then kept by the test
        kept = rule.kept_behaviour(lp_new, old.cpu(), behaviour, lengths.cpu())
        out.behaviour = [kept[row, : n[row]].tolist() for row in range(len(n))]
        out.next_behaviour = [None] * len(n)
    todo = [row for row in range(len(n)) if n[row] < len(rows.drafts[row])]
    if todo:  # the token at n, from the scoring output there (rule step 4)
        rows_t, n_t = torch.tensor(todo, device=device), torch.tensor([n[r] for r in todo], device=device)
        positions = torch.tensor([len(rows.prompts[r]) + n[r] for r in todo], device=device)
        exclude = ids[rows_t, n_t] if rule.excludes_rejected else None
        old = None
        if rule.needs_old_policy:  # q at n, from the weights of the step that produced the draft
            contexts = [rows.prompts[r] + rows.drafts[r][: n[r]] for r in todo]
            old = rows.old_policy.next_token_logits([rows.versions[r] for r in todo], contexts).to(device)
        tok, lp = keyed_sample(
            scores.logits_at(rows_t, n_t),
            rows.settings,
            rows.sample_seed,
            uids[rows_t],
            positions,
            exclude=exclude,
            residual_of=old,
        )
        for r, t, v in zip(todo, tok.tolist(), lp.tolist()):
            out.next_token[r], out.next_logprob[r] = t, v
        if out.next_behaviour is not None:
            lp_excluded = lp_new[rows_t.cpu(), n_t.cpu()] if exclude is not None else None
            drawn = rule.drawn_behaviour(lp.cpu(), lp_excluded).tolist()
            for r, b in zip(todo, drawn):
                out.next_behaviour[r] = b
    return out


def _padded(drafts: list[list[int]], rows: list[torch.Tensor], valid: torch.Tensor) -> torch.Tensor:
    """Per-draft float vectors (cut to each draft's length) as one right-padded [B, R] float32 tensor."""
    out = torch.zeros(valid.shape, dtype=torch.float32)
    if drafts:
        out[valid] = torch.cat([v[: len(d)].float() for d, v in zip(drafts, rows)])
    return out


def accepted_drift(
    lp_new: torch.Tensor, lp_old: torch.Tensor, lengths: torch.Tensor, accepted_len: torch.Tensor
) -> float:
    """Mean |lp_new - lp_old| (nats) over the accepted tokens (0 when none): [B, R], [B, R], [B], [B]."""
    mask = lengths_mask(torch.minimum(accepted_len, lengths), lp_new.shape[1])
    if not bool(mask.any()):
        return 0.0
    return float((lp_new.double() - lp_old.double()).abs()[mask].mean())
