"""Sequence state of the paged engine: contexts waiting for prefill, sequences holding blocks, scored rows kept between
score_drafts and continue_from."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from ..backends.protocol import Continuation


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
class SpliceHandle:
    """Scored rows kept in the cache (``seq_ids[i]`` None once evicted); valid for one continue_from."""

    prompts: list[list[int]]
    drafts: list[list[int]]
    seq_ids: list[int | None]
    epoch: int
    used: bool = False


def empty_continuation() -> Continuation:
    return Continuation([], [], "length")


def group_by_context(
    contexts: Sequence[Sequence[int]],
    budgets: Sequence[int],
    results: list[Continuation | None],
    names: tuple[str, str] = ("contexts", "budgets"),
    offset: int = 0,
) -> list[PrefillGroup]:
    """Identical contexts grouped in first-seen order (results at ``offset + i``; zero budgets answered at once);
    ValueError for a bad budget or an empty context."""
    cname, bname = names
    groups: dict[tuple[int, ...], PrefillGroup] = {}
    for i, (ctx, budget) in enumerate(zip(contexts, budgets)):
        if int(budget) != budget or budget < 0:
            raise ValueError(f"{bname}[{i}] = {budget} must be an integer >= 0")
        if len(ctx) == 0:
            raise ValueError(f"{cname}[{i}] is empty; a context needs at least one token (the prompt)")
        if budget == 0:
            results[offset + i] = empty_continuation()
            continue
        key = tuple(int(t) for t in ctx)
        if key not in groups:
            groups[key] = PrefillGroup(list(key), [])
        groups[key].members.append(GroupMember(offset + i, int(budget)))
    return list(groups.values())
