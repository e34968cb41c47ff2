"""Per-sample speculative rollout against an inference server (vLLM, SGLang), framework-neutral.

A sample takes a scoring request (prompt + draft with ``prompt_logprobs``) and, unless the draft is reused whole, a
continuation after the verified prefix on the same server, whose prefix cache then holds prompt + y_<n (SPEC-RL
Alg. 1). A server returns no samples at prompt positions, so the token at the rejection comes from the continuation."""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable, Sequence

import torch

from ..acceptance.dispatch import VerifyOptions, verify_logprobs
from ..acceptance.mode import ADAPTER_MODE, RolloutMode
from ..drafts.cache import DraftStore
from ..rollout.sample import Sample, look_up
from ..sampling.distribution import SamplingSettings
from ..sampling.philox import mix_seed
from ..util.validation import check_choice, check_int
from .exact import MAX_RESIDUAL_ATTEMPTS, draw_continuation, residual_seeds
from .request_types import Assembled, ContinuationRequest, Verified

PROMPT_LOGPROBS_MODES = ("raw", "processed")


def check_server_settings(
    settings: SamplingSettings,
    prompt_logprobs_mode: str = "raw",
    repetition_penalty: float = 1.0,
    logprobs_mode: str | None = None,
) -> None:
    """Refuse a sampling configuration whose log-probs the server cannot score faithfully (docs/integrations.md
    "Log-prob modes"): ValueError naming the setting and the fix.

    ``prompt_logprobs_mode``: "raw" (vLLM: its ``prompt_logprobs`` come from the raw logits, which cannot be rescaled
    to temperature or top-k/top-p without the whole logit vector, so only temperature 1 without them passes) or
    "processed" (for a server known to apply them). ``repetition_penalty`` must be 1: the scoring prefill does not
    apply it. ``logprobs_mode``: the server's mode for sampled-token log-probs (vLLM's), None if unknown; logits
    modes fail."""
    check_choice("prompt_logprobs_mode", prompt_logprobs_mode, PROMPT_LOGPROBS_MODES)
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


def adapter_mode(mode: RolloutMode | str) -> RolloutMode:
    """``mode`` (or the mode it names) as an adapter runs it. ValueError for a bad name or a rule that needs the old
    policy's weights (the residual draw: spec-rl's own trainer keeps them, the adapters do not)."""
    mode = RolloutMode.parse(mode)
    if mode.rule is not None and mode.rule.needs_old_policy:
        raise ValueError(
            f"mode {mode.rule.describe()} needs the weights of the policy that sampled each draft, which the "
            "trainer adapters do not keep; use it with spec-rl's own trainer (spec-rl train, GRPOTrainer), or "
            "choose the policy or without-draft draw (e.g. mode='l=1-excl')"
        )
    return mode


def server_mode(mode: RolloutMode | str) -> RolloutMode:
    """:func:`adapter_mode` as a server runs it: without tail speculation. ValueError for coupled keys: a server
    samples with its own generator, not spec-rl's keys by position."""
    mode = adapter_mode(mode)
    if mode.rule is not None and mode.rule.shared_keys:
        raise ValueError(
            f"mode {mode.rule.describe()} decodes under spec-rl's keys by position, and a rollout server samples with "
            "its own generator; use it with spec-rl's own trainer or the TRL adapter, or choose exact (lossless) or "
            "a lenient rule here, with the trainer's rollout correction"
        )
    return dataclasses.replace(mode, tail=0)


class SpecRequestBuilder:
    """Builds and interprets the per-sample requests of a speculative rollout (docs/integrations.md "verl").

    Args:
        settings: sampling settings; ``settings.max_tokens`` is the response length in tokens.
        max_model_len: the server's context limit (prompt + response tokens).
        mode: how drafts are reused, a RolloutMode or its name; its tail speculation does not apply on a server.
        seed: run seed; per-step seeds are ``mix_seed(seed, step)``.
        prompt_logprobs_mode, repetition_penalty, logprobs_mode: checked by :func:`check_server_settings`.
        seed_param: the server's per-request seed parameter: "seed" (vLLM) or "sampling_seed" (SGLang).
        max_resample_attempts: continuation attempts at one rejection (exact acceptance, without-draft draw).

    Raises ValueError for unusable settings, max_resample_attempts < 1, max_model_len < 2, empty eos_ids or a mode
    name that names no mode."""

    def __init__(
        self,
        store: DraftStore,
        settings: SamplingSettings,
        max_model_len: int,
        eos_ids: Sequence[int],
        mode: RolloutMode | str = ADAPTER_MODE,
        seed: int = 0,
        prompt_logprobs_mode: str = "raw",
        repetition_penalty: float = 1.0,
        logprobs_mode: str | None = None,
        seed_param: str = "seed",
        max_resample_attempts: int = MAX_RESIDUAL_ATTEMPTS,
    ) -> None:
        check_server_settings(settings, prompt_logprobs_mode, repetition_penalty, logprobs_mode)
        check_int("max_resample_attempts", max_resample_attempts, low=1)
        check_int("max_model_len", max_model_len, low=2)
        if not eos_ids:
            raise ValueError("eos_ids must list at least one end-of-sequence id (e.g. the tokenizer's eos_token_id)")
        self.mode = server_mode(mode)
        self.rule = self.mode.rule
        self.seed_param = str(seed_param)
        self.max_resample_attempts = int(max_resample_attempts)
        self.store = store
        self.settings = settings
        self.max_model_len = int(max_model_len)
        self.eos_ids = {int(x) for x in eos_ids}
        self.seed = int(seed)

    def plan(self, prompt_ids: Sequence[int], slot: int, dataset_id: str | None = None) -> Sample:
        """Look up the draft of one sample (none when the mode reuses none); ValueError for an empty prompt or one that
        leaves no room for a response."""
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("prompt_ids is empty")
        budget = self.settings.budget(len(prompt), self.max_model_len, "prompt_ids")
        sample = Sample.make(prompt, slot, dataset_id, budget)
        # Servers need max_tokens >= 1, so the scoring request needs one free position after the draft; a draft
        # cut for that room is a prefix, whatever it was.
        room = self.max_model_len - len(prompt) - 1
        look_up([sample], self.store, self.settings, self.mode, self.eos_ids, room=lambda _: room)
        return sample

    def scoring_sampling_params(self, base: dict) -> dict:
        """Scoring request's sampling parameters: base + prompt_logprobs=0, max_tokens=1, logprobs."""
        return {**base, "prompt_logprobs": 0, "max_tokens": 1, "logprobs": True}

    def draft_logprobs_from_rows(
        self, plan: Sample, rows: Sequence, row_ids: Sequence | None = None, first_row_position: int = 1
    ) -> list[float]:
        """lp_new of the R draft tokens (floats), picked out of a server's per-position prompt log-probs.

        ``rows[j]`` scores the token at position ``first_row_position + j`` (a float or a one-element list; verl drops
        position 0, which has no context); ``row_ids``, if given, are checked against the draft. Raises ValueError for
        too few rows or other tokens than the draft."""
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

    def verify(
        self,
        plan: Sample,
        new_logprobs: Sequence[float] | None,
        step: int | None = None,
        scoring_sample: tuple[Sequence[int], Sequence[float] | None] | None = None,
    ) -> Verified:
        """Run the acceptance test (SPEC-RL Alg. 1) on one sample; the verified prefix starts its response.

        ``new_logprobs``: R floats, lp_new of the draft tokens (None without a draft). ``scoring_sample``: (token ids,
        log-probs) the scoring request generated; when every token is accepted but the draft is not a whole response,
        that token is a sample of pi_t at the next position and is kept as the first new token (no extra request).
        Raises ValueError for a missing or mismatched ``new_logprobs`` and the errors of
        :func:`spec_rl.acceptance.dispatch.verify_logprobs` (NaN, positive log-probs)."""
        # The step that seeds the uniforms: the server's weight version if known, else the draft's version + 1 (0
        # without a draft), so a prompt's uniforms change every time it comes back.
        draft_step = plan.draft.version + 1 if plan.draft is not None else 0
        step_used = int(step) if step is not None else draft_step
        if not plan.draft_ids:
            return Verified(0, False, step_used)
        if new_logprobs is None or len(new_logprobs) != len(plan.draft_ids):
            got = None if new_logprobs is None else len(new_logprobs)
            raise ValueError(f"new_logprobs must hold {len(plan.draft_ids)} values (one per draft token), got {got}")
        ids = torch.tensor([plan.draft_ids], dtype=torch.int64)
        old = torch.tensor([plan.old_logprobs], dtype=torch.float32)
        new = torch.tensor([list(new_logprobs)], dtype=torch.float32)
        uids = torch.tensor([plan.key.uid], dtype=torch.int64)
        options = VerifyOptions(self.mode, backend="reference")
        res = verify_logprobs(ids, old, new, seed=mix_seed(self.seed, step_used), uids=uids, options=options)
        n = int(res.accepted_len[0])
        behaviour = torch.tensor([plan.draft_behaviour], dtype=torch.float32)
        kept = self.rule.kept_behaviour(new, old, behaviour, torch.tensor([len(plan.draft_ids)]))
        plan.keep(plan.draft_ids[:n], new[0, :n].tolist(), kept[0, :n].tolist(), n)
        out = Verified(n, n == len(plan.draft_ids) and plan.draft_end is not None, step_used)
        if self.rule.excludes_rejected and n < len(plan.draft_ids):
            out.rejected, out.rejected_logprob = plan.draft_ids[n], float(new[0, n])
        if not out.full_reuse and n == len(plan.draft_ids) and n < plan.budget and scoring_sample is not None:
            ids, lps = scoring_sample
            if ids and lps:  # a sample of the current policy
                plan.extend([int(ids[0])], [float(lps[0])])
                out.sampled = 1
        return out

    def continuation(self, plan: Sample, verified: Verified) -> ContinuationRequest | None:
        """The request after the verified prefix, or None when nothing is left; after a rejection that excludes y_n
        it carries y_n and one server seed per attempt (:func:`~spec_rl.integrations.exact.residual_seeds`)."""
        remaining = plan.budget - len(plan.tokens)
        sampled_eos = verified.sampled and plan.tokens[-1] in self.eos_ids
        if verified.full_reuse or sampled_eos or remaining < 1:
            return None
        request = ContinuationRequest(plan.prompt_ids + plan.tokens, remaining)
        if verified.rejected is not None:
            request.excluded, request.excluded_logprob = verified.rejected, verified.rejected_logprob
            step_seed = mix_seed(self.seed, verified.step if verified.step is not None else 0)
            request.seeds = residual_seeds(step_seed, plan.key.uid, self.max_resample_attempts)
            request.keep_last = not self.rule.lossless  # a lossless rule never keeps y_n
        return request

    def continuation_sampling_params(self, base: dict, request: ContinuationRequest, seed: int | None = None) -> dict:
        """Continuation's sampling parameters: base + max_tokens, logprobs and the seed if given."""
        params = {k: v for k, v in base.items() if k != "prompt_logprobs"}
        params.update(max_tokens=request.max_tokens, logprobs=True)
        if seed is not None:
            params[self.seed_param] = int(seed)
        return params

    def assemble(
        self,
        plan: Sample,
        verified: Verified,
        new_ids: Sequence[int] = (),
        new_logprobs: Sequence[float] | None = (),
        step: int | None = None,
        store: bool = True,
        resamples: int = 0,
        kept_excluded: bool = False,
    ) -> Assembled:
        """[y_<n, new tokens] and their log-probs, stored as the next draft unless ``store`` is False (validation).

        ``step`` is the weight version the continuation reported (used without a draft); ``resamples`` and
        ``kept_excluded`` come from :func:`~spec_rl.integrations.exact.draw_continuation` and enter the metrics.
        Raises ValueError for missing or mismatched log-probs, more tokens than the budget, a continuation that
        begins with the rejected token without ``kept_excluded``, or a ``kept_excluded`` draw_continuation cannot
        have set."""
        new_ids = [int(t) for t in new_ids]
        begins_rejected = verified.rejected is not None and new_ids[:1] == [verified.rejected]
        if kept_excluded and self.rule.lossless:
            raise ValueError(
                f"kept_excluded is only for the lenient without-draft draw; {self.rule.name} acceptance never keeps y_n"
            )
        if kept_excluded and not begins_rejected:
            raise ValueError(
                "kept_excluded=True needs a rejection with the without-draft draw and a continuation that begins with "
                "the rejected draft token; pass ContinuationRequest.kept_excluded as draw_continuation set it"
            )
        if begins_rejected and not kept_excluded:
            raise ValueError(
                f"the continuation begins with the rejected draft token {verified.rejected}; "
                "send it through spec_rl.integrations.exact.draw_continuation, which resamples it"
            )
        if new_logprobs is None:
            raise ValueError("the continuation returned no log-probs; request them (logprobs=True / logprobs=0)")
        new_lps = [float(x) for x in new_logprobs]
        if len(new_lps) != len(new_ids):
            raise ValueError(f"continuation has {len(new_ids)} tokens but {len(new_lps)} log-probs")
        length = len(plan.tokens) + len(new_ids)
        if length > plan.budget:
            raise ValueError(f"response has {length} tokens, more than the budget {plan.budget}")
        behaviour = list(new_lps)
        if new_lps and verified.rejected is not None and not kept_excluded:  # drawn without the rejected token
            excluded = torch.tensor([verified.rejected_logprob], dtype=torch.float64)
            behaviour[0] = float(self.rule.drawn_behaviour(torch.tensor([new_lps[0]]), excluded))
        plan.extend(new_ids, new_lps, behaviour)
        plan.finish = "eos" if plan.tokens and plan.tokens[-1] in self.eos_ids else "length"
        if verified.full_reuse:
            plan.finish = plan.draft_end
        version = verified.step if (step is None or plan.draft_ids) else int(step)
        if store:
            plan.store(self.store, version, self.settings)
        metrics = {
            "draft_found": plan.draft is not None,
            "draft_len": len(plan.draft_ids),
            "verified_prefix_len": plan.n,
            "full_reuse": verified.full_reuse,
            "tokens_generated": len(new_ids) + verified.sampled,
            "response_len": len(plan.tokens),
            "exact_acceptance": self.mode.rule is not None and self.rule.lossless,
            "resamples": int(resamples),
            "draw_fallbacks": int(bool(kept_excluded)),
        }
        return Assembled(plan.tokens, plan.logprobs, plan.finish, metrics, plan.behaviour)

    async def run_sample(
        self, plan: Sample, score: Callable[[Sample], Awaitable[tuple]], send: Callable[..., Awaitable[tuple]]
    ) -> tuple[Assembled, tuple | None]:
        """One planned sample's requests: scoring, :meth:`verify`, the continuation (through
        :func:`~spec_rl.integrations.exact.draw_continuation`) and :meth:`assemble` (stored).

        ``score(plan)``, awaited only with a draft, returns (lp_new of the draft, the server's weight step or None,
        the scoring request's (token ids, log-probs)); ``send(request, seed=...)`` returns (new token ids, their
        log-probs or None, weight step or None, ...). Returns the sample and what the kept ``send`` returned (None:
        nothing sent). Raises what those steps raise."""
        new_lps = step = sample = None
        if plan.scoring_ids is not None:
            new_lps, step, sample = await score(plan)
        verified = self.verify(plan, new_lps, step, scoring_sample=sample)
        cont = self.continuation(plan, verified)
        sent, resamples = await draw_continuation(cont, lambda seed: send(cont, seed=seed))
        new_ids, new_logprobs, cont_step = sent[:3] if sent is not None else ([], [], None)
        kept = cont is not None and cont.kept_excluded
        result = self.assemble(
            plan, verified, new_ids, new_logprobs or [], step=cont_step, resamples=resamples, kept_excluded=kept
        )
        return result, sent
