"""Exact (lossless) verification over all drafts of a group (docs/design.md "Exact acceptance", "Randomness").

A row walks down the trie of its group's drafts while the policy's keyed sample ``F_p^{-1}(u(seed, uid, p))`` is a
child of its node; the first sample off the trie is the token at the rejection index n, already drawn from the right
distribution, so the response is what fresh keyed decoding would produce.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..sampling.distribution import SamplingSettings, keyed_sample
from ..sampling.groups import as_id_lists, int64_tensor, rows_by_prompt


@dataclass
class Prefixes:
    """Per drafted row: rejection index ``n``, the ``source`` row whose draft holds the prefix (its K/V can be
    continued), the prefix ``tokens`` with current ``logprobs``, the token at n with its log-prob (``next_token``,
    ``next_logprob``; None where the draft was accepted to its end); ``drift``: mean |lp_new - lp_old| (nats) over
    the accepted tokens, None where it is not measured (the walk); ``behaviour``, ``next_behaviour``: the behaviour
    log-probs of the prefix and of the token at n (None: the current ones, a rule that samples the policy)."""

    n: list[int]
    source: list[int]
    tokens: list[list[int]]
    logprobs: list[list[float]]
    next_token: list[int | None]
    next_logprob: list[float | None]
    drift: float | None = None
    behaviour: list[list[float]] | None = None
    next_behaviour: list[float | None] | None = None


#: Draft positions sampled per walking row in the first pass (doubling afterwards).
_FIRST_WINDOW = 16
#: The most float32 logits (bytes) one sampling call builds: a late pass covers rows x window positions (256 x 512
#: of a 49k vocabulary would be 26 GB, and the sampling noise as much again); keyed samples do not depend on the cut.
LOGITS_BYTES = 1 << 28


def walk_tries(
    prompts: Sequence[Sequence[int]],
    drafts: Sequence[Sequence[int]],
    scores,
    settings: SamplingSettings,
    seed: int,
    uids: Sequence[int],
    progressive=None,
) -> Prefixes:
    """Exact verification of every drafted row against its group's trie, in vectorised passes along the draft each
    row follows, over depth windows that double per pass; a sample off that draft moves the row to a sibling draft.

    ``prompts``, ``drafts``: per row, prompt ids and (budget-cut) draft ids; ``scores``: their DraftScores;
    ``seed``: the continuation's seed (prefix and rest share keys); ``uids``: per-row sample ids. ``progressive``: a
    ``ProgressiveTreeScores`` over ``scores``: the rows of one chunk of it walk at a time (``open``, ``close``), they
    sample only scored tokens (``scored_len``), and the walk asks it to ``extend`` when all of them wait.
    """
    bsz = len(drafts)
    lengths = [len(d) for d in drafts]
    drafts = as_id_lists(drafts)
    group_of: list[list[int]] = [[] for _ in range(bsz)]
    for rows in rows_by_prompt(prompts).values():
        distinct = _distinct_drafts(rows, drafts, lengths)
        for r in rows:
            group_of[r] = distinct
    out = Prefixes(
        [0] * bsz, list(range(bsz)), [[] for _ in range(bsz)], [[] for _ in range(bsz)], [None] * bsz, [None] * bsz
    )
    follow = [group_of[r][0] for r in range(bsz)]  # the draft each row walks along
    walking = [r for r in range(bsz) if lengths[follow[r]] > 0]
    device = scores.device
    prompt_lens = int64_tensor([len(p) for p in prompts])
    uid_t = int64_tensor([int(u) for u in uids])
    scored = lengths if progressive is None else progressive.scored_len  # per draft: its leading tokens scored
    # progressive scores: one chunk of groups at a time (groups never interact), its K/V dropped when it is done
    blocks = [(None, walking)] if progressive is None else progressive.by_chunk(walking)
    for chunk, walking in blocks:
        if chunk is not None:
            progressive.open(chunk)
        window = _FIRST_WINDOW
        while walking:
            ready = [r for r in walking if out.n[r] < scored[follow[r]]]
            if not ready:  # every walking row used up the scored part of its draft: score further
                progressive.extend([(follow[r], out.n[r]) for r in walking])
                assert any(out.n[r] < scored[follow[r]] for r in walking), "progressive scores did not extend"
                continue
            # (row, draft, from depth, to depth)
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
        if chunk is not None:
            progressive.close(chunk)
    return out


def _distinct_drafts(rows: list[int], drafts: list[list[int]], lengths: list[int]) -> list[int]:
    """One row per distinct draft of a group, longest first (ties: first row): identical drafts are one trie path."""
    first: dict[tuple[int, ...], int] = {}
    for r in sorted(rows, key=lambda r: (-lengths[r], r)):
        first.setdefault(tuple(drafts[r]), r)
    return list(first.values())


def _sample_segments(segs, scores, settings, seed, uid_t, prompt_lens, device) -> tuple[list[int], list[float]]:
    """The policy's keyed samples at depths [a, b) of draft f for each segment (row, f, a, b), concatenated."""
    rows_t, follow_t, a_t, b_t = (int64_tensor(col) for col in zip(*segs))
    counts = b_t - a_t
    offsets = torch.cumsum(counts, 0) - counts
    depth = torch.arange(int(counts.sum())) - torch.repeat_interleave(offsets - a_t, counts)
    row_of, follow_of = torch.repeat_interleave(rows_t, counts), torch.repeat_interleave(follow_t, counts)
    vocab = scores.vocab_size
    step = max(1, LOGITS_BYTES // (4 * vocab))
    toks, lps = [], []
    for part in torch.arange(depth.numel()).split(step):
        logits, index = scores.distinct_logits_at(follow_of[part].to(device), depth[part].to(device))
        pos = (prompt_lens[row_of[part]] + depth[part]).to(device)
        t, lp = keyed_sample(logits, settings, seed, uid_t[row_of[part]].to(device), pos, index=index)
        toks += t.tolist()
        lps += lp.tolist()
    return toks, lps


def _advance(
    out: Prefixes, group: list[int], r: int, f: int, start: int, drafts, sampled, logps, follow, lengths
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
    # the longest draft of the group through this node (same first `depth` tokens) that continues with `token`
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
