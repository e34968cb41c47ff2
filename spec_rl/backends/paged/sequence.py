"""Sequence state of the paged engine: contexts waiting for prefill, sequences holding blocks, scored rows kept between
score and continue_from."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from ..base import Continuation


class GroupMember(NamedTuple):
    result_index: int  # position in the caller's result list
    budget: int  # tokens to sample (>= 1)


@dataclass
class PrefillGroup:
    """A context waiting for prefill and its members; ``reprefill``: it was evicted once."""

    context: list[int]
    members: list[GroupMember]
    reprefill: bool = False

    def split(self) -> list[PrefillGroup]:
        return [PrefillGroup(list(self.context), [m], self.reprefill) for m in self.members]


@dataclass
class SequenceState:
    """A sequence holding blocks; the next step writes ``pending_token``'s K/V; ``context`` allows a re-prefill."""

    seq_id: int
    result_index: int
    budget: int
    pending_token: int | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    context: list[int] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, token: int, logprob: float, eos_ids: set[int]) -> None:
        """Record one sampled token; finish on an EOS id or when the budget runs out."""
        self.token_ids.append(token)
        self.logprobs.append(logprob)
        self.budget -= 1
        self.pending_token = token
        if token in eos_ids:
            self.finish_reason = "eos"
        elif self.budget <= 0:
            self.finish_reason = "length"

    def continuation(self) -> Continuation:
        return Continuation(self.token_ids, self.logprobs, self.finish_reason)

    def as_reprefill(self) -> PrefillGroup:
        """The group that prefills this evicted sequence again (context plus pending token)."""
        member = GroupMember(self.result_index, self.budget)
        return PrefillGroup(self.context + [self.pending_token], [member], reprefill=True)


@dataclass
class ScoredSequences:
    """The engine's state of a :class:`~spec_rl.backends.base.Scored`: each row's sequence in the cache (None once
    evicted or taken), valid for one continue_from in the same ``epoch``."""

    seq_ids: list[int | None]
    epoch: int = 0


def empty_continuation() -> Continuation:
    return Continuation([], [], "length")


def group_by_context(jobs: Sequence, indices, results: list[Continuation | None]) -> list[PrefillGroup]:
    """The fresh ``jobs[i]`` (i in ``indices``) grouped by identical context in first-seen order; zero budgets are
    answered at once."""
    groups: dict[tuple[int, ...], PrefillGroup] = {}
    for i in indices:
        job = jobs[i]
        if job.budget == 0:
            results[i] = empty_continuation()
            continue
        key = tuple(job.context)
        if key not in groups:
            groups[key] = PrefillGroup(list(key), [])
        groups[key].members.append(GroupMember(i, int(job.budget)))
    return list(groups.values())
