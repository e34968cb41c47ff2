"""The per-sample records of a speculative rollout against a server (:mod:`spec_rl.integrations.requests`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..drafts.cache import CacheKey, Draft


@dataclass
class SamplePlan:
    """What to do for one sample, before any request."""

    key: CacheKey  # prompt ids, slot, dataset id
    prompt_ids: list[int]
    budget: int  # min(response_length, max_model_len - len(prompt)) tokens
    draft: Draft | None = None  # None: no draft, an empty one, or reuse off
    #: The part valid under today's budget and EOS set (spec_rl.drafts.validity), cut so that prompt + draft + one
    #: generated token fit max_model_len.
    draft_ids: list[int] = field(default_factory=list)
    old_logprobs: list[float] = field(default_factory=list)
    behaviour: list[float] = field(default_factory=list)  # the draft's behaviour log-probs (docs/design.md)
    draft_end: str | None = None  # "eos"/"length": draft_ids are a whole response today; None: a prefix

    @property
    def scoring_ids(self) -> list[int] | None:
        """Token ids of the scoring request (prompt + draft), or None without a draft."""
        return self.prompt_ids + self.draft_ids if self.draft_ids else None


@dataclass
class Verified:
    """Outcome of the acceptance test for one sample."""

    n: int  # rejection index (draft tokens kept), 0 without a draft
    prefix_ids: list[int]  # draft[:n], plus the scoring request's sampled token when it was kept
    prefix_logprobs: list[float]  # under the current weights
    full_reuse: bool  # the draft is kept whole and is a whole response today: nothing to generate
    step: int | None  # seeds the uniforms; stored as the draft's version
    sampled: int = 0  # 1 when the scoring request's sampled token was kept
    rejected: int | None = None  # y_n when the token at the rejection must differ from it
    rejected_logprob: float | None = None  # its lp_new
    prefix_behaviour: list[float] = field(default_factory=list)  # behaviour log-probs of prefix_ids


@dataclass
class ContinuationRequest:
    """Generate up to ``max_tokens`` tokens after ``context_ids`` (= prompt + verified prefix).

    After a rejection with exact acceptance or the without-draft draw, ``excluded`` is y_n and ``seeds`` holds one
    server seed per attempt: send it through :func:`~spec_rl.integrations.exact.draw_continuation`. ``keep_last``
    (lenient only) lets that keep the last attempt when all began with y_n, setting ``kept_excluded``."""

    context_ids: list[int]
    max_tokens: int
    excluded: int | None = None
    excluded_logprob: float | None = None
    seeds: list[int] = field(default_factory=list)
    keep_last: bool = False
    kept_excluded: bool = False


@dataclass
class Assembled:
    """The sample's response (tokens, current and behaviour log-probs) and its per-sample metrics."""

    response_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    metrics: dict
    behaviour_logprobs: list[float] = field(default_factory=list)
