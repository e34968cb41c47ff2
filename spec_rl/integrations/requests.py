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

Deviation from the in-process rollout (:mod:`spec_rl.rollout.speculative`): the token at
the rejection point is sampled by the continuation request (one re-prefill
of prompt + y_<n, mostly a prefix-cache hit), not from the scoring pass,
because a server returns log-probs of prompt tokens, not samples at them.
With the paper's (lenient, default) rule that token comes from pi_t, not from
the residual of exact speculative sampling.

**Exact acceptance** (``acceptance="exact"``, docs/design.md "Exact
acceptance"): accept y_i iff ``log u_i <= lp_new_i``; the token at a rejection
n must come from the residual, pi_t without y_n renormalised. The server
samples the continuation from pi_t, so the residual is drawn by rejection
resampling: the continuation carries a per-attempt sampling seed (``seed``
for vLLM, ``sampling_seed`` for SGLang: ``seed_param``), and when its first
token is y_n it is sent again under the next seed, at most
``max_resample_attempts`` times. A draw of pi_t conditioned on "first token
!= y_n" is exactly a residual token followed by a fresh continuation, so the
response is a fresh sample of pi_t. It costs 1 / (1 - pi_t(y_n))
continuation requests per rejection on average (one extra request per
accepted draft token, averaged over the test); :mod:`spec_rl.integrations.exact`
gives the numbers and the failure bound.

**Log-prob mode.** The rule compares log-probs of the *sampling*
distribution; vLLM's prompt log-probs are raw, so with
``prompt_logprobs_mode="raw"`` (the default) temperature must be 1 with no
top-k/top-p (:mod:`spec_rl.integrations.server_checks` explains why and
checks it at construction).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..acceptance.dispatch import VerifyOptions, verify_logprobs
from ..acceptance.mode import MODES, RolloutMode
from ..drafts.cache import CacheKey, DraftStore
from ..drafts.validity import draft_view
from ..sampling.distribution import SamplingSettings
from ..sampling.philox import mix_seed
from .exact import MAX_RESIDUAL_ATTEMPTS, residual_seeds
from .request_types import Assembled, ContinuationRequest, SamplePlan, Verified
from .server_checks import PROMPT_LOGPROBS_MODES, check_server_settings

__all__ = [
    "PROMPT_LOGPROBS_MODES",
    "Assembled",
    "ContinuationRequest",
    "SamplePlan",
    "SpecRequestBuilder",
    "Verified",
    "check_server_settings",
]


class SpecRequestBuilder:
    """Builds and interprets the per-sample requests of a speculative rollout.

    Args:
        store: a draft store (:class:`spec_rl.drafts.cache.RolloutCache` or
            :class:`spec_rl.drafts.directory.DirectoryDraftStore`).
        settings: sampling settings; ``settings.max_tokens`` is the
            response length (trainer's max response tokens).
        max_model_len: context limit of the server (prompt + response tokens).
        eos_ids: the model's EOS ids (used to record the finish reason).
        mode: how drafts are reused (:func:`~spec_rl.acceptance.mode.mode_from_options` reads the adapters'
            options); with exact acceptance or the without-draft draw the token at a rejection is drawn by
            resending the continuation while it begins with the rejected token. No tail speculation on a server.
        seed: run seed; per-step seeds are ``mix_seed(seed, step)``.
        prompt_logprobs_mode, repetition_penalty, logprobs_mode: see
            :func:`check_server_settings` (checked here, at construction).
        seed_param: name of the per-request sampling seed in the server's sampling
            parameters: "seed" (vLLM) or "sampling_seed" (SGLang).
        max_resample_attempts: continuation attempts at one rejection (exact acceptance, without-draft draw).

    Raises:
        ValueError: unusable settings (see :func:`check_server_settings`), max_model_len < 2, empty eos_ids.
    """

    def __init__(
        self,
        store: DraftStore,
        settings: SamplingSettings,
        max_model_len: int,
        eos_ids: Sequence[int],
        mode: RolloutMode = MODES["spec"],
        seed: int = 0,
        prompt_logprobs_mode: str = "raw",
        repetition_penalty: float = 1.0,
        logprobs_mode: str | None = None,
        seed_param: str = "seed",
        max_resample_attempts: int = MAX_RESIDUAL_ATTEMPTS,
    ) -> None:
        check_server_settings(settings, prompt_logprobs_mode, repetition_penalty, logprobs_mode)
        if not isinstance(mode, RolloutMode):
            raise TypeError(f"mode must be a RolloutMode, got {type(mode).__name__}")
        if (
            isinstance(max_resample_attempts, bool)
            or int(max_resample_attempts) != max_resample_attempts
            or max_resample_attempts < 1
        ):
            raise ValueError(f"max_resample_attempts must be an integer >= 1, got {max_resample_attempts!r}")
        if int(max_model_len) != max_model_len or max_model_len < 2:
            raise ValueError(f"max_model_len must be an integer >= 2, got {max_model_len!r}")
        if not eos_ids:
            raise ValueError("eos_ids must list at least one end-of-sequence id (e.g. the tokenizer's eos_token_id)")
        self.mode = mode
        self.seed_param = str(seed_param)
        self.max_resample_attempts = int(max_resample_attempts)
        self.store = store
        self.settings = settings
        self.max_model_len = int(max_model_len)
        self.eos_ids = {int(x) for x in eos_ids}
        self.seed = int(seed)

    @property
    def _excludes_rejected(self) -> bool:
        """Whether the token at a rejection must differ from the rejected draft token."""
        return self.mode.acceptance == "exact" or (
            self.mode.acceptance == "lenient" and self.mode.rejection_draw == "without-draft"
        )

    # ------------------------------------------------------------ step 1
    def plan(self, prompt_ids: Sequence[int], slot: int, dataset_id: str | None = None) -> SamplePlan:
        """Look up the draft of one sample (none when the mode reuses none).

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
        if not self.mode.reuses_drafts:
            return plan
        draft = self.store.lookup(key, self.settings)
        if draft is None or len(draft) == 0:
            return plan
        # Only the part valid under today's budget and EOS set is reused (spec_rl.drafts.validity). The
        # scoring request generates one token (servers need max_tokens >= 1), so it needs one free
        # position after the draft: a draft cut for that room is a prefix, whatever it was.
        view = draft_view(draft.token_ids, budget, self.eos_ids)
        cut = min(view.length, self.max_model_len - len(prompt) - 1)
        plan.draft = draft
        plan.draft_end = view.finish_reason if cut == view.length else None
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

        With exact acceptance or the without-draft draw a rejection at n < R records the rejected
        token (``Verified.rejected``) for :meth:`continuation`.

        Raises:
            ValueError: a draft without ``new_logprobs``, a length mismatch, or the
                errors of :func:`spec_rl.acceptance.dispatch.verify_logprobs` (NaN, positive log-probs).
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
        options = VerifyOptions.for_mode(self.mode, backend="reference")
        res = verify_logprobs(
            ids,
            old,
            new,
            seed=mix_seed(self.seed, step_used),
            uids=torch.tensor([plan.key.uid], dtype=torch.int64),
            options=options,
        )
        n = int(res.accepted_len[0])
        full = n == len(plan.draft_ids) and plan.draft_end is not None
        out = Verified(n, plan.draft_ids[:n], [float(x) for x in new[0, :n].tolist()], full, step_used)
        if self._excludes_rejected and n < len(plan.draft_ids):
            out.rejected, out.rejected_logprob = plan.draft_ids[n], float(new[0, n])  # the continuation avoids it
        if not full and n == len(plan.draft_ids) and n < plan.budget and scoring_sample is not None:
            ids, lps = scoring_sample
            if ids and lps:
                out.prefix_ids.append(int(ids[0]))
                out.prefix_logprobs.append(float(lps[0]))
                out.sampled = 1
        return out

    # ------------------------------------------------------------ step 3
    def continuation(self, plan: SamplePlan, verified: Verified) -> ContinuationRequest | None:
        """The generation request after the verified prefix, or None when nothing is left to generate.

        After a rejection with exact acceptance or the without-draft draw it carries the token to exclude and one server seed
        per attempt (:func:`~spec_rl.integrations.exact.residual_seeds` of the step seed and uid).
        """
        if verified.full_reuse:
            return None
        if verified.sampled and verified.prefix_ids[-1] in self.eos_ids:
            return None
        remaining = plan.budget - len(verified.prefix_ids)
        if remaining < 1:
            return None
        request = ContinuationRequest(plan.prompt_ids + verified.prefix_ids, remaining)
        if verified.rejected is not None:
            request.excluded, request.excluded_logprob = verified.rejected, verified.rejected_logprob
            step_seed = mix_seed(self.seed, verified.step if verified.step is not None else 0)
            request.seeds = residual_seeds(step_seed, plan.key.uid, self.max_resample_attempts)
            request.keep_last = self.mode.acceptance != "exact"
        return request

    def continuation_sampling_params(self, base: dict, request: ContinuationRequest, seed: int | None = None) -> dict:
        """Sampling parameters of the continuation: base + max_tokens (remaining budget) + logprobs (+ the seed)."""
        params = {k: v for k, v in base.items() if k != "prompt_logprobs"}
        params.update(max_tokens=request.max_tokens, logprobs=True)
        if seed is not None:
            params[self.seed_param] = int(seed)
        return params

    def _check_kept_excluded(self, verified: Verified, new_ids: list[int]) -> None:
        """``kept_excluded`` only where draw_continuation can set it: a without-draft rejection whose kept
        continuation begins with the rejected token (else the draw_fallbacks metric would count a fallback
        that did not happen)."""
        if self.mode.acceptance == "exact":
            raise ValueError(
                "kept_excluded is only for the lenient without-draft draw; exact acceptance never keeps y_n"
            )
        if verified.rejected is None or not new_ids or new_ids[0] != verified.rejected:
            raise ValueError(
                "kept_excluded=True needs a rejection with the without-draft draw and a continuation that begins with "
                "the rejected draft token; pass ContinuationRequest.kept_excluded as draw_continuation set it"
            )

    # ------------------------------------------------------------ step 4
    def assemble(
        self,
        plan: SamplePlan,
        verified: Verified,
        new_ids: Sequence[int] = (),
        new_logprobs: Sequence[float] | None = (),
        step: int | None = None,
        store: bool = True,
        resamples: int = 0,
        kept_excluded: bool = False,
    ) -> Assembled:
        """[y_<n, new tokens] with their log-probs; stores it as the next draft.

        Args:
            new_ids / new_logprobs: the continuation's tokens and sampling
                log-probs (empty when the draft was reused whole).
            step: the weight version the continuation reported, if any
                (used when the scoring request did not report one).
            store: write the result to the store (False for validation).
            resamples: continuation attempts discarded because they began with
                the rejected token (exact acceptance, without-draft draw; recorded in the metrics).
            kept_excluded: the without-draft draw ran out of attempts and kept the last, which begins with
                the rejected token (``ContinuationRequest.kept_excluded``; the metric ``draw_fallbacks``).

        Raises:
            ValueError: missing or mismatched log-probs, more tokens than the budget,
                or (exact acceptance, without-draft draw) a continuation that begins with the rejected token.
        """
        new_ids = [int(t) for t in new_ids]
        if kept_excluded:
            self._check_kept_excluded(verified, new_ids)
        if verified.rejected is not None and new_ids and new_ids[0] == verified.rejected and not kept_excluded:
            raise ValueError(
                f"the continuation begins with the rejected draft token {verified.rejected}; "
                "send it through spec_rl.integrations.exact.draw_continuation, which resamples it"
            )
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
            finish = plan.draft_end
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
            "exact_acceptance": self.mode.acceptance == "exact",
            "resamples": int(resamples),
            "draw_fallbacks": int(bool(kept_excluded)),
        }
        return Assembled(response, lps, finish, metrics)
