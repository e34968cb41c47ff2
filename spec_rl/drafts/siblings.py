"""Drafts from a group's siblings in flight: the G samples of one prompt propose tokens to each other.

The G samples of a prompt are decoded in the same batch and their responses overlap heavily (Seer,
arXiv 2511.14617: grouped speculation from sibling responses generated at the same time, lossless).
:class:`SiblingTokens` keeps the tokens of every member of one group as they are emitted, plus read-only
texts (the prompt, which responses often restate, and the group's stored drafts with their rejected
suffixes), indexed by their n-grams; a member whose last tokens occurred in any of them is offered
what followed that occurrence. Members decoded in lockstep are rarely ahead of each other, so most of
the first epoch's proposals come from the prompt and from members that ran ahead (they accepted
proposals, or were decoded in an earlier batch). This works where the history index has nothing (the
first epoch, a new prompt).

:class:`DraftSources` is the proposer of one decoding row: it asks its history proposer
(:class:`~spec_rl.drafts.history.SuffixProposer`, earlier epochs) and the group's sibling tokens, keeps the
longer proposal, and tracks the row's per-token acceptance for the step-width choice
(:mod:`spec_rl.backends.step_cost`). Proposals are only ever proposals: a token is
kept when the policy's keyed sample equals it, so they change the number of decode steps, never a token.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

from .history import in_vocab_prefix, matched_prefix

__all__ = ["DraftSources", "SiblingTokens"]

#: Longest n-gram a lookup matches (a longer match predicts the continuation better); the shortest is 2.
LONGEST_MATCH = 4


class SiblingTokens:
    """The responses of one group's members while they are decoded (and read-only texts), n-gram indexed.

    Only bigrams are indexed (one dict entry per token: this runs for every emitted token of every row);
    a lookup walks the occurrences of the member's last bigram, newest first, and extends each match
    backwards to up to :data:`LONGEST_MATCH` tokens.

    Args:
        texts: read-only token lists the members may copy from (the prompt, the group's stored drafts).
    """

    def __init__(self, texts: Sequence[Sequence[int]] = ()):
        self.seqs: dict[object, list[int]] = {}
        self.index: dict[tuple[int, int], list[tuple[object, int]]] = {}  # bigram -> (member, index of its 2nd token)
        for i, text in enumerate(texts):
            self.extend(("text", i), text)

    def extend(self, member: object, tokens: Sequence[int]) -> None:
        """Append ``tokens`` to ``member``'s sequence and index the bigrams that end in them."""
        seq = self.seqs.setdefault(member, [])
        index = self.index
        for t in tokens:
            t = int(t)
            if seq:
                index.setdefault((seq[-1], t), []).append((member, len(seq)))
            seq.append(t)

    def continuation(self, member: object, k: int) -> tuple[list[int], int]:
        """Up to ``k`` tokens that followed the longest n-gram ending ``member``'s sequence elsewhere.

        Returns (tokens, n): the most recent occurrence with a continuation, of the longest order n that
        has one ([] and 0 when none does). An occurrence at the member's own end is skipped.

        Raises:
            TypeError: ``k`` is not an integer (a bool, a float).
        """
        try:
            count = operator.index(k) if not isinstance(k, bool) else None
        except TypeError:
            count = None
        if count is None:
            raise TypeError(f"k must be an integer count of tokens, got {k!r}")
        k = count
        seq = self.seqs.get(member, [])
        if len(seq) < 2 or k <= 0:
            return [], 0
        longest = min(LONGEST_MATCH, len(seq))
        best, best_n = None, 0
        for other, end in reversed(self.index.get((seq[-2], seq[-1]), ())):
            text = self.seqs[other]
            if (other == member and end >= len(seq) - 1) or end + 1 >= len(text):
                continue  # its own end, or nothing followed it yet
            n = 2
            while n < longest and end >= n and text[end - n] == seq[-1 - n]:
                n += 1
            if n > best_n:  # newest first: a later occurrence replaces only with a longer match
                best, best_n = text[end + 1 : end + 1 + k], n
                if n == longest:
                    break
        return (best, best_n) if best is not None else ([], 0)


class DraftSources:
    """One decoding row's proposer: the longer of its history proposal and its siblings' (module docstring).

    Args:
        history: the row's :class:`~spec_rl.drafts.history.SuffixProposer`, or None.
        siblings: its group's :class:`SiblingTokens`, or None.
        member: its key in ``siblings``.
        prefix: the response so far (already extended into ``siblings`` by the caller).
        vocab_size: proposals stop before an id outside [0, vocab_size).
    """

    def __init__(self, history, siblings: SiblingTokens | None, member: object, vocab_size: int | None = None):
        self.history, self.siblings, self.member = history, siblings, member
        self.vocab_size = vocab_size
        self.accepted = 0  # proposed tokens kept
        self.tested = 0  # proposed tokens checked: the kept ones and the first miss
        self._from_history = False  # whether the last proposal was the history proposer's

    def propose(self, limit: int, fill: int = 0) -> list[int]:
        """Up to ``limit`` proposed tokens (``fill``: as :meth:`SuffixProposer.propose`)."""
        if limit <= 0:
            return []
        out = self.history.propose(limit, fill) if self.history is not None else []
        self._from_history = bool(out)
        if self.siblings is not None and len(out) < limit:
            tokens, _ = self.siblings.continuation(self.member, limit)
            if len(tokens) > len(out):
                out, self._from_history = tokens, False
        return in_vocab_prefix(out, self.vocab_size)

    def update(self, proposal: Sequence[int], emitted: Sequence[int]) -> None:
        """Feed the tokens emitted this step; ``proposal`` is what was fed after the pending token."""
        kept = matched_prefix(proposal, emitted)
        self.accepted += kept
        self.tested += kept + (1 if kept < len(proposal) and kept < len(emitted) else 0)
        if self.history is not None:  # its statistics learn from its own proposals only
            self.history.update(proposal if self._from_history else [], emitted)
        if self.siblings is not None:
            self.siblings.extend(self.member, emitted)

    def acceptance(self) -> float:
        """Estimated probability that the next proposed token is kept (uniform prior; 1/2 with no record)."""
        return (self.accepted + 1.0) / (self.tested + 2.0)
