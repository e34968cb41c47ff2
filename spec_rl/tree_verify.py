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


@dataclass
class _Trie:
    """A group's drafts as a trie; node 0 is the prompt. ``rep[v]``: the longest draft through node v."""

    children: list[dict[int, int]] = field(default_factory=lambda: [{}])
    depth: list[int] = field(default_factory=lambda: [0])
    rep: list[int] = field(default_factory=lambda: [-1])

    def insert(self, row: int, draft: Sequence[int], lengths: Sequence[int]) -> None:
        node = 0
        for t in draft:
            if self.rep[node] < 0 or lengths[self.rep[node]] < len(draft):
                self.rep[node] = row
            child = self.children[node].get(int(t))
            if child is None:
                child = len(self.depth)
                self.children[node][int(t)] = child
                self.children.append({})
                self.depth.append(self.depth[node] + 1)
                self.rep.append(row)
            node = child
        if self.rep[node] < 0 or lengths[self.rep[node]] < len(draft):
            self.rep[node] = row


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
    node = [0] * bsz
    out = WalkResult([0] * bsz, list(range(bsz)), [[] for _ in range(bsz)], [[] for _ in range(bsz)], [None] * bsz, [None] * bsz)
    walking = [r for r in range(bsz) if lengths[trie_of[r].rep[0]] > 0]
    device = scores.lm_head_weight.device if scores.logits is None else scores.logits.device
    uid_t = torch.tensor([int(u) for u in uids], dtype=torch.long)
    while walking:
        reps = [trie_of[r].rep[node[r]] for r in walking]
        depth = [trie_of[r].depth[node[r]] for r in walking]
        logits = scores.logits_at(torch.tensor(reps, device=device), torch.tensor(depth, device=device))
        positions = torch.tensor([len(prompts[r]) + d for r, d in zip(walking, depth)], dtype=torch.long)
        toks, lps = keyed_sample(logits, settings, seed, uid_t[walking].to(device), positions.to(device))
        still = []
        for r, rep, tok, lp in zip(walking, reps, toks.tolist(), lps.tolist()):
            child = trie_of[r].children[node[r]].get(tok)
            if child is None:  # off the trie: the token at n, already drawn from the policy
                out.next_token[r], out.next_logprob[r], out.source[r] = tok, lp, rep
                continue
            node[r] = child
            out.tokens[r].append(tok)
            out.logprobs[r].append(lp)
            out.n[r] += 1
            rep_next = trie_of[r].rep[child]
            out.source[r] = rep_next
            if lengths[rep_next] > out.n[r]:
                still.append(r)
        walking = still
    return out
