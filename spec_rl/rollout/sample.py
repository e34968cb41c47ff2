"""One response being made (docs/design.md "Data flow of one step"): its request, its draft and the part of it still
valid today, what was kept of it, and the response so far with its current and behaviour log-probs. The rollout step
(:mod:`.speculative`) and the servers' request builder (:mod:`spec_rl.integrations.requests`) both drive it:
:meth:`Sample.make`, :func:`look_up`, :meth:`Sample.keep`, :meth:`Sample.extend`, :meth:`Sample.store`."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

from ..acceptance.mode import RolloutMode
from ..drafts.cache import CacheKey, Draft, DraftStore, next_age
from ..drafts.validity import draft_views
from ..sampling.distribution import SamplingSettings


@dataclass
class Sample:
    """``key`` (prompt ids, slot, dataset id), ``prompt_ids``, ``budget``: tokens it may have. ``draft``: the stored
    draft it reuses (None: none, empty, dropped or reuse off) and its valid part today: ``draft_ids``,
    ``old_logprobs`` (the stored log-probs), ``draft_behaviour`` and ``draft_end`` ("eos"/"length": a whole response
    today; None: a prefix). The response: ``tokens`` with ``logprobs`` (current policy) and ``behaviour`` (the path
    that produced each token), ``n`` the verified prefix length, ``finish``. A rollout keeps the row whose draft holds
    the prefix (``source``), the draft tokens whose K/V are kept (``kv_len``) and the prompt's history key
    (``group_key``)."""

    key: CacheKey
    prompt_ids: list[int]
    budget: int
    draft: Draft | None = None
    draft_ids: list[int] = field(default_factory=list)
    old_logprobs: list[float] = field(default_factory=list)
    draft_behaviour: list[float] = field(default_factory=list)
    draft_end: str | None = None
    dropped: bool = False
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    behaviour: list[float] = field(default_factory=list)
    n: int = 0
    finish: str | None = None
    source: int = 0
    kv_len: int = 0
    group_key: bytes | None = None

    @classmethod
    def make(cls, prompt_ids: Sequence[int], slot: int, dataset_id: str | None, budget: int) -> Sample:
        return cls(CacheKey.make(prompt_ids, slot, dataset_id), [int(t) for t in prompt_ids], int(budget))

    @property
    def scoring_ids(self) -> list[int] | None:
        """Token ids of a scoring pass (prompt + draft), or None without a draft."""
        return self.prompt_ids + self.draft_ids if self.draft_ids else None

    def keep(self, tokens: Sequence[int], logprobs: Sequence[float], behaviour: Sequence[float], n: int) -> None:
        """Start the response with the verified prefix (``n`` draft tokens) and what follows it so far."""
        self.tokens, self.logprobs, self.behaviour, self.n = list(tokens), list(logprobs), list(behaviour), int(n)

    def extend(self, tokens: Sequence[int], logprobs: Sequence[float], behaviour: Sequence[float] | None = None):
        """Append generated tokens; their behaviour log-probs are their own unless given."""
        self.tokens += list(tokens)
        self.logprobs += list(logprobs)
        self.behaviour += list(logprobs if behaviour is None else behaviour)

    def store(self, store: DraftStore, version: int, settings: SamplingSettings) -> None:
        """The response as next epoch's draft of this sample, with its age."""
        finish = self.finish or "length"
        age = next_age(self.draft, self.n)
        store.store(self.key, self.tokens, self.logprobs, finish, version, settings, age, self.behaviour)


def look_up(
    samples: Sequence[Sample],
    store: DraftStore,
    settings: SamplingSettings,
    mode: RolloutMode,
    eos_ids: Collection[int],
    usable: Callable[[Draft], bool] = lambda draft: True,
    room: Callable[[Sample], int] | None = None,
) -> None:
    """Each sample's draft from ``store`` (none when ``mode`` reuses none), cut to what today's budget and EOS set
    make a response (docs/design.md "Draft validity") and to ``room(sample)`` tokens when given. A draft past the
    mode's age bound, or not ``usable`` (the residual draw: its weights are gone), is dropped (``dropped``): its
    slot samples fresh. An empty draft counts as none."""
    if not mode.reuses_drafts:
        return
    found = []
    for s in samples:
        draft = store.lookup(s.key, settings)
        if draft is not None and (mode.draft_expired(draft.age) or not usable(draft)):
            s.dropped = True
        elif draft is not None and len(draft):
            s.draft = draft
            found.append(s)
    views = draft_views([s.draft.token_ids for s in found], [s.budget for s in found], eos_ids)
    for s, view in zip(found, views):
        cut = view.length if room is None else min(view.length, room(s))
        s.draft_ids = s.draft.token_ids[:cut].tolist()
        s.old_logprobs = s.draft.logprobs[:cut].tolist()
        s.draft_behaviour = s.draft.behaviour[:cut].tolist()
        s.draft_end = view.finish_reason if cut == view.length else None
