"""Sequence state of the paged engine: what waits for prefill, what decodes, what a scoring pass keeps.

Three kinds of state travel between the scheduler and the model runner
(docs/design.md "Paged KV cache"):

- :class:`PrefillGroup`: a context not yet in the cache, with the members that
  continue it. The G samples of a group share one context, so it is prefilled
  once and forked.
- :class:`SequenceState`: a sequence that holds blocks in the cache and is
  being decoded (or waits to be, after :meth:`PagedEngine.continue_from`).
- :class:`SpliceHandle`: rows scored by :meth:`PagedEngine.score_drafts` whose
  K/V stay in the cache until they are continued or released.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from ..backends.protocol import Continuation


class GroupMember(NamedTuple):
    """One continuation of a group's context."""

    result_index: int  # position in the caller's result list
    budget: int  # tokens to sample (>= 1)


@dataclass
class PrefillGroup:
    """A context waiting for prefill and the members that continue it.

    Attributes:
        context: token ids to prefill (prompt, maybe a verified prefix and a first token).
        members: one :class:`GroupMember` per sequence forked from the context.
        reprefill: the context was in the cache once and had to be evicted; its
            prefill is counted in ``EngineStats.reprefill_tokens``.
    """

    context: list[int]
    members: list[GroupMember]
    reprefill: bool = False

    def split(self) -> list[PrefillGroup]:
        """One single-member group per member, in order (when the whole group cannot run at once)."""
        return [PrefillGroup(list(self.context), [m], self.reprefill) for m in self.members]


@dataclass
class SequenceState:
    """One sequence that holds blocks in the paged cache.

    Attributes:
        seq_id: the sequence's id in the block manager.
        result_index: position in the caller's result list.
        budget: tokens still to sample.
        pending_token: the last sampled (or given) token, whose K/V is not written yet;
            the next decode step feeds it.
        token_ids, logprobs: what was sampled so far and its sampling log-probs.
        finish_reason: None while decoding, then "eos" or "length".
        context: tokens in the cache, kept for resumed sequences only so that they
            can be prefilled again if their blocks must be given up.
    """

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
        """The group that prefills this (evicted) sequence again: its context plus the pending token."""
        member = GroupMember(self.result_index, self.budget)
        return PrefillGroup(self.context + [self.pending_token], [member], reprefill=True)


@dataclass
class SpliceHandle:
    """Scored sequences kept in the paged cache between score_drafts and continue_from.

    Attributes:
        prompts, drafts: the scored rows.
        seq_ids: block-manager ids of the rows (None where the row's K/V had to be evicted).
        epoch: engine epoch at scoring time (a handle is valid for one continue_from).
        used: set once the handle was continued or released.
    """

    prompts: list[list[int]]
    drafts: list[list[int]]
    seq_ids: list[int | None]
    epoch: int
    used: bool = False


def empty_continuation() -> Continuation:
    """The result of a zero budget: no token, finish reason "length"."""
    return Continuation([], [], "length")


def group_by_context(
    contexts: Sequence[Sequence[int]],
    budgets: Sequence[int],
    results: list[Continuation | None],
    names: tuple[str, str] = ("contexts", "budgets"),
    offset: int = 0,
) -> list[PrefillGroup]:
    """Validate contexts and budgets and group identical contexts, in first-seen order.

    Parameters
    ----------
    contexts, budgets:
        one token-id list (non-empty) and one integer budget (>= 0) per request.
    results:
        the caller's result list; request i is stored at ``offset + i``. A zero
        budget is answered here with an empty "length" continuation.
    names:
        argument names for the error messages.

    Returns
    -------
    list[PrefillGroup]
        one group per distinct context, members in request order.

    Raises
    ------
    ValueError
        a budget that is not an integer >= 0, or an empty context.
    """
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
