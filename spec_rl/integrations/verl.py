"""verl agent loop ``spec_rl_agent`` with speculative rollouts (SPEC-RL, arXiv 2509.23232; docs/integrations.md "verl").

Both requests of a sample (:mod:`spec_rl.integrations.requests`) share one request id, so verl's sticky routing sends
them to one server. Drafts live in a directory every agent-loop worker reaches; validation and greedy rows are
generated plainly and never touch it."""

from __future__ import annotations

import os
import weakref
from functools import partial
from typing import Any
from uuid import uuid4

from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopOutput, _agent_loop_registry, register
from verl.utils.profiler import simple_timer

from ..acceptance.mode import ADAPTER_MODE
from ..backends.base import eos_token_ids as tokenizer_eos_ids
from ..drafts.directory import DirectoryDraftStore
from ..drafts.owner import policy_owner
from ..sampling.distribution import SamplingSettings
from .exact import MAX_RESIDUAL_ATTEMPTS
from .requests import ContinuationRequest, Sample, SpecRequestBuilder

AGENT_NAME = "spec_rl_agent"
CACHE_DIR_ENV = "SPEC_RL_DRAFT_DIR"

# One store per directory per process: verl builds an agent loop per sample.
_STORES: dict[str, DirectoryDraftStore] = {}
# The owner tag of each tokenizer, computed once (it hashes the vocabulary).
_OWNERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _store_for(path: str, tokenizer) -> DirectoryDraftStore:
    """The process's store of ``path``, claimed for ``tokenizer``'s drafts (DraftOwnerError: another's)."""
    key = os.path.abspath(path)
    if key not in _STORES:
        _STORES[key] = DirectoryDraftStore(key)
    if callable(getattr(tokenizer, "get_vocab", None)):
        if tokenizer not in _OWNERS:
            _OWNERS[tokenizer] = policy_owner(tokenizer)
        if _STORES[key].owner != _OWNERS[tokenizer]:
            _STORES[key].claim(_OWNERS[tokenizer])
    return _STORES[key]


def _cfg(config: Any, name: str, default: Any = None) -> Any:
    """A field of a DictConfig or dataclass config."""
    if hasattr(config, "get"):
        try:
            return config.get(name, default)
        except Exception:
            pass
    return getattr(config, name, default)


def settings_from_rollout_config(rollout_config: Any) -> SamplingSettings:
    """Sampling settings of verl's ``actor_rollout_ref.rollout`` (top_k -1 -> 0; max_tokens = response_length)."""
    return SamplingSettings(
        temperature=float(_cfg(rollout_config, "temperature", 1.0)),
        top_p=float(_cfg(rollout_config, "top_p", 1.0)),
        top_k=max(int(_cfg(rollout_config, "top_k", -1) or 0), 0),
        max_tokens=int(_cfg(rollout_config, "response_length")),
    )


def slot_of(row: dict, n: int) -> int:
    """The sample's index within its group: ``spec_rl_slot`` if set, else ``priority`` mod n (verl sets ``priority`` to
    the row's position in the whole batch, and the trainer repeats each prompt n times in a row); ValueError if
    the row has neither."""
    if "spec_rl_slot" in row:
        return int(row["spec_rl_slot"])
    if "priority" not in row:
        raise ValueError(
            "cannot tell the sample's slot within its group: the row has no 'priority' (set by verl's "
            "AgentLoopManager) and no 'spec_rl_slot' column; add a spec_rl_slot column"
        )
    return int(row["priority"]) % max(int(n), 1)


def dataset_id_of(row: dict) -> str:
    """``"<data_source>:<index>"`` of a row ("" / 0 when absent; keys also hold the prompt ids)."""
    extra = row.get("extra_info") or {}
    index = row.get("index", extra.get("index", 0) if hasattr(extra, "get") else 0)
    return f"{row.get('data_source', '')}:{index}"


class SpecRLAgentLoop(AgentLoopBase):
    """Single-turn agent loop with speculative rollouts; its arguments besides verl's come from the agent-loop YAML.

    Args:
        cache_dir: draft directory shared by all workers (default: ``$SPEC_RL_DRAFT_DIR``).
        mode: a RolloutMode or its name (default ``spec``; ``exact``: lossless; ``l=1``, ...; tail speculation does not
            apply on a server); ``vanilla`` is the baseline: every response generated whole and stored.
        prompt_logprobs_mode: "raw" (vLLM: temperature 1, no top-k/top-p) or "processed".
        eos_token_ids: EOS ids (default: the tokenizer's eos_token_id).

    The seed step is the server's ``global_steps``, else the draft's version + 1. On SGLang (rollout ``name``
    "sglang") the per-attempt seed is sent as ``sampling_seed``. Raises ValueError for no cache directory, settings
    whose log-probs cannot be compared (:func:`~spec_rl.integrations.requests.check_server_settings`) or a name that
    names no mode."""

    def __init__(
        self,
        *args,
        cache_dir: str | None = None,
        mode: str = ADAPTER_MODE,
        seed: int = 0,
        prompt_logprobs_mode: str = "raw",
        eos_token_ids: list[int] | None = None,
        max_resample_attempts: int = MAX_RESIDUAL_ATTEMPTS,
        **kwargs,
    ):
        folded = sorted({"strategy", "acceptance", "lenience", "history_spec", "spec_tokens"} & kwargs.keys())
        if folded:  # verl's base class swallows unknown options: a 0.3 YAML would run silently with the default
            raise TypeError(f"{AGENT_NAME}: {', '.join(folded)} became part of mode (e.g. mode: l=1.6, exact, vanilla)")
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
            eos_token_ids = sorted(tokenizer_eos_ids(None, self.tokenizer))
        self.builder = SpecRequestBuilder(
            _store_for(str(cache_dir), self.tokenizer),
            self.settings,
            int(max_model_len),
            eos_token_ids,
            mode,
            seed=int(seed),
            prompt_logprobs_mode=prompt_logprobs_mode,
            repetition_penalty=float(_cfg(rc, "repetition_penalty", 1.0) or 1.0),
            logprobs_mode=_cfg(rc, "logprobs_mode", None),
            seed_param="sampling_seed" if str(_cfg(rc, "name", "vllm")).lower() == "sglang" else "seed",
            max_resample_attempts=max_resample_attempts,
        )

    def _is_training_request(self, sampling_params: dict[str, Any]) -> bool:
        """The request samples with the training settings (not validation or greedy)."""
        return (
            float(sampling_params.get("temperature", 1.0)) == self.settings.temperature
            and float(sampling_params.get("top_p", 1.0)) == self.settings.top_p
            and max(int(sampling_params.get("top_k", -1) or 0), 0) == self.settings.top_k
        )

    async def run(self, sampling_params: dict[str, Any], **kwargs) -> AgentLoopOutput:
        messages = list(kwargs["raw_prompt"])
        if await self.process_multi_modal_info(messages):
            raise ValueError(f"{AGENT_NAME} supports text prompts only; use single_turn_agent for multimodal data")
        prompt_ids = await self.ct_build_initial_tokens(messages)
        request_id = uuid4().hex
        base = {k: v for k, v in sampling_params.items() if k not in ("max_tokens", "max_new_tokens")}
        metrics: dict[str, float] = {}
        extra: dict[str, Any] = {}
        with simple_timer("generate_sequences", metrics):
            if self._is_training_request(sampling_params):
                plan = self.builder.plan(prompt_ids, slot_of(kwargs, self.n), dataset_id_of(kwargs))
                score, send = partial(self._score, request_id, base), partial(self._continue, request_id, base)
                result, _ = await self.builder.run_sample(plan, score, send)
                # the behaviour log-probs: verl's rollout_log_probs, which its Rollout Correction weighs reused
                # tokens by (docs/integrations.md "Rollout correction")
                response_ids, logprobs = result.response_ids, result.behaviour_logprobs
                extra = {f"spec_rl/{k}": v for k, v in result.metrics.items()}
            else:  # validation or greedy: generated plainly
                out = await self.server_manager.generate(
                    request_id=request_id, prompt_ids=prompt_ids, sampling_params=dict(sampling_params)
                )
                response_ids, logprobs = list(out.token_ids), out.log_probs
        response_ids = list(response_ids)[: self.response_length]
        return AgentLoopOutput(
            prompt_ids=list(prompt_ids),
            response_ids=response_ids,
            response_mask=[1] * len(response_ids),
            response_logprobs=list(logprobs)[: self.response_length] if logprobs is not None else None,
            num_turns=2,
            metrics=metrics,
            extra_fields=extra,
        )

    async def _score(self, request_id: str, base: dict, plan: Sample):
        """The scoring request -> (lp_new of the draft, weight step, the token sampled after it and its log-prob)."""
        scored = await self.server_manager.generate(
            request_id=request_id,
            prompt_ids=plan.scoring_ids,
            sampling_params=self.builder.scoring_sampling_params(base),
        )
        fields = scored.extra_fields or {}
        if "prompt_logprobs" not in fields:
            raise RuntimeError(
                "the rollout server returned no prompt_logprobs for the scoring request; spec_rl_agent needs "
                "verl's vLLM or SGLang server (which pass prompt_logprobs through)"
            )
        new_lps = self.builder.draft_logprobs_from_rows(plan, fields["prompt_logprobs"], fields.get("prompt_ids"))
        return new_lps, fields.get("global_steps"), (list(scored.token_ids), scored.log_probs)

    async def _continue(self, request_id: str, base: dict, cont: ContinuationRequest, seed: int | None):
        """One continuation request on the same server -> (new ids, their log-probs, weight step)."""
        out = await self.server_manager.generate(
            request_id=request_id,
            prompt_ids=cont.context_ids,
            sampling_params=self.builder.continuation_sampling_params(base, cont, seed),
        )
        new_ids, lps = list(out.token_ids), out.log_probs
        if new_ids and lps is None:
            raise RuntimeError("the rollout server returned tokens without log_probs although logprobs=True was sent")
        return new_ids, lps, (out.extra_fields or {}).get("global_steps")


# verl registers the YAML's entry (with cache_dir, mode, ...) before it imports this module; keep that entry.
if AGENT_NAME not in _agent_loop_registry:
    register(AGENT_NAME)(SpecRLAgentLoop)
