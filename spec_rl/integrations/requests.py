"""Per-sample speculative rollout against an inference *server*, framework-neutral.

Trainers such as verl and OpenRLHF do not hand us the model: they hand us a
server (vLLM or SGLang) that takes token ids and sampling parameters and
returns tokens, their log-probs and, on request, ``prompt_logprobs`` (the
log-probability of every prompt token given the tokens before it, from one
prefill). One sample of SPEC-RL (arXiv 2509.23232, Alg. 1; docs/design.md
"The rule") then takes at most two requests:

1. :meth:`SpecRequestBuilder.plan` - look up the draft for (prompt ids, slot,
   dataset id); if there is one, the *scoring request* is prompt + draft
   with ``prompt_logprobs`` (the server returns lp_new of every draft token
   under its current weights) and one generated token (servers need >= 1).
2. :meth:`SpecRequestBuilder.verify` - the acceptance test with keyed Philox
   uniforms (seed from the training step, uid from the cache key):
   rejection index n.
3. :meth:`SpecRequestBuilder.continuation` - unless the draft was reused
   whole, the *continuation request* is prompt + y_<n with
   ``max_tokens = min(response_length, max_model_len - len(prompt)) - n``.
   Send it to the same server as the scoring request (same request id /
   sticky session) so its prefix cache already holds prompt + y_<n.
4. :meth:`SpecRequestBuilder.assemble` - [y_<n, new tokens]; log-probs are
   lp_new for the prefix and the server's sampling log-probs for the new
   part; the result is stored as the next epoch's draft.

Deviation from the in-process rollout (:mod:`spec_rl.rollout`): the token at
the rejection point is sampled by the continuation request (one re-prefill
of prompt + y_<n, mostly a prefix-cache hit), not from the scoring pass,
because a server returns log-probs of prompt tokens, not samples at them.
The paper's own deviation applies as well: that token comes from pi_t, not
from the residual of exact speculative sampling.

**Log-prob mode.** The rule compares log-probs of the *sampling*
distribution, softmax(process(logits)) with the rollout's temperature,
top-k and top-p. vLLM computes ``prompt_logprobs`` from the raw logits
(temperature and top-k/top-p are not applied; verl's distillation code says
the same: "temperature has no effect on prompt_logprobs"), whatever its
``logprobs_mode``; the sampled-token log-probs follow ``logprobs_mode``
(verl sets ``processed_logprobs``). A raw log-prob cannot be rescaled to
temperature T: log softmax(z/T)_y = z_y/T - logsumexp(z/T) needs the whole
logit vector, and the server returns one number per position. So with
``prompt_logprobs_mode="raw"`` (the default, true for vLLM) this module
refuses any temperature != 1, top-k or top-p at construction, with an error
that says so; ``"processed"`` is for a server known to apply the sampling
processing to prompt log-probs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..cache import CacheKey, Draft, DraftStore
from ..philox import mix_seed
from ..acceptance import lenience_to_log
from ..sampling import SamplingSettings
from ..verify import verify

PROMPT_LOGPROBS_MODES = ("raw", "processed")
STRATEGIES = ("spec", "random")


def check_server_settings(
    settings: SamplingSettings,
    prompt_logprobs_mode: str = "raw",
    repetition_penalty: float = 1.0,
    logprobs_mode: str | None = None,
) -> None:
    """Refuse a sampling configuration whose log-probs the server cannot score faithfully.

    Args:
        settings: the rollout's sampling settings.
        prompt_logprobs_mode: "raw" (log_softmax of the raw logits: vLLM) or
            "processed" (temperature/top-k/top-p applied).
        repetition_penalty: must be 1 (a penalty makes the sampling
            distribution depend on the tokens generated so far, which the
            scoring prefill does not reproduce).
        logprobs_mode: the server's mode for *sampled* token log-probs
            (vLLM's ``logprobs_mode``), or None if unknown. Logits modes are
            refused (they are not log-probabilities).

    Raises:
        ValueError: naming the setting and the fix.
    """
    if prompt_logprobs_mode not in PROMPT_LOGPROBS_MODES:
        raise ValueError(f"prompt_logprobs_mode must be one of {PROMPT_LOGPROBS_MODES}, got {prompt_logprobs_mode!r}")
    if prompt_logprobs_mode == "raw" and not (settings.temperature == 1.0 and settings.is_plain):
        raise ValueError(
            f"the rollout samples with temperature={settings.temperature}, top_k={settings.top_k}, "
            f"top_p={settings.top_p}, but the server's prompt_logprobs are raw (log_softmax of unscaled logits; "
            "vLLM ignores temperature/top-k/top-p for prompt logprobs), and a raw log-prob cannot be rescaled "
            "without the full logit vector. Use temperature=1.0, top_k=-1 (or 0), top_p=1.0, or set "
            "prompt_logprobs_mode='processed' only if your server applies them to prompt logprobs."
        )
    if not (isinstance(repetition_penalty, (int, float)) and float(repetition_penalty) == 1.0):
        raise ValueError(
            f"repetition_penalty={repetition_penalty!r} is not supported: the penalised distribution depends on "
            "previously generated tokens, which the scoring prefill does not apply; set it to 1.0"
        )
    if logprobs_mode is not None and logprobs_mode not in ("raw_logprobs", "processed_logprobs"):
        raise ValueError(
            f"logprobs_mode={logprobs_mode!r} returns logits, not log-probabilities; drafts need sampling "
            "log-probs: set the rollout's logprobs_mode to 'processed_logprobs'"
        )


@dataclass
class SamplePlan:
    """What to do for one sample, before any request.

    Attributes:
        key: cache key (prompt ids, slot, dataset id).
        prompt_ids: the prompt's token ids.
        budget: min(response_length, max_model_len - len(prompt)) tokens.
        draft: the cached draft, or None (no draft, empty draft, or reuse off).
        draft_ids: the draft tokens that will be scored (cut so that
            prompt + draft + 1 generated token fits max_model_len).
        old_logprobs: their stored log-probs (float32).
    """

    key: CacheKey
    prompt_ids: list[int]
    budget: int
    draft: Draft | None = None
    draft_ids: list[int] = field(default_factory=list)
    old_logprobs: list[float] = field(default_factory=list)

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
        full_reuse: the whole stored draft is kept: nothing to generate.
        step: training step used for the seed and stored as the version.
    """

    n: int
    prefix_ids: list[int]
    prefix_logprobs: list[float]
    full_reuse: bool
    step: int | None
    sampled: int = 0


@dataclass
class ContinuationRequest:
    """Generate up to ``max_tokens`` tokens after ``context_ids`` (= prompt + verified prefix)."""

    context_ids: list[int]
    max_tokens: int


@dataclass
class Assembled:
    """The sample's response (tokens, log-probs) and its per-sample metrics."""

    response_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    metrics: dict


class SpecRequestBuilder:
    """Builds and interprets the per-sample requests of a speculative rollout.

    Args:
        store: a draft store (:class:`spec_rl.cache.RolloutCache` or
            :class:`spec_rl.integrations.draft_store.DirectoryDraftStore`).
        settings: sampling settings; ``settings.max_tokens`` is the
            response length (trainer's max response tokens).
        max_model_len: context limit of the server (prompt + response tokens).
        eos_ids: the model's EOS ids (used to record the finish reason).
        lenience: l >= 0 (paper default e^0.5 for GRPO), or log_lenience.
        seed: run seed; per-step seeds are ``mix_seed(seed, step)``.
        strategy: "spec" or "random" (random-reuse ablation, paper Table 2).
        prompt_logprobs_mode, repetition_penalty, logprobs_mode: see
            :func:`check_server_settings` (checked here, at construction).

    Raises:
        ValueError: unusable settings (see :func:`check_server_settings`),
            max_model_len < 2, empty eos_ids, bad lenience or strategy.
    """

    def __init__(
        self,
        store: DraftStore,
        settings: SamplingSettings,
        max_model_len: int,
        eos_ids: Sequence[int],
        lenience: float | None = math.exp(0.5),
        log_lenience: float | None = None,
        seed: int = 0,
        strategy: str = "spec",
        prompt_logprobs_mode: str = "raw",
        repetition_penalty: float = 1.0,
        logprobs_mode: str | None = None,
    ) -> None:
        check_server_settings(settings, prompt_logprobs_mode, repetition_penalty, logprobs_mode)
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        if int(max_model_len) != max_model_len or max_model_len < 2:
            raise ValueError(f"max_model_len must be an integer >= 2, got {max_model_len!r}")
        if not eos_ids:
            raise ValueError("eos_ids must list at least one end-of-sequence id (e.g. the tokenizer's eos_token_id)")
        if log_lenience is not None:
            lenience = None
        self.log_lenience = lenience_to_log(lenience, log_lenience)
        self.store = store
        self.settings = settings
        self.max_model_len = int(max_model_len)
        self.eos_ids = {int(x) for x in eos_ids}
        self.seed = int(seed)
        self.strategy = strategy

    # ------------------------------------------------------------ step 1
    def plan(self, prompt_ids: Sequence[int], slot: int, dataset_id: str | None = None) -> SamplePlan:
        """Look up the draft of one sample.

        Raises:
            ValueError: empty prompt, or a prompt that leaves no room for a response.
        """
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("prompt_ids is empty")
        budget = self.settings.budget(len(prompt), self.max_model_len)
        if budget < 1:
            raise ValueError(
                f"prompt has {len(prompt)} tokens; max_model_len={self.max_model_len} leaves no room for a response: "
                "shorten the prompt or raise max_model_len"
            )
        key = CacheKey.make(prompt, slot, dataset_id)
        plan = SamplePlan(key=key, prompt_ids=prompt, budget=budget)
        draft = self.store.lookup(key, self.settings)
        if draft is None or len(draft) == 0:
            return plan
        # The scoring request generates one token (servers need max_tokens >= 1), so it
        # needs one free position after the draft.
        cut = min(len(draft), budget, self.max_model_len - len(prompt) - 1)
        plan.draft = draft
        plan.draft_ids = [int(t) for t in draft.token_ids[:cut].tolist()]
        plan.old_logprobs = [float(x) for x in draft.logprobs[:cut].tolist()]
        return plan

    def scoring_sampling_params(self, base: dict) -> dict:
        """Sampling parameters of the scoring request: base + prompt_logprobs=0, max_tokens=1, logprobs."""
        return {**base, "prompt_logprobs": 0, "max_tokens": 1, "logprobs": True}

    def draft_logprobs_from_rows(
        self, plan: SamplePlan, rows: Sequence, row_ids: Sequence | None = None, first_row_position: int = 1
    ) -> list[float]:
        """Pick lp_new of the draft tokens out of a server's per-position prompt log-probs.

        Args:
            plan: the sample's plan (its scoring ids were sent).
            rows: one entry per prompt position; entry j holds the log-prob of the
                token at position ``first_row_position + j`` (a float, or a
                one-element list as verl returns it). verl (vLLM and SGLang)
                drops position 0, which has no context: ``first_row_position=1``.
            row_ids: optional token ids of the same rows, checked against the draft.

        Returns:
            R floats, lp_new of draft token i (at position len(prompt) + i).

        Raises:
            ValueError: too few rows, or the server scored other tokens than the draft.
        """
        p, r = len(plan.prompt_ids), len(plan.draft_ids)
        start = p - first_row_position
        if start < 0 or len(rows) < start + r:
            raise ValueError(
                f"the server returned {len(rows)} prompt-logprob rows for {p + r} scoring tokens; expected at least "
                f"{start + r} (was prompt_logprobs=0 sent?)"
            )
        out = []
        for i in range(r):
            v = rows[start + i]
            v = v[0] if isinstance(v, (list, tuple)) else v
            if row_ids is not None:
                t = row_ids[start + i]
                t = t[0] if isinstance(t, (list, tuple)) else t
                if int(t) != plan.draft_ids[i]:
                    raise ValueError(
                        f"the server scored token {int(t)} at response position {i}, but the draft has "
                        f"{plan.draft_ids[i]} there (row alignment or tokenisation mismatch)"
                    )
            out.append(float(v))
        return out

    # ------------------------------------------------------------ step 2
    def step_for(self, plan: SamplePlan, step: int | None) -> int:
        """The training step that seeds this sample's uniforms.

        The server's weight version (verl's ``global_steps``) when known; otherwise
        the draft's stored version + 1 (0 without a draft), so a prompt's uniforms
        still change every time it comes back.
        """
        if step is not None:
            return int(step)
        return plan.draft.version + 1 if plan.draft is not None else 0

    def verify(
        self,
        plan: SamplePlan,
        new_logprobs: Sequence[float] | None,
        step: int | None = None,
        scoring_sample: tuple[Sequence[int], Sequence[float] | None] | None = None,
    ) -> Verified:
        """Run the acceptance test (SPEC-RL Alg. 1) on one sample.

        Args:
            plan: from :meth:`plan`.
            new_logprobs: R floats, lp_new of the draft tokens (None without a draft).
            step: training step / weight version (see :meth:`step_for`).
            scoring_sample: (token ids, log-probs) the scoring request generated
                after prompt + scored draft. When every scored token is accepted
                but the stored draft was longer (it was cut to leave room in the
                context), that token is a sample of pi_t at exactly the next
                position, drawn with the rollout's sampling settings, so it is
                kept as the first new token (paper Alg. 1: no extra request for
                it; docs/design.md "The rule"). Otherwise it is ignored.

        Raises:
            ValueError: a draft without ``new_logprobs``, a length mismatch, or the
                errors of :func:`spec_rl.verify.verify` (NaN, positive log-probs).
        """
        step_used = self.step_for(plan, step)
        if not plan.draft_ids:
            return Verified(0, [], [], False, step_used)
        if new_logprobs is None or len(new_logprobs) != len(plan.draft_ids):
            got = None if new_logprobs is None else len(new_logprobs)
            raise ValueError(f"new_logprobs must hold {len(plan.draft_ids)} values (one per draft token), got {got}")
        ids = torch.tensor([plan.draft_ids], dtype=torch.int64)
        old = torch.tensor([plan.old_logprobs], dtype=torch.float32)
        new = torch.tensor([list(new_logprobs)], dtype=torch.float32)
        res = verify(
            ids,
            old,
            new_logprobs=new,
            log_lenience=self.log_lenience,
            seed=mix_seed(self.seed, step_used),
            uids=torch.tensor([plan.key.uid], dtype=torch.int64),
            strategy=self.strategy,
            backend="reference",
        )
        n = int(res.accepted_len[0])
        full = n == len(plan.draft_ids) and len(plan.draft_ids) == len(plan.draft)
        out = Verified(n, plan.draft_ids[:n], [float(x) for x in new[0, :n].tolist()], full, step_used)
        if not full and n == len(plan.draft_ids) and n < plan.budget and scoring_sample is not None:
            ids, lps = scoring_sample
            if ids and lps:
                out.prefix_ids.append(int(ids[0]))
                out.prefix_logprobs.append(float(lps[0]))
                out.sampled = 1
        return out

    # ------------------------------------------------------------ step 3
    def continuation(self, plan: SamplePlan, verified: Verified) -> ContinuationRequest | None:
        """The generation request after the verified prefix, or None when nothing is left to generate."""
        if verified.full_reuse:
            return None
        if verified.sampled and verified.prefix_ids[-1] in self.eos_ids:
            return None
        remaining = plan.budget - len(verified.prefix_ids)
        if remaining < 1:
            return None
        return ContinuationRequest(plan.prompt_ids + verified.prefix_ids, remaining)

    def continuation_sampling_params(self, base: dict, request: ContinuationRequest) -> dict:
        """Sampling parameters of the continuation: base + max_tokens (remaining budget) + logprobs."""
        params = {k: v for k, v in base.items() if k != "prompt_logprobs"}
        return {**params, "max_tokens": request.max_tokens, "logprobs": True}

    # ------------------------------------------------------------ step 4
    def assemble(
        self,
        plan: SamplePlan,
        verified: Verified,
        new_ids: Sequence[int] = (),
        new_logprobs: Sequence[float] | None = (),
        step: int | None = None,
        store: bool = True,
    ) -> Assembled:
        """[y_<n, new tokens] with their log-probs; stores it as the next draft.

        Args:
            new_ids / new_logprobs: the continuation's tokens and sampling
                log-probs (empty when the draft was reused whole).
            step: the weight version the continuation reported, if any
                (used when the scoring request did not report one).
            store: write the result to the store (False for validation).

        Raises:
            ValueError: missing or mismatched log-probs, or more tokens than the budget.
        """
        new_ids = [int(t) for t in new_ids]
        if new_logprobs is None:
            raise ValueError("the continuation returned no log-probs; request them (logprobs=True / logprobs=0)")
        new_lps = [float(x) for x in new_logprobs]
        if len(new_lps) != len(new_ids):
            raise ValueError(f"continuation has {len(new_ids)} tokens but {len(new_lps)} log-probs")
        response = verified.prefix_ids + new_ids
        lps = verified.prefix_logprobs + new_lps
        if len(response) > plan.budget:
            raise ValueError(f"response has {len(response)} tokens, more than the budget {plan.budget}")
        if verified.full_reuse:
            finish = plan.draft.finish_reason
        elif response and response[-1] in self.eos_ids:
            finish = "eos"
        else:
            finish = "length"
        version = verified.step if (step is None or plan.draft_ids) else int(step)
        if store:
            self.store.store(plan.key, response, lps, finish, version, self.settings)
        metrics = {
            "draft_found": plan.draft is not None,
            "draft_len": len(plan.draft_ids),
            "verified_prefix_len": verified.n,
            "full_reuse": verified.full_reuse,
            "tokens_generated": len(new_ids) + verified.sampled,
            "response_len": len(response),
        }
        return Assembled(response, lps, finish, metrics)
