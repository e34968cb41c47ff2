"""Exact (lossless) verification over ALL drafts of a group: walk the trie with the policy's own samples.

With exact acceptance a draft token is a fixed proposal, and a proposal is accepted exactly when the
token the current policy samples at that position equals it. spec-rl samples with keyed uniforms
(docs/design.md "Randomness"): the token at absolute position p of sample uid is
``F_p^{-1}(u(seed, uid, p))`` for the policy's distribution F_p there. Verification therefore walks,
for every sample, down the trie of its group's drafts (the G responses of the same prompt from last
epoch): at each node it draws the policy's keyed sample; if that token is a child of the node, the walk
moves on (the token is reused, with its log-prob); otherwise the walk stops, and the sampled token is
the token at the rejection index n, already drawn from the right distribution (the policy restricted
to tokens off the trie, since the sample missed the trie's children).

The response is then token for token what fresh keyed decoding of the current policy would produce
(the continuation uses the same keys), so the rollout distribution is exactly the policy's: lossless.
For a single draft this is the exact rule of docs/design.md "Exact acceptance" (accept y_i with
probability p_t(y_i), a residual draw on rejection); with G drafts a sample may follow any of them, so
more is reused. The outputs needed at each node are in the scoring pass's
:class:`~spec_rl.acceptance.scores.DraftScores`: the output that scores token d of draft j is the output at the
node of draft j's first d tokens, and drafts that share a prefix share those nodes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..sampling.distribution import SamplingSettings, keyed_sample
from ..sampling.groups import as_id_lists, int64_tensor, rows_by_prompt

#: Draft positions sampled per walking row in the first pass (doubling afterwards).
_FIRST_WINDOW = 16


@dataclass
class WalkResult:
    """Per drafted row: the reused prefix (n tokens, with log-probs), whose draft holds it, and the token at n.

    Attributes:
        n: rejection index (tokens reused from the trie).
        source: row whose draft's first n tokens are the prefix (its K/V can be continued).
        tokens, logprobs: the prefix tokens and their log-probs under the current policy.
        next_token: the token sampled at position n (None when the walk ended at a draft's end).
        next_logprob: its log-prob.
    """

    n: list[int]
    source: list[int]
    tokens: list[list[int]]
    logprobs: list[list[float]]
    next_token: list[int | None]
    next_logprob: list[float | None]


def walk_tries(
    prompts: Sequence[Sequence[int]],
    drafts: Sequence[Sequence[int]],
    scores,
    settings: SamplingSettings,
    seed: int,
    uids: Sequence[int],
    progressive=None,
) -> WalkResult:
    """Exact verification of every drafted row against its group's trie (see the module docstring).

    Each pass samples, for every walking row at once, the policy's keyed tokens along the draft it
    currently follows (the longest draft through its node), from its depth to that draft's end; the
    row accepts up to the first sample that differs from the draft. If that sample is another child
    of the node there, the row switches to the draft through that child and walks on in the next pass;
    otherwise it stops, and the sample is its token at n. A pass covers a window of depths that
    doubles from pass to pass (16, 32, ...), so a row that stops early does not pay for sampling the
    rest of its draft, and the whole walk costs a few vectorised passes.

    Parameters
    ----------
    prompts, drafts : per row, the prompt ids and the (budget-cut) draft ids
    scores : :class:`~spec_rl.acceptance.scores.DraftScores` of the rows, [B, R, .]
    settings : sampling settings (temperature, top-k, top-p)
    seed : seed of the sampled tokens (the continuation's seed: the prefix and the rest share keys)
    uids : per-row sample ids keying the uniforms
    progressive : a :class:`~spec_rl.backends.progressive.ProgressiveTreeScores` whose ``scores`` are
        ``scores``: a row samples only the scored tokens of its draft (``scored_len``) and, when every
        walking row waits at that point, the walk asks it to ``extend`` (the same decisions as with
        every score present)

    Returns
    -------
    :class:`WalkResult`; a walk that reaches the end of a draft stops with ``next_token`` None.
    """
    bsz = len(drafts)
    lengths = [len(d) for d in drafts]
    drafts = as_id_lists(drafts)
    group_of: list[list[int]] = [[] for _ in range(bsz)]
    for rows in rows_by_prompt(prompts).values():
        distinct = _distinct_drafts(rows, drafts, lengths)
        for r in rows:
            group_of[r] = distinct
    out = WalkResult(
        [0] * bsz, list(range(bsz)), [[] for _ in range(bsz)], [[] for _ in range(bsz)], [None] * bsz, [None] * bsz
    )
    follow = [group_of[r][0] for r in range(bsz)]  # the draft each row walks along
    walking = [r for r in range(bsz) if lengths[follow[r]] > 0]
    device = scores.lm_head_weight.device if scores.logits is None else scores.logits.device
    prompt_lens = int64_tensor([len(p) for p in prompts])
    uid_t = int64_tensor([int(u) for u in uids])
    window = _FIRST_WINDOW
    scored = lengths if progressive is None else progressive.scored_len  # per draft: its leading tokens scored
    while walking:
        ready = [r for r in walking if out.n[r] < scored[follow[r]]]
        if not ready:  # every walking row used up what is scored of its draft: score below them
            progressive.extend([(follow[r], out.n[r]) for r in walking])
            if not any(out.n[r] < scored[follow[r]] for r in walking):
                raise RuntimeError("progressive scores did not extend below the walks that wait for them")
            continue
        # (row, draft, from depth, to depth): a window that doubles per pass, so rows that stop early
        # do not pay for sampling the rest of their draft.
        segs = [(r, follow[r], out.n[r], min(scored[follow[r]], out.n[r] + window)) for r in ready]
        window *= 2
        toks, lps = _sample_segments(segs, scores, settings, seed, uid_t, prompt_lens, device)
        at, still = 0, [r for r in walking if out.n[r] >= scored[follow[r]]]
        for r, f, a, b in segs:
            sampled, logps = toks[at : at + b - a], lps[at : at + b - a]
            at += b - a
            if _advance(out, group_of[r], r, f, a, drafts, sampled, logps, follow, lengths):
                still.append(r)
        walking = still
    return out


def _distinct_drafts(rows: list[int], drafts: list[list[int]], lengths: list[int]) -> list[int]:
    """One row per distinct draft of a group, longest first (ties: first row): the drafts a walk can follow.

    Identical drafts are one path of the trie, so searching one of them is enough; this keeps the
    search at a rejection linear in the number of distinct drafts, not in the group size.
    """
    seen: set[tuple[int, ...]] = set()
    distinct = []
    for r in sorted(rows, key=lambda r: (-lengths[r], r)):
        key = tuple(drafts[r])
        if key not in seen:
            seen.add(key)
            distinct.append(r)
    return distinct


def _sample_segments(segs, scores, settings, seed, uid_t, prompt_lens, device) -> tuple[list[int], list[float]]:
    """The policy's keyed samples at depths [a, b) of draft f for each segment (row, f, a, b), concatenated."""
    rows_t, follow_t, a_t, b_t = (int64_tensor(col) for col in zip(*segs))
    counts = b_t - a_t
    offsets = torch.cumsum(counts, 0) - counts
    depth = torch.arange(int(counts.sum())) - torch.repeat_interleave(offsets - a_t, counts)
    row_of = torch.repeat_interleave(rows_t, counts)
    logits, index = scores.distinct_logits_at(torch.repeat_interleave(follow_t, counts).to(device), depth.to(device))
    pos = (prompt_lens[row_of] + depth).to(device)
    toks, lps = keyed_sample(logits, settings, seed, uid_t[row_of].to(device), pos, index=index)
    return toks.tolist(), lps.tolist()


def _advance(
    out: WalkResult, group: list[int], r: int, f: int, start: int, drafts, sampled, logps, follow, lengths
) -> bool:
    """Accept row r's samples along draft f from depth ``start``; True while the walk goes on."""
    draft = drafts[f]
    k = 0
    while k < len(sampled) and sampled[k] == draft[start + k]:
        k += 1
    out.tokens[r] += sampled[:k]
    out.logprobs[r] += logps[:k]
    out.n[r] = start + k
    out.source[r] = f
    if k == len(sampled):  # the window matched: walk on, unless the draft it followed ends here
        return out.n[r] < lengths[f]
    depth, token = start + k, sampled[k]
    # another draft of the group through this node (same first `depth` tokens) continuing with `token`:
    # the longest such (the group is sorted longest first), as a trie's child would give
    g = next(
        (g for g in group if lengths[g] > depth and drafts[g][depth] == token and drafts[g][:depth] == draft[:depth]),
        None,
    )
    if g is None:  # off the trie: the token at n, already drawn from the policy
        out.next_token[r], out.next_logprob[r] = token, logps[k]
        return False
    out.tokens[r].append(token)
    out.logprobs[r].append(logps[k])
    out.n[r] = depth + 1
    out.source[r], follow[r] = g, g
    return lengths[g] > out.n[r]  # walk on unless that draft ends right here
