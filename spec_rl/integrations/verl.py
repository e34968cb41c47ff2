"""verl agent loop that rolls out speculatively (SPEC-RL, arXiv 2509.23232).

verl (>= 0.9) generates through agent loops: each sample of a batch runs
``AgentLoopBase.run(sampling_params, **row)`` in an agent-loop worker (a Ray
actor; many per job, spread over nodes) against the rollout servers (vLLM or
SGLang) through ``server_manager.generate(request_id, prompt_ids=...,
sampling_params=...)``, which returns a ``TokenOutput`` (token_ids, log_probs,
extra_fields). Loops are registered by name (``@register``) or listed in the
YAML file named by ``actor_rollout_ref.rollout.agent.agent_loop_config_path``;
``actor_rollout_ref.rollout.agent.default_agent_loop`` (or a per-row
``agent_name`` column) selects one.

:class:`SpecRLAgentLoop` (registered as ``"spec_rl_agent"``) does, per sample,
what :mod:`spec_rl.integrations.requests` describes: draft lookup -> one
scoring request (prompt + draft, ``prompt_logprobs=0``, ``max_tokens=1``) ->
verify -> one continuation request (prompt + verified prefix,
``max_tokens`` = remaining budget) -> assemble -> store. Both requests use one
request id, so verl's sticky routing sends them to the same server and the
continuation's prefill is a prefix-cache hit.

Where its inputs come from (read in verl 0.9.1's source):

* prompt ids: ``ct_build_initial_tokens(raw_prompt)``, as the single-turn loop;
* the sample slot: the row's ``priority``, which ``AgentLoopManager``
  sets to the row's position in the batch *before* splitting it between
  workers; the trainer repeats each prompt ``rollout.n`` times with
  ``interleave=True``, so slot = priority mod n. (verl's ``rollout_n`` in
  the trajectory info counts equal consecutive ``index`` values and collapses
  when the dataset has no index, since verl then passes 0 for every row; it is
  not used.) A ``spec_rl_slot`` column, if present, overrides it;
* the dataset id: ``data_source`` and ``extra_info.index`` (or ``index``);
  keys also hold the prompt token ids, so rows with index 0 never collide;
* the training step (Philox seed, draft version): the scoring response's
  ``extra_fields["global_steps"]`` (vLLM/SGLang servers report the step of
  the weights they hold); without it, the draft's version + 1.

With ``acceptance: exact`` the continuation after a rejection carries a
per-attempt sampling seed (``seed`` for vLLM; ``sampling_seed`` when the
rollout's ``name`` is ``sglang``; it overrides the seed verl injects under
``full_determinism``) and is resent while its first token is the rejected
draft token: the residual draw of :mod:`spec_rl.integrations.exact`, exact,
at 1 / (1 - p) continuation requests per rejection on average.

The cache is a :class:`~spec_rl.drafts.directory.DirectoryDraftStore`
(one file per draft, atomic renames) on a directory every worker can reach.
Validation batches and greedy rows (sampling parameters that differ from the
training settings) are generated plainly and never touch the cache.

Configure it with an agent-loop YAML (see docs/integrations.md):

.. code-block:: yaml

    - name: spec_rl_agent
      _target_: spec_rl.integrations.verl.SpecRLAgentLoop
      cache_dir: /shared/spec_rl_drafts
      lenience: 1.6487
      acceptance: lenient   # or exact (lossless; no lenience then)
"""

from __future__ import annotations

import os
from functools import partial
from typing import Any
from uuid import uuid4

from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopOutput, _agent_loop_registry, register
from verl.utils.profiler import simple_timer

from ..acceptance.mode import mode_from_options
from ..drafts.directory import DirectoryDraftStore
from ..sampling.distribution import SamplingSettings
from .exact import MAX_RESIDUAL_ATTEMPTS, draw_continuation
from .requests import ContinuationRequest, SpecRequestBuilder

AGENT_NAME = "spec_rl_agent"
CACHE_DIR_ENV = "SPEC_RL_DRAFT_DIR"

# One store object per directory per process: agent loops are instantiated per sample.
_STORES: dict[str, DirectoryDraftStore] = {}


def _store_for(path: str) -> DirectoryDraftStore:
    key = os.path.abspath(path)
    if key not in _STORES:
        _STORES[key] = DirectoryDraftStore(key)
    return _STORES[key]


def _cfg(config: Any, name: str, default: Any = None) -> Any:
    """Read a field of a DictConfig or dataclass config."""
    if hasattr(config, "get"):
        try:
            return config.get(name, default)
        except Exception:
            pass
    return getattr(config, name, default)


def settings_from_rollout_config(rollout_config: Any) -> SamplingSettings:
    """Sampling settings of verl's ``actor_rollout_ref.rollout`` (top_k -1 = off -> 0; max_tokens = response_length)."""
    top_k = int(_cfg(rollout_config, "top_k", -1) or 0)
    return SamplingSettings(
        temperature=float(_cfg(rollout_config, "temperature", 1.0)),
        top_p=float(_cfg(rollout_config, "top_p", 1.0)),
        top_k=0 if top_k < 0 else top_k,
        max_tokens=int(_cfg(rollout_config, "response_length")),
    )


def slot_of(row: dict, n: int) -> int:
    """The sample's index within its group (see the module docstring).

    Raises:
        ValueError: the row has neither ``spec_rl_slot`` nor ``priority``.
    """
    if "spec_rl_slot" in row:
        return int(row["spec_rl_slot"])
    if "priority" not in row:
        raise ValueError(
            "cannot tell the sample's slot within its group: the row has no 'priority' (set by verl's "
            "AgentLoopManager) and no 'spec_rl_slot' column; add a spec_rl_slot column"
        )
    return int(row["priority"]) % max(int(n), 1)


def dataset_id_of(row: dict) -> str:
    """data_source and dataset index of a row ("" / 0 when absent)."""
    extra = row.get("extra_info") or {}
    index = row.get("index", extra.get("index", 0) if hasattr(extra, "get") else 0)
    return f"{row.get('data_source', '')}:{index}"


class SpecRLAgentLoop(AgentLoopBase):
    """Single-turn agent loop with speculative rollouts.

    Args (besides verl's own, which it passes to ``AgentLoopBase``; set them in
    the agent-loop YAML):
        cache_dir: draft directory shared by all workers (default: the
            ``SPEC_RL_DRAFT_DIR`` environment variable).
        lenience: l (default e^0.5, the paper's GRPO setting); 0 rejects every draft token.
        seed: run seed of the acceptance uniforms.
        strategy: "spec", "random" (random-reuse ablation) or "off" (the baseline: every
            response generated whole by this same loop and stored; no draft is read).
        prompt_logprobs_mode: "raw" (vLLM: temperature must be 1, no top-k/top-p)
            or "processed"; see :mod:`spec_rl.integrations.requests`.
        eos_token_ids: EOS ids (default: the tokenizer's eos_token_id).
        acceptance: "lenient" (the paper's rule) or "exact" (lossless; leave lenience unset).
            strategy, acceptance, lenience and rejection_draw name a
            :class:`~spec_rl.acceptance.mode.RolloutMode` (:func:`~spec_rl.acceptance.mode.mode_from_options`).
        max_resample_attempts: continuation attempts at one rejection (exact, without-draft draw).
        rejection_draw: the token at a lenient rejection: "policy" (the paper's) or "without-draft"
            (pi_t without the rejected draft token, by resending the continuation; l >= 1;
            :class:`~spec_rl.integrations.requests.SpecRequestBuilder`).

    Raises:
        ValueError: no cache directory, or a rollout configuration whose log-probs
            cannot be compared (temperature != 1 with raw prompt logprobs, top-k,
            top-p, repetition penalty, a logits ``logprobs_mode``), a lenience
            with ``acceptance="exact"``, or a rejection_draw the lenient rule cannot take,
            raised when the first sample's loop is built.
    """

    def __init__(
        self,
        *args,
        cache_dir: str | None = None,
        lenience: float | None = None,
        seed: int = 0,
        strategy: str = "spec",
        prompt_logprobs_mode: str = "raw",
        eos_token_ids: list[int] | None = None,
        acceptance: str = "lenient",
        max_resample_attempts: int = MAX_RESIDUAL_ATTEMPTS,
        rejection_draw: str = "policy",
        **kwargs,
    ):
        super().__init__(*args, **kwargs)
        rc = self.rollout_config
        self.response_length = int(_cfg(rc, "response_length"))
        self.n = int(_cfg(rc, "n", 1) or 1)
        self.settings = settings_from_rollout_config(rc)
        max_model_len = _cfg(rc, "max_model_len") or int(_cfg(rc, "prompt_length")) + self.response_length
        cache_dir = cache_dir or os.environ.get(CACHE_DIR_ENV)
        if not cache_dir:
            raise ValueError(
                f"{AGENT_NAME} needs a draft directory shared by all agent-loop workers: set cache_dir in the "
                f"agent-loop YAML or the {CACHE_DIR_ENV} environment variable"
            )
        if eos_token_ids is None:
            eos = getattr(self.tokenizer, "eos_token_id", None)
            eos_token_ids = [eos] if isinstance(eos, int) else list(eos or [])
        self.builder = SpecRequestBuilder(
            _store_for(str(cache_dir)),
            self.settings,
            int(max_model_len),
            eos_token_ids,
            mode_from_options(
                strategy, acceptance, None if lenience is None else float(lenience), rejection_draw, tail=False
            ),
            seed=int(seed),
            prompt_logprobs_mode=prompt_logprobs_mode,
            repetition_penalty=float(_cfg(rc, "repetition_penalty", 1.0) or 1.0),
            logprobs_mode=_cfg(rc, "logprobs_mode", None),
            seed_param="sampling_seed" if str(_cfg(rc, "name", "vllm")).lower() == "sglang" else "seed",
            max_resample_attempts=max_resample_attempts,
        )

    def _is_training_request(self, sampling_params: dict[str, Any]) -> bool:
        """True when the request samples with the training settings (not validation or greedy)."""
        top_k = int(sampling_params.get("top_k", -1) or 0)
        return (
            float(sampling_params.get("temperature", 1.0)) == self.settings.temperature
            and float(sampling_params.get("top_p", 1.0)) == self.settings.top_p
            and (0 if top_k < 0 else top_k) == self.settings.top_k
        )

    async def run(self, sampling_params: dict[str, Any], **kwargs) -> AgentLoopOutput:
        messages = list(kwargs["raw_prompt"])
        mm = await self.process_multi_modal_info(messages)
        if mm:
            raise ValueError(f"{AGENT_NAME} supports text prompts only; use single_turn_agent for multimodal data")
        prompt_ids = await self.ct_build_initial_tokens(messages)
        request_id = uuid4().hex
        base = {k: v for k, v in sampling_params.items() if k not in ("max_tokens", "max_new_tokens")}
        metrics: dict[str, float] = {}
        extra: dict[str, Any] = {}

        if not self._is_training_request(sampling_params):
            with simple_timer("generate_sequences", metrics):
                out = await self.server_manager.generate(
                    request_id=request_id, prompt_ids=prompt_ids, sampling_params=dict(sampling_params)
                )
            return self._output(prompt_ids, list(out.token_ids), out.log_probs, metrics, extra)

        b = self.builder
        with simple_timer("generate_sequences", metrics):
            plan = b.plan(prompt_ids, slot_of(kwargs, self.n), dataset_id_of(kwargs))
            step = new_lps = sample = None
            if plan.scoring_ids is not None:
                scored = await self.server_manager.generate(
                    request_id=request_id, prompt_ids=plan.scoring_ids, sampling_params=b.scoring_sampling_params(base)
                )
                fields = scored.extra_fields or {}
                if "prompt_logprobs" not in fields:
                    raise RuntimeError(
                        "the rollout server returned no prompt_logprobs for the scoring request; spec_rl_agent needs "
                        "verl's vLLM or SGLang server (which pass prompt_logprobs through)"
                    )
                new_lps = b.draft_logprobs_from_rows(plan, fields["prompt_logprobs"], fields.get("prompt_ids"))
                step = fields.get("global_steps")
                sample = (list(scored.token_ids), scored.log_probs)
            verified = b.verify(plan, new_lps, step, scoring_sample=sample)
            cont = b.continuation(plan, verified)
            send = partial(self._continue, request_id, base, cont)  # send(seed)
            (new_ids, cont_lps, cont_step), resamples = await draw_continuation(cont, send, nothing=([], [], None))
            result = b.assemble(
                plan,
                verified,
                new_ids,
                cont_lps or [],
                step=cont_step,
                resamples=resamples,
                kept_excluded=cont is not None and cont.kept_excluded,
            )
        extra.update({f"spec_rl/{k}": v for k, v in result.metrics.items()})
        return self._output(prompt_ids, result.response_ids, result.logprobs, metrics, extra)

    async def _continue(self, request_id: str, base: dict, cont: ContinuationRequest, seed: int | None):
        """One continuation request (same request id: same server) -> (new ids, their log-probs, weight step)."""
        out = await self.server_manager.generate(
            request_id=request_id,
            prompt_ids=cont.context_ids,
            sampling_params=self.builder.continuation_sampling_params(base, cont, seed),
        )
        new_ids, lps = list(out.token_ids), out.log_probs
        if new_ids and lps is None:
            raise RuntimeError("the rollout server returned tokens without log_probs although logprobs=True was sent")
        return new_ids, lps, (out.extra_fields or {}).get("global_steps")

    def _output(self, prompt_ids, response_ids, logprobs, metrics, extra) -> AgentLoopOutput:
        r = self.response_length
        response_ids = list(response_ids)[:r]
        return AgentLoopOutput(
            prompt_ids=list(prompt_ids),
            response_ids=response_ids,
            response_mask=[1] * len(response_ids),
            response_logprobs=list(logprobs)[:r] if logprobs is not None else None,
            num_turns=2,
            metrics=metrics,
            extra_fields=extra,
        )


# verl's AgentLoopWorker loads the agent-loop YAML into its registry first and imports this module only
# when it instantiates the first loop; registering unconditionally would then replace the YAML's entry
# (with cache_dir, lenience, ...) by a bare one for every later sample. A configured entry is kept.
if AGENT_NAME not in _agent_loop_registry:
    register(AGENT_NAME)(SpecRLAgentLoop)
