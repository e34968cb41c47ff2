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
:class:`~spec_rl.scoring.DraftScores`: the output that scores token d of draft j is the output at the
node of draft j's first d tokens, and drafts that share a prefix share those nodes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .sampling import SamplingSettings, keyed_sample

#: Draft positions sampled per walking row in the first pass (doubling afterwards).
_FIRST_WINDOW = 16


@dataclass
class _Trie:
    """A group's drafts as a trie; node 0 is the prompt. ``rep[v]``: the longest draft through node v;
    ``path[row]``: the nodes of a draft's tokens (``path[row][d]`` is the node after d + 1 tokens)."""

    children: list[dict[int, int]] = field(default_factory=lambda: [{}])
    rep: list[int] = field(default_factory=lambda: [-1])
    path: dict[int, list[int]] = field(default_factory=dict)

    def insert(self, row: int, draft: Sequence[int], lengths: Sequence[int]) -> None:
        node, nodes = 0, []
        for t in draft:
            if self.rep[node] < 0 or lengths[self.rep[node]] < len(draft):
                self.rep[node] = row
            child = self.children[node].get(int(t))
            if child is None:
                child = len(self.rep)
                self.children[node][int(t)] = child
                self.children.append({})
                self.rep.append(row)
            nodes.append(child)
            node = child
        if self.rep[node] < 0 or lengths[self.rep[node]] < len(draft):
            self.rep[node] = row
        self.path[row] = nodes


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
    scores : :class:`~spec_rl.scoring.DraftScores` of the rows, [B, R, .]
    settings : sampling settings (temperature, top-k, top-p)
    seed : seed of the sampled tokens (the continuation's seed: the prefix and the rest share keys)
    uids : per-row sample ids keying the uniforms

    Returns
    -------
    :class:`WalkResult`; a walk that reaches the end of a draft stops with ``next_token`` None.
    """
    bsz = len(drafts)
    lengths = [len(d) for d in drafts]
    tries: dict[tuple[int, ...], _Trie] = {}
    for row, (p, d) in enumerate(zip(prompts, drafts)):
        tries.setdefault(tuple(int(t) for t in p), _Trie()).insert(row, d, lengths)
    trie_of = [tries[tuple(int(t) for t in p)] for p in prompts]
    out = WalkResult([0] * bsz, list(range(bsz)), [[] for _ in range(bsz)], [[] for _ in range(bsz)], [None] * bsz, [None] * bsz)
    follow = [trie_of[r].rep[0] for r in range(bsz)]  # the draft each row walks along
    walking = [r for r in range(bsz) if lengths[follow[r]] > 0]
    device = scores.lm_head_weight.device if scores.logits is None else scores.logits.device
    window = _FIRST_WINDOW
    while walking:
        # (row, draft, from depth, to depth): a window that doubles per pass, so rows that stop early
        # do not pay for sampling the rest of their draft.
        segs = [(r, follow[r], out.n[r], min(lengths[follow[r]], out.n[r] + window)) for r in walking]
        window *= 2
        rep_idx = torch.tensor([f for _, f, a, b in segs for _ in range(a, b)], device=device)
        cols = torch.tensor([c for _, _, a, b in segs for c in range(a, b)], device=device)
        uid_idx = torch.tensor([int(uids[r]) for r, _, a, b in segs for _ in range(a, b)], dtype=torch.long, device=device)
        pos = torch.tensor([len(prompts[r]) + c for r, _, a, b in segs for c in range(a, b)], dtype=torch.long, device=device)
        toks, lps = keyed_sample(scores.logits_at(rep_idx, cols), settings, seed, uid_idx, pos)
        toks, lps = toks.tolist(), lps.tolist()
        at, still = 0, []
        for r, f, a, b in segs:
            sampled, logps = toks[at : at + b - a], lps[at : at + b - a]
            at += b - a
            if _advance(out, trie_of[r], r, f, a, drafts[f], sampled, logps, follow, lengths):
                still.append(r)
        walking = still
    return out


def _advance(out: WalkResult, trie: _Trie, r: int, f: int, start: int, draft, sampled, logps, follow, lengths) -> bool:
    """Accept row r's samples along draft f from depth ``start``; True while the walk goes on."""
    k = 0
    while k < len(sampled) and sampled[k] == draft[start + k]:
        k += 1
    out.tokens[r] += sampled[:k]
    out.logprobs[r] += logps[:k]
    out.n[r] = start + k
    out.source[r] = f
    if k == len(sampled):  # the window matched: walk on, unless the draft it followed ends here
        return out.n[r] < lengths[f]
    node = trie.path[f][start + k - 1] if start + k > 0 else 0
    child = trie.children[node].get(sampled[k])
    if child is None:  # off the trie: the token at n, already drawn from the policy
        out.next_token[r], out.next_logprob[r] = sampled[k], logps[k]
        return False
    g = trie.rep[child]  # another draft of the group continues with exactly this token
    out.tokens[r].append(sampled[k])
    out.logprobs[r].append(logps[k])
    out.n[r] = start + k + 1
    out.source[r], follow[r] = g, g
    return len(trie.path[g]) > out.n[r]  # walk on unless that draft ends right here
