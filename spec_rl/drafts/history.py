"""Drafts past the first rejection (docs/design.md "Tail speculation"): per-prompt suffix automata over the prompt's
earlier responses propose, at each decode step, the tokens that followed the longest suffix match (as RhymeRL/HistoSpec,
arXiv 2508.18588, and DAS, arXiv 2511.13841). Proposals depend only on the history, so exact verification is lossless.
"""

from __future__ import annotations

import itertools
import json
import os
import string
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import torch

from ..acceptance.mode import TAIL_WIDTH
from ..util.atomic import atomic_save_safetensors
from ..util.validation import as_id_vector, check_int
from .stored_files import open_stored

#: Separates responses in an automaton's text; never a token id.
SEPARATOR = -1
_FORMAT = {"format": "spec-rl-history", "format_version": "1"}
_FIX = "delete the file or restore a backup (without it speculation restarts from an empty history)"


def matched_prefix(proposal: Sequence[int], emitted: Sequence[int]) -> int:
    """How many leading proposed tokens the step emitted as they were (the accepted drafted tokens)."""
    n = 0
    while n < len(proposal) and n < len(emitted) and proposal[n] == emitted[n]:
        n += 1
    return n


class SuffixAutomaton:
    """Suffix automaton over a growing token text (Blumer et al. 1985). States are parallel lists: ``trans`` (token ->
    state), ``link`` (suffix link), ``length`` (longest string) and ``endpos`` (end of its first occurrence)."""

    def __init__(self) -> None:
        self.text: list[int] = []
        self.trans: list[dict[int, int]] = [{}]
        self.link: list[int] = [-1]
        self.length: list[int] = [0]
        self.endpos: list[int] = [-1]
        self._last = 0
        self.starts: list[int] = []  # text index where each response begins

    def __len__(self) -> int:
        return len(self.text)

    def add_response(self, tokens: Sequence[int]) -> None:
        """Append one response (and a separator) to the text."""
        if self.text:
            self._extend(SEPARATOR)
        self.starts.append(len(self.text))
        for t in tokens:
            self._extend(int(t))

    def _extend(self, c: int) -> None:
        trans, link, length, endpos = self.trans, self.link, self.length, self.endpos
        pos = len(self.text)
        self.text.append(c)
        cur = len(length)
        trans.append({})
        length.append(length[self._last] + 1)
        link.append(0)
        endpos.append(pos)
        p = self._last
        while p != -1 and c not in trans[p]:
            trans[p][c] = cur
            p = link[p]
        if p != -1:
            q = trans[p][c]
            if length[p] + 1 == length[q]:
                link[cur] = q
            else:
                clone = len(length)
                trans.append(dict(trans[q]))
                length.append(length[p] + 1)
                link.append(link[q])
                endpos.append(endpos[q])
                while p != -1 and trans[p].get(c) == q:
                    trans[p][c] = clone
                    p = link[p]
                link[q] = clone
                link[cur] = clone
        self._last = cur

    def step(self, state: int, matched: int, token: int) -> tuple[int, int]:
        """Extend a match (state, matched length) by ``token``: the longest suffix that still occurs."""
        trans, link, length = self.trans, self.link, self.length
        while state and token not in trans[state]:
            state = link[state]
            matched = length[state]
        nxt = trans[state].get(token)
        return (0, 0) if nxt is None else (nxt, matched + 1)

    def continuation(self, state: int, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the occurrence of ``state`` in the text (stops at a separator)."""
        return self.read(self.endpos[state] + 1, k)

    def read(self, start: int, k: int) -> list[int]:
        """Up to ``k`` tokens of the text from index ``start``, stopping before a separator."""
        out = self.text[start : start + k]
        return out[: out.index(SEPARATOR)] if SEPARATOR in out else out


class SuffixProposer:
    """Proposes up to k tokens for one sequence being decoded whose response so far is ``prefix``. ``k`` doubles (up to
    ``max_k``) after a step that accepted every proposed token and falls to ``accepted + 1`` otherwise; nothing is
    proposed while the match is shorter than ``min_match`` tokens; at the start of a response it proposes the start of
    the newest earlier response. Proposals stop before an id outside [0, ``vocab_size``)."""

    def __init__(
        self,
        automaton: SuffixAutomaton,
        prefix: Sequence[int] = (),
        max_k: int = TAIL_WIDTH,
        min_match: int = 2,
        vocab_size: int | None = None,
    ):
        self.automaton = automaton
        self.vocab_size = vocab_size
        self.max_k = int(max_k)
        self.min_match = int(min_match)
        self.k = max(1, self.max_k // 2)
        self.state, self.matched = 0, 0
        self.at_start = len(prefix) == 0
        self.proposed = self.accepted = 0
        self.asked = 0  # the adaptive part of the last proposal
        for t in prefix[-64:]:  # a longer match than 64 tokens changes nothing in practice
            self.state, self.matched = automaton.step(self.state, self.matched, int(t))

    def propose(self, limit: int, fill: int = 0) -> list[int]:
        """Up to ``min(k, limit)`` tokens expected next ([] when nothing matches); ``fill`` asks for up to that many
        whatever k (padding positions a batched backend computes anyway), k learning only from the first k."""
        self.asked = min(self.k, int(limit))
        k = min(max(self.k, int(fill)), int(limit))
        if k <= 0:
            return []
        automaton = self.automaton
        if self.at_start:
            out = automaton.read(automaton.starts[-1], k) if automaton.starts else []
        elif self.matched < self.min_match:
            return []
        else:
            out = automaton.continuation(self.state, k)
        vocab = self.vocab_size
        return out if vocab is None else list(itertools.takewhile(lambda t: 0 <= t < vocab, out))

    def update(self, proposal: Sequence[int], emitted: Sequence[int]) -> None:
        """Feed the tokens emitted this step; ``proposal`` is what :meth:`propose` returned for it."""
        accepted = matched_prefix(proposal, emitted)
        if proposal:
            self.proposed += len(proposal)
            self.accepted += accepted
            asked = min(self.asked, len(proposal))
            self.k = min(self.max_k, 2 * self.k) if accepted >= asked else max(1, accepted + 1)
        for t in emitted:
            self.state, self.matched = self.automaton.step(self.state, self.matched, int(t))
        if emitted:
            self.at_start = False


class HistoryIndex:
    """Per-prompt suffix automata over earlier responses, bounded in memory (ValueError: a bound below 1). Prompts are
    identified by any hashable key (the rollout uses the draft key of slot 0, shared by a group). A prompt is trimmed to
    its newest ``max_responses`` responses and ``max_tokens`` tokens once it holds twice either (its automaton is then
    rebuilt); past ``max_prompts`` prompts the least recently used goes. Responses are kept as int32 arrays (at most
    about ``2 * max_prompts * max_tokens`` tokens, 4 bytes each); an automaton (about 0.5 KB a token: Python states)
    is built when its prompt is drafted from, and the least recently used are dropped past ``max_automaton_tokens``
    tokens in all (a proposer keeps the one it reads). Without that bound a GSM8K-size run would build every prompt's
    automaton in epoch 2: about 14 GB per epoch of responses at SmolLM2's default recipe."""

    def __init__(
        self,
        max_responses: int = 16,
        max_tokens: int = 8192,
        max_prompts: int = 16384,
        max_automaton_tokens: int = 2**19,
    ):
        self.max_responses = check_int("max_responses", max_responses, low=1)
        self.max_tokens = check_int("max_tokens", max_tokens, low=1)
        self.max_prompts = check_int("max_prompts", max_prompts, low=1)
        self.max_automaton_tokens = check_int("max_automaton_tokens", max_automaton_tokens, low=1)
        self._responses: OrderedDict[bytes, list[array]] = OrderedDict()
        self._automata: OrderedDict[bytes, SuffixAutomaton] = OrderedDict()
        self._automaton_tokens = 0  # len(text) summed over _automata

    def __len__(self) -> int:
        return len(self._responses)

    def num_tokens(self) -> int:
        return sum(len(r) for rs in self._responses.values() for r in rs)

    def update(self, other: HistoryIndex) -> None:
        """Index every response of ``other`` (e.g. one just loaded from disk), oldest first."""
        for key, responses in other._responses.items():
            for r in responses:
                self.add(key, r)

    def add(self, key: bytes, response: Sequence[int]) -> None:
        """Index one more response of prompt ``key`` (evicting past the bounds); one it already holds is skipped.
        TypeError: non-integer ids; ValueError: not 1-D or outside [0, 2**31) (a negative id reads as a separator)."""
        tokens = array("i", as_id_vector("response", response).tolist())
        rs = self._responses.setdefault(key, [])
        self._responses.move_to_end(key)
        if tokens in rs:
            return
        rs.append(tokens)
        # Trim only at twice the bounds, so the rebuild it costs is rare.
        if len(rs) > 2 * self.max_responses or sum(len(r) for r in rs) > 2 * self.max_tokens:
            while len(rs) > 1 and (len(rs) > self.max_responses or sum(len(r) for r in rs) > self.max_tokens):
                rs.pop(0)
            self._drop_automaton(key)  # rebuilt from what is left on next use
        elif key in self._automata:
            automaton = self._automata[key]
            before = len(automaton)
            automaton.add_response(tokens)
            self._automaton_tokens += len(automaton) - before
            self._evict_automata(keep=key)
        while len(self._responses) > self.max_prompts:
            old, _ = self._responses.popitem(last=False)
            self._drop_automaton(old)

    def automaton(self, key: bytes) -> SuffixAutomaton | None:
        """The automaton of prompt ``key`` (built on first use), or None when it has no history."""
        rs = self._responses.get(key)
        if not rs:
            return None
        automaton = self._automata.get(key)
        if automaton is None:
            automaton = SuffixAutomaton()
            for r in rs:
                automaton.add_response(r)
            self._automata[key] = automaton
            self._automaton_tokens += len(automaton)
        self._automata.move_to_end(key)
        self._evict_automata(keep=key)
        return automaton

    def automaton_tokens(self) -> int:
        """Tokens held by the built automata (at most ``max_automaton_tokens`` beyond the newest one)."""
        return self._automaton_tokens

    def _drop_automaton(self, key: bytes) -> None:
        automaton = self._automata.pop(key, None)
        if automaton is not None:
            self._automaton_tokens -= len(automaton)

    def _evict_automata(self, keep: bytes) -> None:
        """Drop the least recently used automata past the bound, never ``keep`` (the one in use)."""
        while self._automaton_tokens > self.max_automaton_tokens and len(self._automata) > 1:
            oldest = next(iter(self._automata))
            if oldest == keep:
                self._automata.move_to_end(keep)
                continue
            self._drop_automaton(oldest)

    def proposer(
        self, key: bytes, prefix: Sequence[int] = (), max_k: int = TAIL_WIDTH, vocab_size: int | None = None
    ) -> SuffixProposer | None:
        """A :class:`SuffixProposer` for a sequence of prompt ``key``, or None when the prompt has no history."""
        automaton = self.automaton(key)
        return None if automaton is None else SuffixProposer(automaton, prefix, max_k=max_k, vocab_size=vocab_size)

    def save(self, path: str | os.PathLike) -> Path:
        """Write every prompt's responses (not the automata) to one safetensors file, atomically."""
        keys = list(self._responses)
        flat = [r for k in keys for r in self._responses[k]]
        counts = torch.tensor([len(self._responses[k]) for k in keys], dtype=torch.int64)
        lengths = torch.tensor([len(r) for r in flat], dtype=torch.int64)
        tokens = torch.tensor([t for r in flat for t in r], dtype=torch.int64)
        meta = {**_FORMAT, "keys": json.dumps([k.hex() for k in keys])}
        return atomic_save_safetensors(path, {"counts": counts, "lengths": lengths, "tokens": tokens}, meta)

    @classmethod
    def load(cls, path: str | os.PathLike, vocab_size: int | None = None, **bounds) -> HistoryIndex:
        """Read a file written by :meth:`save` into a new index with ``bounds``, checking all of it first; token ids
        must lie in [0, ``vocab_size``) when given, else in the int32 range. FileNotFoundError: no file; ValueError:
        not a spec-rl history file, or damaged (one error naming the file and the problem)."""
        index = cls(**bounds)
        check = open_stored(path, "history index", _FORMAT, _FIX, vocab_size)
        what = "a JSON list of hex strings (one per prompt)"
        hex_keys = check.json_field("keys", list, what)
        bad = [k for k in hex_keys if not isinstance(k, str) or len(k) % 2 or not set(k) <= set(string.hexdigits)]
        if bad:
            raise check.fail(f"metadata 'keys' must be {what}, got {bad[0]!r}")
        keys = [bytes.fromhex(k) for k in hex_keys]
        check.unique("keys", keys)
        counts = check.tensor("counts", torch.int64, (len(keys),))
        lengths = check.tensor("lengths", torch.int64, (None,))
        tokens = check.tensor("tokens", torch.int64, (None,))
        check.non_negative("counts", counts)
        check.non_negative("lengths", lengths)
        if int(counts.sum()) != lengths.numel() or int(lengths.sum()) != tokens.numel():
            raise check.fail("response counts and lengths do not match the stored tokens (damaged file)")
        check.token_ids("tokens", tokens)
        owners = [key for key, count in zip(keys, counts.tolist()) for _ in range(count)]
        for key, response in zip(owners, tokens.split(lengths.tolist())):
            index.add(key, response)
        return index
