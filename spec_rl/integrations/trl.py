"""SPEC-RL speculative rollouts inside TRL's ``GRPOTrainer`` through its ``rollout_func`` hook (trl 1.x).

TRL hands ``rollout_func`` this process's prompts only, each repeated ``num_generations`` times in a row, and passes
returned keys other than ``prompt_ids``, ``completion_ids`` and ``logprobs`` to the reward functions
(docs/integrations.md "TRL")."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from ..acceptance.mode import ADAPTER_MODE, RolloutMode
from ..drafts.cache import RolloutCache
from ..drafts.history import HistoryIndex
from ..rollout.speculative import RolloutRequest, RolloutResult
from ..sampling.distribution import SamplingSettings
from ..util.validation import check_int, check_type
from .requests import adapter_mode
from .trl_batch import batch_requests, group_size, hook_dataset_ids, tokenize_prompts, trainer_owner, unwrapped_model
from .trl_checkpoint import CACHE_FILENAME, HISTORY_FILENAME, RolloutCacheCallback, history_path
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
    """A ``rollout_func`` for ``trl.GRPOTrainer`` that reuses last epoch's completions as drafts (SPEC-RL Alg. 1).

    ``trainer.state.global_step`` versions the drafts and seeds the uniforms (docs/design.md "Randomness");
    evaluation batches (``trainer.model.training`` False) use no drafts and store nothing.

    Args:
        mode: a :class:`~spec_rl.acceptance.mode.RolloutMode` or its name (default ``"spec"``: the paper's lenient
            rule at e^0.5 with tail speculation, the most reuse, a measured learning cost; ``"exact"``: lossless;
            ``"vanilla"``: no reuse, the baseline; ``"l=1"``, ...).
        seed: run seed (default ``trainer.args.seed``).
        cache_path: a ``.safetensors`` cache file, loaded if present, written at every checkpoint and at the end.
        dataset_id_column, dataset_id_fn: a stable row id, from a column (read through :meth:`attach`) or as
            ``fn(prompt) -> str``; without either, dataset rows with the same prompt share drafts.
        max_model_len: context limit in tokens (default the model's ``max_position_embeddings``).
        check_logprobs: check at :meth:`attach` that TRL's log-probs are ``log_softmax(logits / T)``.

    After a call, ``last_result`` and ``last_requests`` hold its RolloutResult and requests; ``history`` holds one dict
    per call. Raises ValueError for a mode name that names no mode, a bad max_model_len or both dataset-id options,
    TypeError for a dataset_id_column that is not a str or a dataset_id_fn that is not callable."""

    def __init__(
        self,
        mode: RolloutMode | str = ADAPTER_MODE,
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
        check_type("dataset_id_column", dataset_id_column, (str, type(None)), "a column name (str)")
        if dataset_id_fn is not None and not callable(dataset_id_fn):
            raise TypeError("dataset_id_fn must be a callable prompt -> str")
        if max_model_len is not None:
            check_int("max_model_len", max_model_len, low=2)
        self.mode = adapter_mode(mode)
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
        self.owner: str | None = None  # the policy the drafts belong to, set when a trainer is bound
        self.settings: SamplingSettings | None = None
        self._options = RolloutOptions(self.mode, verify_backend, self.max_model_len, seed)
        self._rollouts: TrainerRollouts | None = None
        self._rollouts_key: tuple | None = None  # the model, history index and settings they were built for
        self._seeds = CallSeeds()
        self._pending_ids: list | None = None

    def attach(self, trainer) -> SpecRLRollout:
        """Bind to ``trainer`` (built with ``rollout_func=self``) before ``trainer.train()``: check it, hook the
        dataset-id column, save with checkpoints. Without it the checks run at the first rollout; the rest is missing.
        Raises UnsupportedTrainerConfig: another ``rollout_func``, or a failed check (trl_checks)."""
        if getattr(trainer, "rollout_func", None) is not self:
            raise UnsupportedTrainerConfig(
                "trainer.rollout_func is not this SpecRLRollout; build the trainer with "
                "GRPOTrainer(..., rollout_func=spec) and then call spec.attach(trainer)"
            )
        self._validate(trainer)
        if self.dataset_id_column is not None and not getattr(trainer, "_spec_rl_id_hook", False):
            hook_dataset_ids(trainer, self.dataset_id_column, self._set_pending_ids)
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
        self.owner = trainer_owner(trainer)
        if self.owner is not None:
            self.cache.claim(self.owner, f"rollout cache {self.cache_path}" if self.cache_path else None)
        if self.check_logprobs:
            check_trainer_logprobs(trainer, settings)
        self.settings = settings
        self.trainer = trainer

    def _set_pending_ids(self, ids: list[str] | None) -> None:
        self._pending_ids = ids

    def _dataset_ids(self, prompts: list) -> list[str | None]:
        """The dataset id of each prompt: from the hooked column, ``dataset_id_fn``, or None."""
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
        """The RolloutRequest of each prompt of one call; RuntimeError for a group with different prompts or for
        ``dataset_id_column`` without :meth:`attach`, UnsupportedTrainerConfig for multimodal prompts."""
        if prompt_ids is None:
            prompt_ids = tokenize_prompts(prompts, trainer)
        group = group_size(trainer)
        offset = trainer.accelerator.process_index * len(prompts)
        return batch_requests(prompt_ids, self._dataset_ids(prompts), group, offset)

    def _run_rollout(self, requests, trainer, training: bool, step: int) -> RolloutResult:
        """One rollout on the unwrapped model in eval mode, under the trainer's autocast; the rollouts are rebuilt for
        another model, history index or settings."""
        salt = self._seeds.salt(training, step, trainer.accelerator.process_index)
        with unwrapped_model(trainer) as model, torch.no_grad():
            was_training = model.training
            model.eval()  # no dropout in scoring and sampling
            try:
                key = (id(model), id(self.history_index), self.settings)
                if self._rollouts is None or self._rollouts_key != key:
                    history, options = self.history_index, self._options
                    self._rollouts = TrainerRollouts(model, trainer, self.settings, self.cache, history, options)
                    self._rollouts_key = key
                with trainer.accelerator.autocast():
                    result = self._rollouts.run(requests, training, step, salt, self.cache)
            finally:
                model.train(was_training)
        return result

    def __call__(self, prompts: list, trainer) -> dict[str, list]:
        """TRL's ``rollout_func``: one completion per prompt (string or chat message list), in order.

        Returns ``{"prompt_ids": [[int]], "completion_ids": [[int]], "logprobs": [[float]]}``; ``logprobs[i][t]`` is the
        behaviour log-prob (nats) of completion token t: the sampling log-prob under the current model
        (``log_softmax(logits / T)``, restricted to top-k/top-p when set) for a generated token, the log-prob of the
        path that kept it for a reused one (docs/design.md "Behaviour log-probs"); TRL's
        ``vllm_importance_sampling_correction`` weighs tokens by them. RuntimeError: ``dataset_id_column`` is set but
        :meth:`attach` was not called."""
        if self.trainer is not trainer:
            self._validate(trainer)
        if not prompts:
            return {"prompt_ids": [], "completion_ids": [], "logprobs": []}
        training = bool(trainer.model.training)
        requests = self.requests_for(prompts, trainer)
        step = int(trainer.state.global_step)
        t0 = time.perf_counter()
        result = self._run_rollout(requests, trainer, training, step)
        self.last_result = result
        self.last_requests = requests
        stats = result.stats.to_dict()
        mode = (self._rollouts.train if training else self._rollouts.eval).mode
        call = {"call": "train" if training else "eval", "step": step, **mode.to_dict()}
        self.history.append({**call, "wall_seconds": time.perf_counter() - t0, **stats})
        if self.log_metrics and training and hasattr(trainer, "_log_metric"):
            log_rollout_metrics(trainer, stats)
        return {
            "prompt_ids": [list(p) for p in result.prompt_ids],
            "completion_ids": [list(r) for r in result.response_ids],
            "logprobs": [[float(x) for x in lp] for lp in result.behaviour_logprobs],
        }

    @property
    def process_index(self) -> int:
        """The bound trainer's process index (0 before one is bound)."""
        return int(self.trainer.accelerator.process_index) if self.trainer is not None else 0

    def load_cache(self, path: str | os.PathLike) -> None:
        """Replace the cache with the file at ``path``; UnsupportedTrainerConfig if sampled with other settings."""
        cache = RolloutCache.load(path)
        if self.owner is not None:
            cache.claim(self.owner, f"rollout cache {path}")
        self.cache = cache
        if self.settings is not None:
            check_cache_settings(self.cache, self.settings)

    def load_history(self, path: str | os.PathLike) -> None:
        """Replace the history index with the file at ``path``; RuntimeError when tail speculation is off."""
        if self.history_index is None:
            raise RuntimeError("this SpecRLRollout has no history index (its mode has tail=0)")
        self.history_index = HistoryIndex.load(path)
