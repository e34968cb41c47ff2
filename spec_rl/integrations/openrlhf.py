"""OpenRLHF agent executor with speculative rollouts (SPEC-RL, arXiv 2509.23232; docs/integrations.md "OpenRLHF").

OpenRLHF passes ``execute`` no sample index, step or dataset id: the slot is the call count per prompt mod n (it
starts a prompt's n calls in order), the seed step the draft's version + 1, and drafts are keyed by prompt and slot."""

from __future__ import annotations

import inspect
from collections import defaultdict
from collections.abc import Callable
from copy import deepcopy
from functools import partial
from typing import Any

from openrlhf.utils.agent import AgentExecutorBase

from ..acceptance.mode import ADAPTER_MODE, RolloutMode
from ..backends.base import eos_token_ids
from ..drafts.directory import DirectoryDraftStore
from ..drafts.owner import policy_owner
from ..sampling.distribution import SamplingSettings
from .exact import MAX_RESIDUAL_ATTEMPTS
from .requests import ContinuationRequest, Sample, SpecRequestBuilder, server_mode


def request_params(sampling_params: Any, response_tokens_before: int, **changes: Any) -> Any:
    """A copy of the run's vLLM ``SamplingParams`` for a request that starts ``response_tokens_before`` tokens into the
    response, with ``changes`` set.

    Two fields need more than a copy: ``skip_reading_prefix_cache`` is set as the constructor sets it for
    ``prompt_logprobs`` (cached prompt positions would come back as garbage rows), and ``min_tokens``, which vLLM
    counts from the start of each request, becomes ``max(0, min_tokens - response_tokens_before)``."""
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
    """Log-prob of ``token`` from one vLLM position entry ({token_id: Logprob} or a float)."""
    value = entry[token] if isinstance(entry, dict) else entry
    return float(getattr(value, "logprob", value))


class SpecRLAgentExecutor(AgentExecutorBase):
    """Single-turn OpenRLHF executor that reuses last epoch's responses as drafts.

    Args:
        cache_dir: draft directory shared by every vLLM engine actor.
        n_samples_per_prompt: must equal the run's ``--rollout.n_samples_per_prompt`` (slots depend on it).
        reward_fn: ``(prompt, response_text, label) -> float``, sync or async (OpenRLHF's remote reward model is off
            with ``agent_func_path``).
        mode: a RolloutMode or its name (default ``spec``; ``exact``: lossless; ``l=1``, ...; tail speculation does not
            apply).
        prompt_logprobs_mode: "raw" (vLLM: temperature 1, no top-k/top-p) or "processed".
        eos_token_ids: EOS ids (default: the tokenizer's eos_token_id).

    Raises ValueError for n_samples_per_prompt < 1 or a name that names no mode; at ``execute``, for settings whose
    log-probs cannot be scored (:func:`~spec_rl.integrations.requests.check_server_settings`) or images."""

    def __init__(
        self,
        cache_dir: str,
        n_samples_per_prompt: int,
        reward_fn: Callable | None = None,
        mode: RolloutMode | str = ADAPTER_MODE,
        seed: int = 0,
        prompt_logprobs_mode: str = "raw",
        eos_token_ids: list[int] | None = None,
        max_resample_attempts: int = MAX_RESIDUAL_ATTEMPTS,
    ) -> None:
        if int(n_samples_per_prompt) != n_samples_per_prompt or n_samples_per_prompt < 1:
            raise ValueError(
                f"n_samples_per_prompt must be an integer >= 1 (the run's value), got {n_samples_per_prompt!r}"
            )
        self.store = DirectoryDraftStore(cache_dir)
        self.n = int(n_samples_per_prompt)
        self.reward_fn = reward_fn
        self.mode = server_mode(mode)
        self.seed = int(seed)
        self.prompt_logprobs_mode = prompt_logprobs_mode
        self.eos_token_ids = eos_token_ids
        self.max_resample_attempts = max_resample_attempts
        self._calls: dict[str, int] = defaultdict(int)
        self._builders: dict[tuple, SpecRequestBuilder] = {}

    def _builder(self, sampling_params: Any, max_length: int, hf_tokenizer: Any) -> SpecRequestBuilder:
        settings = SamplingSettings(
            temperature=float(sampling_params.temperature),
            top_p=float(getattr(sampling_params, "top_p", 1.0)),
            top_k=max(int(getattr(sampling_params, "top_k", -1) or 0), 0),
            max_tokens=int(getattr(sampling_params, "max_tokens", None) or max_length),
        )
        key = (settings, int(max_length))
        if key not in self._builders:
            if self.store.owner is None and callable(getattr(hf_tokenizer, "get_vocab", None)):
                self.store.claim(policy_owner(hf_tokenizer))  # DraftOwnerError: the directory holds another's drafts
            eos = self.eos_token_ids if self.eos_token_ids is not None else sorted(eos_token_ids(None, hf_tokenizer))
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
        b: SpecRequestBuilder, sampling_params, llm_engine, plan: Sample
    ) -> tuple[list[float], None, tuple[list[int], list[float]] | None]:
        """The scoring request -> (lp_new of the draft, no weight step, the token sampled after it)."""
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
        return new_lps, None, sample

    @staticmethod
    async def _continue(
        cont: ContinuationRequest, n_prompt: int, sampling_params, llm_engine, seed: int | None = None
    ) -> tuple[list[int], list[float], None, bool]:
        """The continuation request -> (new tokens, their log-probs, no weight step, stopped at max_tokens)."""
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
        lps = [_token_logprob(e, t) for e, t in zip(out.logprobs, new_ids)]
        return new_ids, lps, None, out.finish_reason == "length"

    async def execute(self, prompt, label, sampling_params, max_length: int, hf_tokenizer, llm_engine, images=None):
        # Before any await: the n calls of one prompt start in order (module docstring).
        slot = self._calls[prompt] % self.n
        self._calls[prompt] += 1
        if images:
            raise ValueError("SpecRLAgentExecutor supports text prompts only")
        b = self._builder(sampling_params, max_length, hf_tokenizer)
        prompt_ids = hf_tokenizer(text=prompt, add_special_tokens=False)["input_ids"]
        room = max_length - b.settings.max_tokens if getattr(sampling_params, "max_tokens", None) else max_length - 1
        prompt_ids = list(prompt_ids)[-max(room, 1) :]  # keep room for the response, as OpenRLHF does
        plan = b.plan(prompt_ids, slot)
        score = partial(self._score, b, sampling_params, llm_engine)
        send = partial(self._continue, n_prompt=len(prompt_ids), sampling_params=sampling_params, llm_engine=llm_engine)
        result, sent = await b.run_sample(plan, score, send)
        truncated = sent[3] if sent is not None else result.finish_reason == "length"
        response = result.response_ids
        output = {
            "prompt": prompt,
            "label": label,
            "images": images,
            "mm_train_inputs": None,
            "observation_tokens": prompt_ids + response,
            "action_ranges": [(len(prompt_ids), len(prompt_ids) + len(response))],
            "rollout_log_probs": (
                [0.0] * len(prompt_ids) + result.behaviour_logprobs if sampling_params.logprobs is not None else None
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
