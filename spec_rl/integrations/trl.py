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

Start-up checks (:mod:`spec_rl.integrations.trl_checks`) refuse, with
:class:`UnsupportedTrainerConfig`, what the rollout cannot honour: vLLM generation,
repetition penalty, ``min_p``, extra ``generation_kwargs``, tools and environments,
multimodal prompts, FSDP, cached drafts sampled with other settings, and per-token
log-probs that differ from ``log_softmax(logits / temperature)``. Checkpoint
persistence of the cache lives in :mod:`spec_rl.integrations.trl_checkpoint`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from ..acceptance.mode import mode_from_options
from ..drafts.cache import RolloutCache
from ..drafts.history import HistoryIndex
from ..rollout.speculative import RolloutRequest, RolloutResult
from ..sampling.distribution import SamplingSettings
from .trl_batch import batch_requests, group_size, hook_dataset_ids, tokenize_prompts, unwrapped_model
from .trl_checkpoint import CACHE_FILENAME, HISTORY_FILENAME, RolloutCacheCallback, history_path, ranked_path
from .trl_checks import (
    UnsupportedTrainerConfig,
    check_cache_settings,
    check_trainer_args,
    check_trainer_features,
    check_trainer_logprobs,
    sampling_settings_from_args,
)
from .trl_metrics import hook_reward_split, log_rollout_metrics
from .trl_rollout import CallSeeds, RolloutOptions, TrainerRollouts

__all__ = [
    "CACHE_FILENAME",
    "HISTORY_FILENAME",
    "SpecRLRollout",
    "UnsupportedTrainerConfig",
    "check_trainer_args",
    "sampling_settings_from_args",
]


class SpecRLRollout:
    """A ``rollout_func`` for ``trl.GRPOTrainer`` that reuses last epoch's completions as drafts.

    Each call (one per generation batch) builds one :class:`~spec_rl.rollout.speculative.RolloutRequest`
    per prompt (token ids from the trainer's own tokenisation, slot within its group,
    dataset id), runs :class:`~spec_rl.rollout.speculative.SpeculativeRollout` with the trainer's
    unwrapped model as scorer and generator (:class:`~spec_rl.backends.transformers_backend.TransformersBackend`,
    which owns its :class:`~spec_rl.backends.scoring.PolicyScorer`), under the trainer's temperature,
    top_p, top_k, max_completion_length and full EOS set (trainer's list, the model's
    generation config and the tokenizer), and returns what TRL expects.

    The rollout step is ``trainer.state.global_step``: it versions the cache entries and
    seeds the Philox acceptance uniforms (paper Alg. 1 with a counter-based generator,
    docs/design.md "Randomness"), so decisions change every step. The process index and a
    counter of calls within one global step (several generations per optimizer step when
    ``steps_per_generation < gradient_accumulation_steps``) are mixed into the seed.

    Evaluation batches (``trainer.model.training`` False) are generated without drafts and
    are not stored (in the cache or the history), so they never overwrite training drafts;
    they may use the history's drafts, which changes no token (:mod:`~spec_rl.integrations.trl_rollout`).

    Tail speculation (``history_spec``, docs/design.md "Speculation past the first
    rejection"): a :class:`~spec_rl.drafts.history.HistoryIndex` of every earlier training response
    per prompt drafts up to ``spec_tokens`` tokens per decode step, verified in the same
    forward. It changes the number of decode steps, not the tokens (up to floating-point
    rounding of the logits). The index is saved beside the cache with every checkpoint.

    Args:
        lenience: l >= 0 (default e^0.5, the paper's GRPO setting, Sec. 4).
        strategy: "spec", "random" (random-reuse ablation) or "off" (vanilla, still cached).
        acceptance: "lenient" (the paper's rule, default) or "exact" (lossless: every
            completion is distributed as a fresh sample of the current policy; takes no
            lenience; not with strategy "random"). strategy, acceptance, lenience, rejection_draw and
            history_spec name a :class:`~spec_rl.acceptance.mode.RolloutMode` (:attr:`mode`).
        history_spec: keep a history index and verify history-drafted tokens in every
            decode step (tail speculation; lossless).
        spec_tokens: most history-drafted tokens per decode step (the backend's ``max_k``;
            0 disables tail speculation).
        rejection_draw: the token at a lenient rejection index: "policy" (default, the paper: drawn from
            pi_t) or "without-draft" (from pi_t without the rejected draft token, renormalised; l >= 1,
            strategy "spec", lenient acceptance only; docs/design.md "The rule"; the demo's recipe).
        seed: run seed for the acceptance uniforms and sampling; default ``trainer.args.seed``.
        cache: an existing :class:`~spec_rl.drafts.cache.RolloutCache` (default: a new one, or
            the file at ``cache_path`` if it exists).
        cache_path: a ``.safetensors`` file loaded at start if present and written
            atomically at every checkpoint save and at the end of training; the history
            index goes beside it (:func:`~spec_rl.integrations.trl_checkpoint.history_path`).
        dataset_id_column: name of a dataset column holding a stable row id (read through
            :meth:`attach`; requires ``remove_unused_columns=False``, TRL's default).
        dataset_id_fn: alternative: ``fn(prompt) -> str`` giving the id from the prompt.
        max_model_len: context limit (prompt + completion tokens); default the model's
            ``max_position_embeddings``. Budget per sample:
            ``min(max_completion_length, max_model_len - prompt_len) - n``.
        verify_backend: passed to :func:`spec_rl.acceptance.dispatch.verify` ("auto", "reference", "triton").
        check_logprobs: at :meth:`attach`, compare the trainer's per-token log-probs with
            ``log_softmax(logits / temperature)`` on a probe sequence and raise on mismatch.
        log_metrics: report ``spec_rl/*`` metrics through the trainer's metric log: the reuse
            statistics of every training rollout and, once :meth:`attach` hooked the trainer, the
            rollout reward split by response origin (``spec_rl/reward_reused_whole``,
            ``spec_rl/reward_partly_reused``, ``spec_rl/reward_fresh`` and ``spec_rl/count_*``;
            :mod:`~spec_rl.integrations.trl_metrics`). TRL's own ``reward`` is biased upward under
            reuse (reused completions lean towards ones that were already correct): compare runs on
            TRL's evaluation metrics, whose completions are sampled fresh.

    Attributes:
        cache: the :class:`~spec_rl.drafts.cache.RolloutCache`.
        history_index: the :class:`~spec_rl.drafts.history.HistoryIndex` (None without tail speculation).
        trainer: the trainer whose configuration was last validated (None before
            :meth:`attach` or the first call).
        settings: that trainer's :class:`~spec_rl.sampling.distribution.SamplingSettings` (None before).
        last_result: the :class:`~spec_rl.rollout.speculative.RolloutResult` of the latest call.
        last_requests: the requests of the latest call (prompt ids, slot, dataset id).
        mode: the :class:`~spec_rl.acceptance.mode.RolloutMode` of the training rollouts.
        history: one dict per call: ``call`` ("train" or "eval"), ``step``, the mode of the call
            (:meth:`~spec_rl.acceptance.mode.RolloutMode.to_dict`) and the rollout statistics
            (:meth:`spec_rl.rollout.speculative.RolloutStats.to_dict`).

    Raises:
        ValueError: options that name no RolloutMode (:func:`~spec_rl.acceptance.mode.mode_from_options`), or a bad
            spec_tokens.
        UnsupportedTrainerConfig: see :func:`check_trainer_args` and :meth:`attach`.
    """

    def __init__(
        self,
        lenience: float | None = None,
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
        acceptance: str = "lenient",
        history_spec: bool = True,
        spec_tokens: int = 8,
        rejection_draw: str = "policy",
    ):
        if dataset_id_column is not None and dataset_id_fn is not None:
            raise ValueError("pass either dataset_id_column or dataset_id_fn, not both")
        if dataset_id_column is not None and not isinstance(dataset_id_column, str):
            raise TypeError(f"dataset_id_column must be a column name (str), got {type(dataset_id_column).__name__}")
        if dataset_id_fn is not None and not callable(dataset_id_fn):
            raise TypeError("dataset_id_fn must be a callable prompt -> str")
        if max_model_len is not None and int(max_model_len) < 2:
            raise ValueError(f"max_model_len must be >= 2 tokens, got {max_model_len}")
        if isinstance(spec_tokens, bool) or int(spec_tokens) != spec_tokens or spec_tokens < 0:
            raise ValueError(f"spec_tokens must be an integer >= 0 (0 disables tail speculation), got {spec_tokens!r}")
        # Fail on bad options now rather than at the first rollout.
        self.mode = mode_from_options(
            strategy, acceptance, lenience, rejection_draw, tail=history_spec and spec_tokens > 0
        )
        self.seed = seed
        self.cache_path = Path(cache_path) if cache_path is not None else None
        if cache is None and self.cache_path is not None and self.cache_path.is_file():
            cache = RolloutCache.load(self.cache_path)
        self.cache = cache if cache is not None else RolloutCache()
        self.history_index: HistoryIndex | None = None
        if self.mode.tail:
            saved = history_path(self.cache_path) if self.cache_path is not None else None
            self.history_index = HistoryIndex.load(saved) if saved is not None and saved.is_file() else HistoryIndex()
        self.dataset_id_column = dataset_id_column
        self.dataset_id_fn = dataset_id_fn
        self.max_model_len = None if max_model_len is None else int(max_model_len)
        self.verify_backend = verify_backend
        self.check_logprobs = check_logprobs
        self.log_metrics = log_metrics
        self.last_result: RolloutResult | None = None
        self.last_requests: list[RolloutRequest] = []
        self.history: list[dict] = []
        self.trainer = None
        self.settings: SamplingSettings | None = None
        self._options = RolloutOptions(self.mode, verify_backend, int(spec_tokens), self.max_model_len, seed)
        self._rollouts: TrainerRollouts | None = None
        self._rollouts_key: tuple | None = None
        self._seeds = CallSeeds()
        self._pending_ids: list | None = None

    # ------------------------------------------------------------------ setup
    def attach(self, trainer) -> SpecRLRollout:
        """Bind to ``trainer``: validate its configuration now, hook the dataset-id column, save with checkpoints.

        Call once after building the ``GRPOTrainer`` (with ``rollout_func=self``) and
        before ``trainer.train()``. Without it the same checks run at the first rollout,
        but ``dataset_id_column``, checkpoint saving and the reward split by origin need it.

        Raises:
            UnsupportedTrainerConfig: the trainer's ``rollout_func`` is not this object;
                a configuration :func:`check_trainer_args` rejects; tools or environments;
                FSDP; cached drafts sampled with other settings; the trainer's log-probs
                do not match ``log_softmax(logits / temperature)`` (see
                :mod:`spec_rl.integrations.trl_checks`).
        """
        if getattr(trainer, "rollout_func", None) is not self:
            raise UnsupportedTrainerConfig(
                "trainer.rollout_func is not this SpecRLRollout; build the trainer with "
                "GRPOTrainer(..., rollout_func=spec) and then call spec.attach(trainer)"
            )
        self._validate(trainer)
        if self.dataset_id_column is not None and not getattr(trainer, "_spec_rl_id_hook", False):
            self._hook_dataset_ids(trainer)
        if self.log_metrics and hasattr(trainer, "_log_metric") and not getattr(trainer, "_spec_rl_reward_hook", False):
            hook_reward_split(trainer, self)
        if not getattr(trainer, "_spec_rl_callback", False):
            trainer.add_callback(RolloutCacheCallback(self))
            trainer._spec_rl_callback = True
        return self

    def _validate(self, trainer) -> None:
        settings = check_trainer_args(trainer.args)
        check_trainer_features(trainer, self.dataset_id_column)
        check_cache_settings(self.cache, settings)
        if self.check_logprobs:
            check_trainer_logprobs(trainer, settings)
        self.settings = settings
        self.trainer = trainer

    def _hook_dataset_ids(self, trainer) -> None:
        hook_dataset_ids(trainer, self.dataset_id_column, self._set_pending_ids)

    def _set_pending_ids(self, ids: list[str] | None) -> None:
        self._pending_ids = ids

    # ------------------------------------------------------------------ requests
    def _dataset_ids(self, prompts: list) -> list[str | None]:
        """The dataset id of each prompt: from the hooked column, from ``dataset_id_fn``, or None."""
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
            return list(self._pending_ids)
        if self.dataset_id_fn is not None:
            return [str(self.dataset_id_fn(p)) for p in prompts]
        return [None] * len(prompts)

    def requests_for(
        self, prompts: list, trainer, prompt_ids: Sequence[Sequence[int]] | None = None
    ) -> list[RolloutRequest]:
        """The :class:`~spec_rl.rollout.speculative.RolloutRequest` of each prompt of one ``rollout_func`` call.

        Slot of sample i: ``(process_index * len(prompts) + i) % G`` with G =
        ``trainer.num_generations`` (``num_generations_eval`` in evaluation); see the module
        docstring for why.

        Raises:
            RuntimeError: two samples of one group have different prompts (the batch is not
                laid out by TRL's RepeatSampler, so slots would be wrong), or
                ``dataset_id_column`` is set but :meth:`attach` was not called.
        """
        if prompt_ids is None:
            prompt_ids = tokenize_prompts(prompts, trainer)
        group = group_size(trainer)
        offset = trainer.accelerator.process_index * len(prompts)
        return batch_requests(prompt_ids, self._dataset_ids(prompts), group, offset)

    # ------------------------------------------------------------------ rollout
    def _rollouts_for(self, model, trainer) -> TrainerRollouts:
        """The training/evaluation rollouts of ``model`` (rebuilt for another model, history index or settings)."""
        key = (id(model), id(self.history_index), self.settings)
        if self._rollouts is None or self._rollouts_key != key:
            self._rollouts = TrainerRollouts(
                model, trainer, self.settings, self.cache, self.history_index, self._options
            )
            self._rollouts_key = key
        return self._rollouts

    def _run_rollout(self, requests, trainer, training: bool, step: int) -> tuple[RolloutResult, TrainerRollouts]:
        """One speculative rollout on the unwrapped model in eval mode, under the trainer's autocast."""
        salt = self._seeds.salt(training, step, trainer.accelerator.process_index)
        with unwrapped_model(trainer) as model, torch.no_grad():
            was_training = model.training
            model.eval()  # deterministic scoring and sampling (no dropout)
            try:
                rollouts = self._rollouts_for(model, trainer)
                with trainer.accelerator.autocast():
                    result = rollouts.run(requests, training, step, salt, self.cache)
            finally:
                model.train(was_training)
        return result, rollouts

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
        if self.trainer is not trainer:
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
        t0 = time.perf_counter()
        result, rollouts = self._run_rollout(requests, trainer, training, step)
        self.last_result = result
        self.last_requests = requests
        stats = result.stats.to_dict()
        mode = (rollouts.train if training else rollouts.eval).mode
        self.history.append(
            {
                "call": "train" if training else "eval",
                "step": step,
                **mode.to_dict(),
                "wall_seconds": time.perf_counter() - t0,
                **stats,
            }
        )
        if self.log_metrics and training and hasattr(trainer, "_log_metric"):
            log_rollout_metrics(trainer, stats)
        return {
            "prompt_ids": [list(p) for p in result.prompt_ids],
            "completion_ids": [list(r) for r in result.response_ids],
            "logprobs": [[float(x) for x in lp] for lp in result.logprobs],
        }

    # ------------------------------------------------------------------ persistence
    @property
    def process_index(self) -> int:
        """The bound trainer's process index (0 before :meth:`attach` or the first call)."""
        return int(self.trainer.accelerator.process_index) if self.trainer is not None else 0

    def checkpoint_file(self, checkpoint_dir: str | os.PathLike, process_index: int = 0) -> Path:
        """Where the cache of process ``process_index`` lives inside a checkpoint folder."""
        return ranked_path(Path(checkpoint_dir) / CACHE_FILENAME, process_index)

    def save_cache(self, path: str | os.PathLike) -> Path:
        """Write the cache atomically (see :meth:`spec_rl.drafts.cache.RolloutCache.save`)."""
        return self.cache.save(path)

    def load_cache(self, path: str | os.PathLike) -> None:
        """Replace the cache with the file at ``path``; check it against the trainer's settings once known.

        Raises:
            UnsupportedTrainerConfig: the file's drafts were sampled with other settings
                than those of the validated trainer.
        """
        self.cache = RolloutCache.load(path)
        if self.settings is not None:
            check_cache_settings(self.cache, self.settings)

    def history_file(self, checkpoint_dir: str | os.PathLike, process_index: int = 0) -> Path:
        """Where the history index of process ``process_index`` lives inside a checkpoint folder."""
        return ranked_path(Path(checkpoint_dir) / HISTORY_FILENAME, process_index)

    def load_history(self, path: str | os.PathLike) -> None:
        """Replace the history index with the file at ``path`` (written by :meth:`HistoryIndex.save`).

        Raises:
            RuntimeError: tail speculation is off (``history_spec=False`` or ``spec_tokens=0``).
        """
        if self.history_index is None:
            raise RuntimeError("this SpecRLRollout has no history index (history_spec=False or spec_tokens=0)")
        self.history_index = HistoryIndex.load(path)
