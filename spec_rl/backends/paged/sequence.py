"""Sequence state of the paged engine: contexts waiting for prefill, sequences holding blocks, scored rows kept between
score and continue_from."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from ..base import Decoding


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
class SequenceState(Decoding):
    """A sequence holding blocks; the next step writes ``last``'s K/V; ``context`` allows a re-prefill."""

    seq_id: int
    result_index: int
    context: list[int] | None = None

    def as_reprefill(self) -> PrefillGroup:
        """The group that prefills this evicted sequence again (context plus its last token)."""
        member = GroupMember(self.result_index, self.budget)
        return PrefillGroup(self.context + [self.last], [member], reprefill=True)


@dataclass
class ScoredSequences:
    """The engine's state of a :class:`~spec_rl.backends.base.Scored`: each row's sequence in the cache (None once
    evicted or taken), valid for one continue_from in the same ``epoch``."""

    seq_ids: list[int | None]
    epoch: int = 0


def group_by_context(jobs: Sequence) -> list[PrefillGroup]:
    """The fresh jobs with a budget, grouped by identical context in first-seen order."""
    groups: dict[tuple[int, ...], PrefillGroup] = {}
    for i, job in enumerate(jobs):
        if job.context is not None and job.budget > 0:
            key = tuple(job.context)
            groups.setdefault(key, PrefillGroup(list(key), [])).members.append(GroupMember(i, int(job.budget)))
    return list(groups.values())
