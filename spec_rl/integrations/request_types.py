"""The per-sample records of a speculative rollout against a server (:mod:`spec_rl.integrations.requests`); the
sample itself is a :class:`spec_rl.rollout.sample.Sample`."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Verified:
    """What the acceptance test decided for one sample (its verified prefix starts the sample's response)."""

    n: int  # rejection index (draft tokens kept), 0 without a draft
    full_reuse: bool  # the draft is kept whole and is a whole response today: nothing to generate
    step: int | None  # seeds the uniforms; stored as the draft's version
    sampled: int = 0  # 1 when the scoring request's sampled token was kept
    rejected: int | None = None  # y_n when the token at the rejection must differ from it
    rejected_logprob: float | None = None  # its lp_new


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
