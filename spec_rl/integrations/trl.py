"""SPEC-RL speculative rollouts inside TRL's ``GRPOTrainer`` (trl 1.x, ``rollout_func`` hook).

Usage::

    from trl import GRPOConfig, GRPOTrainer
    from spec_rl.integrations.trl import SpecRLRollout

    spec = SpecRLRollout(lenience=math.exp(0.5), dataset_id_column="id")
    trainer = GRPOTrainer(model=model, args=args, train_dataset=ds, reward_funcs=reward,
                          processing_class=tokenizer, rollout_func=spec)
    spec.attach(trainer)   # checks the configuration now; reads the dataset-id column; saves the cache with checkpoints
    trainer.train()

The contract, as read in trl 1.16.0 (``trl/trainer/grpo_trainer.py``: ``_generate``,
``_generate_and_score_completions``, ``_get_train_sampler``, ``add_fused_lm_head``):

- ``rollout_func(prompts, trainer)`` receives this process's slice of the generation
  batch: the ``prompt`` column of each row, in order, nothing else. TRL's
  ``RepeatSampler`` has already repeated every prompt ``num_generations`` times in a
  row, and the global batch is the concatenation of the processes' slices (TRL slices
  advantages the same way), so sample i on process p is slot
  ``(p * len(prompts) + i) % num_generations`` of its group. The adapter keys each
  draft by (prompt token ids, that slot, dataset id).
- It must return a dict with ``prompt_ids``, ``completion_ids`` (one token-id list per
  prompt) and ``logprobs`` (one float per completion token). Any other key is handed
  to the reward functions, so the adapter returns only those three.
- What TRL does with ``logprobs``: without vLLM the clipped objective's "old" log-probs
  are recomputed by the trainer's own forward (``_get_per_token_logps_and_entropies``)
  when generation and optimisation steps are misaligned, and are the detached current
  log-probs otherwise; the returned ``logprobs`` enter only as
  ``sampling_per_token_logps`` in the off-policy sequence mask
  (``off_policy_mask_threshold``). With vLLM they feed the importance-sampling correction.
- TRL's own per-token log-probs are ``log_softmax(logits / temperature)`` over the full
  vocabulary (``add_fused_lm_head(temperature=args.temperature)``). With ``top_k=0`` and
  ``top_p=1`` these are exactly the sampling log-probs the verifier uses and this
  adapter returns; :meth:`SpecRLRollout.attach` checks that on a probe sequence.

The dataset id: ``rollout_func`` never sees the other columns. With
``dataset_id_column="id"``, :meth:`SpecRLRollout.attach` wraps the trainer's
``_generate_and_score_completions(inputs)`` (which holds the full rows and calls
``rollout_func`` with ``[row["prompt"] for row in inputs]`` in the same order) to read
that column first. Alternatively ``dataset_id_fn(prompt) -> str`` derives the id from
the prompt itself. Without either, two dataset rows with the same prompt share drafts.

What the adapter refuses at start (:class:`UnsupportedTrainerConfig`): vLLM generation
(``use_vllm=True``; see docs/integrations.md for what colocate mode would need),
``repetition_penalty != 1``, ``min_p``, extra ``generation_kwargs``, tools and
environments, multimodal prompts, FSDP, a loaded rollout cache whose drafts were
sampled with other settings, and a trainer whose per-token log-probs differ from
``log_softmax(logits / temperature)`` (for example dropout left on during training).
"""

from __future__ import annotations

import contextlib
import inspect
import math
import os
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from ..cache import RolloutCache
from ..generation import TransformersBackend, eos_token_ids
from ..philox import mix_seed
from ..acceptance import lenience_to_log
from ..rollout import STRATEGIES, RolloutRequest, RolloutResult, SpeculativeRollout
from ..sampling import SamplingSettings

__all__ = [
    "CACHE_FILENAME",
    "SpecRLRollout",
    "UnsupportedTrainerConfig",
    "check_trainer_args",
    "sampling_settings_from_args",
]

#: File name of the rollout cache inside a TRL checkpoint folder (``checkpoint-<step>/``).
#: Processes other than rank 0 add ``.rank<k>`` before the suffix.
CACHE_FILENAME = "spec_rl_rollout_cache.safetensors"


class UnsupportedTrainerConfig(ValueError):
    """The TRL trainer is configured in a way the speculative rollout cannot honour."""


def sampling_settings_from_args(args) -> SamplingSettings:
    """The sampling distribution TRL's ``GRPOConfig`` asks for, as :class:`SamplingSettings`.

    ``temperature``, ``top_p``, ``top_k`` (``None`` read as 0) and ``max_completion_length``
    (tokens) map one to one; the other generation options are checked by
    :func:`check_trainer_args`.
    """
    top_k = getattr(args, "top_k", 0)
    top_p = getattr(args, "top_p", 1.0)
    max_len = getattr(args, "max_completion_length", None)
    if max_len is None:
        raise UnsupportedTrainerConfig(
            "args.max_completion_length is None; set it to the response budget in tokens (e.g. 256)"
        )
    return SamplingSettings(
        temperature=float(args.temperature),
        top_p=1.0 if top_p is None else float(top_p),
        top_k=0 if top_k is None else int(top_k),
        max_tokens=int(max_len),
    )


def check_trainer_args(args) -> SamplingSettings:
    """Validate a ``trl.GRPOConfig`` for speculative rollouts; return its sampling settings.

    Raises:
        UnsupportedTrainerConfig: naming the argument and the fix, for ``use_vllm=True``,
            ``repetition_penalty != 1``, ``min_p`` set, non-empty ``generation_kwargs``,
            a missing ``max_completion_length`` or temperature <= 0.
    """
    if getattr(args, "use_vllm", False):
        mode = getattr(args, "vllm_mode", "colocate")
        why = (
            "TRL's vLLM server client sends one max_tokens for the whole batch, but a speculative continuation needs a "
            "per-request budget (max_completion_length - verified prefix)"
            if mode == "server"
            else "a vLLM colocate backend (per-request SamplingParams with max_tokens, processed logprobs, the "
            "trainer's weights synced before scoring) is not implemented here because it cannot be tested without a GPU"
        )
        raise UnsupportedTrainerConfig(
            f"use_vllm=True (vllm_mode={mode!r}) is not supported by spec_rl.integrations.trl: {why}. "
            "Set use_vllm=False to generate with the trainer's own model (see docs/integrations.md)."
        )
    rp = getattr(args, "repetition_penalty", 1.0)
    if rp is not None and float(rp) != 1.0:
        raise UnsupportedTrainerConfig(
            f"repetition_penalty={rp}: the penalty makes each token's distribution depend on the sampled history "
            "in a way the draft's stored log-probs do not record, so drafts cannot be verified; set repetition_penalty=1.0"
        )
    min_p = getattr(args, "min_p", None)
    if min_p not in (None, 0, 0.0):
        raise UnsupportedTrainerConfig(
            f"min_p={min_p}: spec-rl's sampler implements temperature, top_k and top_p only; set min_p=None"
        )
    gk = getattr(args, "generation_kwargs", None)
    if gk:
        raise UnsupportedTrainerConfig(
            f"generation_kwargs={gk!r}: spec-rl's generation backend samples with temperature/top_k/top_p/"
            "max_completion_length only and would silently ignore these; remove generation_kwargs"
        )
    if getattr(args, "temperature", None) is None or not float(args.temperature) > 0:
        raise UnsupportedTrainerConfig(
            f"temperature={getattr(args, 'temperature', None)!r}: speculative rollouts need sampling log-probs; "
            "set temperature > 0"
        )
    return sampling_settings_from_args(args)


def _rank_suffix(process_index: int) -> str:
    return (
        CACHE_FILENAME
        if process_index == 0
        else CACHE_FILENAME.replace(".safetensors", f".rank{process_index}.safetensors")
    )


class SpecRLRollout:
    """A ``rollout_func`` for ``trl.GRPOTrainer`` that reuses last epoch's completions as drafts.

    Each call (one per generation batch) builds one :class:`~spec_rl.rollout.RolloutRequest`
    per prompt (token ids from the trainer's own tokenisation, slot within its group,
    dataset id), runs :class:`~spec_rl.rollout.SpeculativeRollout` with the trainer's
    unwrapped model as both scorer (:class:`~spec_rl.scoring.PolicyScorer`) and generator
    (:class:`~spec_rl.generation.TransformersBackend`), under the trainer's temperature,
    top_p, top_k, max_completion_length and full EOS set (trainer's list, the model's
    generation config and the tokenizer), and returns what TRL expects.

    The rollout step is ``trainer.state.global_step``: it versions the cache entries and
    seeds the Philox acceptance uniforms (paper Alg. 1 with a counter-based generator,
    DESIGN.md "Randomness"), so decisions change every step. The process index and a
    counter of calls within one global step (several generations per optimizer step when
    ``steps_per_generation < gradient_accumulation_steps``) are mixed into the seed.

    Evaluation batches (``trainer.model.training`` False) are generated without drafts and
    are not stored, so they never overwrite training drafts.

    Args:
        lenience: l >= 0 (paper default e^0.5 for GRPO, Sec. 4); or
        log_lenience: log(l).
        strategy: "spec", "random" (random-reuse ablation) or "off" (vanilla, still cached).
        seed: run seed for the acceptance uniforms and sampling; default ``trainer.args.seed``.
        cache: an existing :class:`~spec_rl.cache.RolloutCache` (default: a new one, or
            the file at ``cache_path`` if it exists).
        cache_path: a ``.safetensors`` file loaded at start if present and written
            atomically at every checkpoint save and at the end of training.
        dataset_id_column: name of a dataset column holding a stable row id (read through
            :meth:`attach`; requires ``remove_unused_columns=False``, TRL's default).
        dataset_id_fn: alternative: ``fn(prompt) -> str`` giving the id from the prompt.
        max_model_len: context limit (prompt + completion tokens); default the model's
            ``max_position_embeddings``. Budget per sample:
            ``min(max_completion_length, max_model_len - prompt_len) - n``.
        verify_backend: passed to :func:`spec_rl.verify.verify` ("auto", "reference", "triton").
        check_logprobs: at :meth:`attach`, compare the trainer's per-token log-probs with
            ``log_softmax(logits / temperature)`` on a probe sequence and raise on mismatch.
        log_metrics: report ``spec_rl/*`` metrics through the trainer's metric log.

    Attributes:
        cache: the :class:`~spec_rl.cache.RolloutCache`.
        last_result: the :class:`~spec_rl.rollout.RolloutResult` of the latest call.
        last_requests: the requests of the latest call (prompt ids, slot, dataset id).
        history: one dict per call: ``mode``, ``step``, ``log_lenience``, ``strategy`` and the
            rollout statistics (:meth:`spec_rl.rollout.RolloutStats.to_dict`).

    Raises:
        UnsupportedTrainerConfig: see :func:`check_trainer_args` and :meth:`attach`.
    """

    def __init__(
        self,
        lenience: float | None = math.exp(0.5),
        log_lenience: float | None = None,
        strategy: str = "spec",
        seed: int | None = None,
        cache: RolloutCache | None = None,
        cache_path: str | os.PathLike | None = None,
        dataset_id_column: str | None = None,
        dataset_id_fn: Callable[[Any], str] | None = None,
        max_model_len: int | None = None,
        verify_backend: str = "auto",
        check_logprobs: bool = True,
        log_metrics: bool = True,
    ):
        if dataset_id_column is not None and dataset_id_fn is not None:
            raise ValueError("pass either dataset_id_column or dataset_id_fn, not both")
        if dataset_id_column is not None and not isinstance(dataset_id_column, str):
            raise TypeError(f"dataset_id_column must be a column name (str), got {type(dataset_id_column).__name__}")
        if dataset_id_fn is not None and not callable(dataset_id_fn):
            raise TypeError("dataset_id_fn must be a callable prompt -> str")
        if max_model_len is not None and int(max_model_len) < 2:
            raise ValueError(f"max_model_len must be >= 2 tokens, got {max_model_len}")
        if log_lenience is not None:
            lenience = None
        self.lenience = lenience
        self.log_lenience = log_lenience
        self.strategy = strategy
        self.seed = seed
        self.cache_path = Path(cache_path) if cache_path is not None else None
        if cache is None and self.cache_path is not None and self.cache_path.is_file():
            cache = RolloutCache.load(self.cache_path)
        self.cache = cache if cache is not None else RolloutCache()
        self.dataset_id_column = dataset_id_column
        self.dataset_id_fn = dataset_id_fn
        self.max_model_len = None if max_model_len is None else int(max_model_len)
        self.verify_backend = verify_backend
        self.check_logprobs = check_logprobs
        self.log_metrics = log_metrics
        self.last_result: RolloutResult | None = None
        self.last_requests: list[RolloutRequest] = []
        self.history: list[dict] = []
        self._trainer = None
        self._settings: SamplingSettings | None = None
        self._rollout: SpeculativeRollout | None = None
        self._model_id: int | None = None
        self._pending_ids: list | None = None
        self._last_step: int | None = None
        self._calls_at_step = 0
        self._eval_calls = 0
        # Fail on a bad lenience or strategy now rather than at the first rollout.
        lenience_to_log(self.lenience, self.log_lenience)
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")

    # ------------------------------------------------------------------ setup
    def attach(self, trainer) -> SpecRLRollout:
        """Bind to ``trainer``: validate its configuration now, hook the dataset-id column, save with checkpoints.

        Call once after building the ``GRPOTrainer`` (with ``rollout_func=self``) and
        before ``trainer.train()``. Without it the same checks run at the first rollout,
        but ``dataset_id_column`` and checkpoint saving need it.

        Raises:
            UnsupportedTrainerConfig: the trainer's ``rollout_func`` is not this object;
                a configuration :func:`check_trainer_args` rejects; tools or environments;
                FSDP; cached drafts sampled with other settings; the trainer's log-probs
                do not match ``log_softmax(logits / temperature)``.
        """
        if getattr(trainer, "rollout_func", None) is not self:
            raise UnsupportedTrainerConfig(
                "trainer.rollout_func is not this SpecRLRollout; build the trainer with GRPOTrainer(..., rollout_func=spec) "
                "and then call spec.attach(trainer)"
            )
        self._validate(trainer)
        if self.dataset_id_column is not None and not getattr(trainer, "_spec_rl_id_hook", False):
            self._hook_dataset_ids(trainer)
        if not getattr(trainer, "_spec_rl_callback", False):
            trainer.add_callback(_CacheCallback(self))
            trainer._spec_rl_callback = True
        return self

    def _validate(self, trainer) -> None:
        args = trainer.args
        settings = check_trainer_args(args)
        if getattr(trainer, "tools", None) or getattr(trainer, "environment_factories", None):
            raise UnsupportedTrainerConfig(
                "tools / environment_factory: TRL appends tool output to the completion after rollout_func returns, "
                "so the cached draft would not be the sampled sequence; build the trainer without tools to use spec-rl"
            )
        if getattr(trainer, "is_fsdp_enabled", False):
            raise UnsupportedTrainerConfig(
                "FSDP: the scoring forward and the decode loop need full parameters on each rank, which this adapter "
                "does not gather; use DDP or DeepSpeed ZeRO-1/2 (ZeRO-3 params are gathered by TRL's unwrap context)"
            )
        if self.dataset_id_column is not None and getattr(args, "remove_unused_columns", False):
            raise UnsupportedTrainerConfig(
                f"dataset_id_column={self.dataset_id_column!r} needs the column in the batch, but "
                "args.remove_unused_columns=True drops it; set remove_unused_columns=False"
            )
        self._check_cache_settings(settings)
        if self.check_logprobs:
            self._check_trainer_logprobs(trainer, settings)
        self._settings = settings
        self._trainer = trainer

    def _check_cache_settings(self, settings: SamplingSettings) -> None:
        # The cache already treats a settings mismatch as a miss; at start we want an error instead of
        # silent zero reuse (issue 5). RolloutCache has no public iterator, so read its entries here.
        found = {d.settings for d in self.cache.drafts()}
        other = [s for s in found if s != settings]
        if other:
            raise UnsupportedTrainerConfig(
                f"the rollout cache holds drafts sampled with {other[0]} but the trainer samples with {settings}; "
                "their log-probs are of different distributions, so none would be reused. Use the trainer settings "
                "the drafts were recorded with, or start from an empty cache (delete the file / pass cache=RolloutCache())"
            )

    def _check_trainer_logprobs(self, trainer, settings: SamplingSettings) -> None:
        """Compare TRL's per-token log-probs with log_softmax(logits / T) on a 12-token probe."""
        fn = getattr(trainer, "_get_per_token_logps_and_entropies", None)
        if fn is None:
            raise UnsupportedTrainerConfig(
                "this TRL version has no GRPOTrainer._get_per_token_logps_and_entropies, so the adapter cannot check "
                "that the trainer's log-probs include the temperature; pass check_logprobs=False to skip (trl>=1.16 tested)"
            )
        model = trainer.accelerator.unwrap_model(trainer.model)
        device = next(model.parameters()).device
        vocab = model.get_output_embeddings().weight.shape[0]
        gen = torch.Generator().manual_seed(1234)
        ids = torch.randint(0, vocab, (1, 12), generator=gen).to(device)
        mask = torch.ones_like(ids)
        keep = 8
        with torch.no_grad():
            trl_lp = fn(trainer.model, ids, mask, keep, batch_size=1)[0].double().cpu()[0]
            was_training = model.training
            model.eval()
            try:
                with trainer.accelerator.autocast():
                    logits = model(input_ids=ids, attention_mask=mask).logits[0].double().cpu()
            finally:
                model.train(was_training)
        tgt = ids[0, -keep:].cpu()
        rows = logits[-keep - 1 : -1]
        mine = torch.log_softmax(rows / settings.temperature, -1).gather(-1, tgt[:, None])[:, 0]
        plain = torch.log_softmax(rows, -1).gather(-1, tgt[:, None])[:, 0]
        err = float((trl_lp - mine).abs().max())
        low_precision = next(model.parameters()).dtype != torch.float32 or bool(
            getattr(trainer.args, "bf16", False) or getattr(trainer.args, "fp16", False)
        )
        tol = 5e-2 if low_precision else 1e-3
        if not math.isfinite(err) or err > tol:
            err_plain = float((trl_lp - plain).abs().max())
            raise UnsupportedTrainerConfig(
                f"the trainer's per-token log-probs differ from log_softmax(logits / temperature={settings.temperature}) "
                f"by up to {err:.3g} on a probe sequence (tolerance {tol:g}; versus temperature 1: {err_plain:.3g}). "
                "Verification would compare log-probs of different distributions. Causes: a logprob computation "
                "without the temperature, or dropout active in training (set disable_dropout=True). "
                "Pass check_logprobs=False only if you know the difference is intended."
            )

    def _hook_dataset_ids(self, trainer) -> None:
        original = getattr(trainer, "_generate_and_score_completions", None)
        if original is None:
            raise UnsupportedTrainerConfig(
                "this TRL version has no GRPOTrainer._generate_and_score_completions to read the dataset-id column "
                "from; use dataset_id_fn=... instead (trl>=1.16 tested)"
            )
        column = self.dataset_id_column

        def with_ids(inputs, *a, **kw):
            missing = [i for i, row in enumerate(inputs) if column not in row]
            if missing:
                raise KeyError(
                    f"dataset_id_column={column!r} is missing from batch rows {missing[:5]}; add that column to the "
                    "dataset (a stable id per row) or drop dataset_id_column"
                )
            self._pending_ids = [str(row[column]) for row in inputs]
            try:
                return original(inputs, *a, **kw)
            finally:
                self._pending_ids = None

        trainer._generate_and_score_completions = with_ids
        trainer._spec_rl_id_hook = True

    # ------------------------------------------------------------------ rollout
    def _tokenize(self, prompts: list, trainer) -> list[list[int]]:
        tokenize = getattr(trainer, "_tokenize_prompts", None)
        if tokenize is not None:
            prompt_ids, images, multimodal = tokenize(prompts)
            if images is not None or multimodal:
                raise UnsupportedTrainerConfig(
                    "multimodal prompts: the scoring pass and decode loop are text-only; use text or chat prompts"
                )
        else:  # older TRL: the same as its text path
            prompt_ids = trainer.processing_class(text=prompts)["input_ids"]
        return [[int(t) for t in (p.tolist() if isinstance(p, torch.Tensor) else p)] for p in prompt_ids]

    def requests_for(
        self, prompts: list, trainer, prompt_ids: Sequence[Sequence[int]] | None = None
    ) -> list[RolloutRequest]:
        """The :class:`~spec_rl.rollout.RolloutRequest` of each prompt of one ``rollout_func`` call.

        Slot of sample i: ``(process_index * len(prompts) + i) % G`` with G =
        ``trainer.num_generations`` (``num_generations_eval`` in evaluation); see the module
        docstring for why.

        Raises:
            RuntimeError: two samples of one group have different prompts (the batch is not
                laid out by TRL's RepeatSampler, so slots would be wrong), or
                ``dataset_id_column`` is set but :meth:`attach` was not called.
        """
        if prompt_ids is None:
            prompt_ids = self._tokenize(prompts, trainer)
        training = bool(trainer.model.training)
        group = (
            trainer.num_generations
            if training
            else (getattr(trainer, "num_generations_eval", None) or trainer.num_generations)
        )
        offset = trainer.accelerator.process_index * len(prompts)
        if self.dataset_id_column is not None:
            if self._pending_ids is None:
                raise RuntimeError(
                    f"dataset_id_column={self.dataset_id_column!r} is set but the trainer is not hooked; call "
                    "spec.attach(trainer) before trainer.train()"
                )
            if len(self._pending_ids) != len(prompts):
                raise RuntimeError(
                    f"read {len(self._pending_ids)} dataset ids but rollout_func got {len(prompts)} prompts"
                )
            ids: list[str | None] = list(self._pending_ids)
        elif self.dataset_id_fn is not None:
            ids = [str(self.dataset_id_fn(p)) for p in prompts]
        else:
            ids = [None] * len(prompts)
        requests = []
        first_of_group: dict[int, int] = {}
        for i, (p, did) in enumerate(zip(prompt_ids, ids)):
            g = (offset + i) // group
            j = first_of_group.setdefault(g, i)
            if list(prompt_ids[j]) != list(p) or ids[j] != did:
                raise RuntimeError(
                    f"samples {j} and {i} fall in the same group of num_generations={group} but have different prompts; "
                    "the batch is not laid out by TRL's RepeatSampler (each prompt repeated num_generations times in a "
                    "row), so sample slots cannot be derived"
                )
            requests.append(RolloutRequest(prompt_ids=list(p), slot=(offset + i) % group, dataset_id=did))
        return requests

    def _ensure_rollout(self, model, trainer) -> SpeculativeRollout:
        if self._rollout is not None and self._model_id == id(model):
            return self._rollout
        tok = getattr(trainer, "_tokenizer", None) or trainer.processing_class
        eos = eos_token_ids(model, tok) | {int(x) for x in (getattr(trainer, "eos_token_ids", None) or [])}
        if not eos:
            raise UnsupportedTrainerConfig(
                "neither the model nor the tokenizer declares an EOS id; set tokenizer.eos_token"
            )
        pad = tok.pad_token_id if tok.pad_token_id is not None else min(eos)
        max_len = self.max_model_len or getattr(model.config.get_text_config(), "max_position_embeddings", None)
        if max_len is None:
            raise UnsupportedTrainerConfig("the model config has no max_position_embeddings; pass max_model_len=...")
        seed = self.seed if self.seed is not None else int(getattr(trainer.args, "seed", 0))
        self._rollout = SpeculativeRollout(
            backend=TransformersBackend(model, eos_ids=eos, pad_id=pad),
            cache=self.cache,
            settings=self._settings,
            eos_ids=eos,
            max_model_len=int(max_len),
            lenience=self.lenience,
            log_lenience=self.log_lenience,
            strategy=self.strategy,
            seed=seed,
            verify_backend=self.verify_backend,
        )
        self._base_seed = seed
        self._model_id = id(model)
        return self._rollout

    def _unwrapped(self, trainer):
        try:
            from trl.models.utils import unwrap_model_for_generation
        except ImportError:  # pragma: no cover - older layouts
            unwrap_model_for_generation = None
        if unwrap_model_for_generation is None:
            return contextlib.nullcontext(trainer.accelerator.unwrap_model(trainer.model))
        args = trainer.args
        kwargs = {
            "gather_deepspeed3_params": getattr(args, "ds3_gather_for_generation", True),
            "gradient_checkpointing_kwargs": getattr(args, "gradient_checkpointing_kwargs", None),
        }
        # Older trl 1.x releases take fewer keyword arguments here.
        accepted = inspect.signature(unwrap_model_for_generation).parameters
        kwargs = {k: v for k, v in kwargs.items() if k in accepted}
        return unwrap_model_for_generation(
            getattr(trainer, "model_wrapped", trainer.model), trainer.accelerator, **kwargs
        )

    def __call__(self, prompts: list, trainer) -> dict[str, list]:
        """TRL's ``rollout_func``: one completion per prompt.

        Args:
            prompts: this process's prompts (strings or chat message lists), each repeated
                ``num_generations`` times in a row by TRL.
            trainer: the ``GRPOTrainer``.

        Returns:
            ``{"prompt_ids": [[int]], "completion_ids": [[int]], "logprobs": [[float]]}``, one
            entry per prompt, in order. ``logprobs[i][t]`` is the sampling log-probability
            (nats, float) of completion token t under the trainer's current model:
            ``log_softmax(logits / T)`` restricted to top-k/top-p when those are set.
        """
        if self._trainer is not trainer:
            self._validate(trainer)
            if self.dataset_id_column is not None and not getattr(trainer, "_spec_rl_id_hook", False):
                raise RuntimeError(
                    f"dataset_id_column={self.dataset_id_column!r} needs spec.attach(trainer) before trainer.train()"
                )
        if not prompts:
            return {"prompt_ids": [], "completion_ids": [], "logprobs": []}
        training = bool(trainer.model.training)
        requests = self.requests_for(prompts, trainer)
        step = int(trainer.state.global_step)
        if training:
            self._calls_at_step = self._calls_at_step + 1 if step == self._last_step else 0
            self._last_step = step
        else:
            self._eval_calls += 1
        t0 = time.perf_counter()
        with self._unwrapped(trainer) as model, torch.no_grad():
            was_training = model.training
            model.eval()  # deterministic scoring and sampling (no dropout)
            try:
                rollout = self._ensure_rollout(model, trainer)
                salt = mix_seed(
                    trainer.accelerator.process_index, self._calls_at_step if training else -self._eval_calls
                )
                rollout.seed = self._base_seed ^ salt
                with trainer.accelerator.autocast():
                    if training:
                        rollout.cache = self.cache
                        rollout.strategy = self.strategy
                        result = rollout.run(requests, step=step)
                    else:
                        # Evaluation: vanilla sampling into a throw-away cache, so eval never overwrites drafts.
                        rollout.cache, rollout.strategy = RolloutCache(), "off"
                        try:
                            result = rollout.run(requests, step=step)
                        finally:
                            rollout.cache, rollout.strategy = self.cache, self.strategy
            finally:
                model.train(was_training)
        self.last_result = result
        self.last_requests = requests
        stats = result.stats.to_dict()
        record = {
            "mode": "train" if training else "eval",
            "step": step,
            "log_lenience": rollout.log_lenience,
            "strategy": self.strategy if training else "off",
            "wall_seconds": time.perf_counter() - t0,
            **stats,
        }
        self.history.append(record)
        if self.log_metrics and training and hasattr(trainer, "_log_metric"):
            n = max(stats["num_samples"], 1)
            trainer._log_metric("spec_rl/draft_found_ratio", stats["drafts_found"] / n)
            trainer._log_metric("spec_rl/full_reuse_ratio", stats["full_reuse_ratio"])
            trainer._log_metric("spec_rl/mean_verified_prefix", stats["mean_verified_prefix"])
            trainer._log_metric("spec_rl/reused_tokens", float(stats["reused_tokens"]))
            trainer._log_metric("spec_rl/tokens_generated", float(stats["tokens_generated"]))
            trainer._log_metric("spec_rl/rollout_seconds", stats["rollout_seconds"])
        return {
            "prompt_ids": [list(p) for p in result.prompt_ids],
            "completion_ids": [list(r) for r in result.response_ids],
            "logprobs": [[float(x) for x in lp] for lp in result.logprobs],
        }

    # ------------------------------------------------------------------ persistence
    def checkpoint_file(self, checkpoint_dir: str | os.PathLike, process_index: int = 0) -> Path:
        """Where the cache of process ``process_index`` lives inside a checkpoint folder."""
        return Path(checkpoint_dir) / _rank_suffix(process_index)

    def save_cache(self, path: str | os.PathLike) -> Path:
        """Write the cache atomically (see :meth:`spec_rl.cache.RolloutCache.save`)."""
        return self.cache.save(path)


class _CacheCallback(TrainerCallback):
    """Saves the rollout cache next to each TRL checkpoint and reloads it when training resumes."""

    def __init__(self, spec: SpecRLRollout):
        self.spec = spec

    def _rank(self) -> int:
        t = self.spec._trainer
        return int(t.accelerator.process_index) if t is not None else 0

    def on_train_begin(self, args, state, control, **kwargs):
        if state.global_step > 0 and len(self.spec.cache) == 0:
            resume = getattr(args, "resume_from_checkpoint", None)
            folder = (
                Path(resume)
                if isinstance(resume, str) and os.path.isdir(resume)
                else Path(args.output_dir) / f"checkpoint-{state.global_step}"
            )
            path = self.spec.checkpoint_file(folder, self._rank())
            if path.is_file():
                self.spec.cache = RolloutCache.load(path)
                self.spec._rollout = None  # rebuilt around the loaded cache
                if self.spec._settings is not None:
                    self.spec._check_cache_settings(self.spec._settings)
            else:
                warnings.warn(
                    f"spec-rl: resuming at step {state.global_step} without a rollout cache at {path}; "
                    "the first epoch after resuming generates from scratch",
                    stacklevel=2,
                )

    def on_save(self, args, state, control, **kwargs):
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if folder.is_dir():
            self.spec.cache.save(self.spec.checkpoint_file(folder, self._rank()))
        if self.spec.cache_path is not None:
            self.spec.cache.save(self._ranked(self.spec.cache_path))

    def on_train_end(self, args, state, control, **kwargs):
        if self.spec.cache_path is not None:
            self.spec.cache.save(self._ranked(self.spec.cache_path))

    def _ranked(self, path: Path) -> Path:
        r = self._rank()
        return path if r == 0 else path.with_name(f"{path.stem}.rank{r}{path.suffix}")
