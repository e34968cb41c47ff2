"""The per-sample records of a speculative rollout against a server (see :mod:`spec_rl.integrations.requests`).

:class:`SamplePlan` (before any request), :class:`Verified` (after the acceptance test),
:class:`ContinuationRequest` (what to generate after the verified prefix) and :class:`Assembled`
(the response, its log-probs and per-sample metrics).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..drafts.cache import CacheKey, Draft

__all__ = ["Assembled", "ContinuationRequest", "SamplePlan", "Verified"]


@dataclass
class SamplePlan:
    """What to do for one sample, before any request.

    Attributes:
        key: cache key (prompt ids, slot, dataset id).
        prompt_ids: the prompt's token ids.
        budget: min(response_length, max_model_len - len(prompt)) tokens.
        draft: the cached draft, or None (no draft, empty draft, or reuse off).
        draft_ids: the draft tokens that will be scored: its valid part under today's budget and
            EOS set (:mod:`spec_rl.drafts.validity`), cut so that prompt + draft + 1 generated token
            fits max_model_len.
        old_logprobs: their stored log-probs (float32).
        draft_end: "eos" / "length" when ``draft_ids`` are a whole response today (reused whole if
            all accepted), None when they are a prefix only (decoding continues after them).
    """

    key: CacheKey
    prompt_ids: list[int]
    budget: int
    draft: Draft | None = None
    draft_ids: list[int] = field(default_factory=list)
    old_logprobs: list[float] = field(default_factory=list)
    draft_end: str | None = None

    @property
    def scoring_ids(self) -> list[int] | None:
        """Token ids of the scoring request (prompt + draft), or None when there is no draft."""
        return self.prompt_ids + self.draft_ids if self.draft_ids else None


@dataclass
class Verified:
    """Outcome of the acceptance test for one sample.

    Attributes:
        n: rejection index (tokens of the draft kept), 0 without a draft.
        prefix_ids: draft[:n], plus the scoring request's sampled token when
            it directly follows the accepted tokens (see :meth:`SpecRequestBuilder.verify`).
        prefix_logprobs: their log-probs under the current weights.
        full_reuse: the scored draft is kept whole and is a whole response today: nothing to generate.
        step: training step used for the seed and stored as the version.
        sampled: 1 when the scoring request's sampled token was kept, else 0.
        rejected: with exact acceptance or the without-draft draw: the draft token y_n rejected at n
            (the continuation's first token must differ from it), else None.
        rejected_logprob: its lp_new (None without a rejection).
    """

    n: int
    prefix_ids: list[int]
    prefix_logprobs: list[float]
    full_reuse: bool
    step: int | None
    sampled: int = 0
    rejected: int | None = None
    rejected_logprob: float | None = None


@dataclass
class ContinuationRequest:
    """Generate up to ``max_tokens`` tokens after ``context_ids`` (= prompt + verified prefix).

    After a rejection with exact acceptance or the without-draft draw, ``excluded`` is the rejected draft token y_n and
    ``seeds`` the server seed of each attempt: send it through
    :func:`~spec_rl.integrations.exact.draw_continuation`, which resends while the first new
    token is y_n (the residual draw; module docstring).

    ``keep_last`` (the lenient without-draft draw) lets ``draw_continuation`` keep the last attempt when every
    attempt began with y_n (the paper's draw at n, which may give y_n) instead of raising; it then sets
    ``kept_excluded``. Exact acceptance never keeps one: a draw that may give y_n there is not lossless.
    """

    context_ids: list[int]
    max_tokens: int
    excluded: int | None = None
    excluded_logprob: float | None = None
    seeds: list[int] = field(default_factory=list)
    keep_last: bool = False
    kept_excluded: bool = False


@dataclass
class Assembled:
    """The sample's response (tokens, log-probs) and its per-sample metrics."""

    response_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    metrics: dict
