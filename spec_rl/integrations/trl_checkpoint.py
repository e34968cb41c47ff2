"""The rollout cache and history index saved with TRL checkpoints (one file each per process) and reloaded on resume."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

from transformers import TrainerCallback

__all__ = ["CACHE_FILENAME", "HISTORY_FILENAME", "RolloutCacheCallback", "history_path", "ranked_path"]

#: File name of the rollout cache inside a TRL checkpoint folder; rank k > 0 adds ``.rank<k>`` before the suffix.
CACHE_FILENAME = "spec_rl_rollout_cache.safetensors"
#: File name of the history index inside a TRL checkpoint folder (ranked the same way).
HISTORY_FILENAME = "spec_rl_history.safetensors"


def ranked_path(path: str | os.PathLike, process_index: int) -> Path:
    """``path`` for rank 0; ``<stem>.rank<k><suffix>`` beside it for rank k > 0."""
    path = Path(path)
    return path if process_index == 0 else path.with_name(f"{path.stem}.rank{process_index}{path.suffix}")


def history_path(cache_path: str | os.PathLike) -> Path:
    """The history index file beside a rollout cache file: ``<stem>.history<suffix>``."""
    path = Path(cache_path)
    return path.with_name(f"{path.stem}.history{path.suffix}")


class RolloutCacheCallback(TrainerCallback):
    """Saves the adapter's cache and history index with each checkpoint (atomically); reloads them on resume."""

    def __init__(self, spec):  # a SpecRLRollout, not imported: its module imports this one
        self.spec = spec

    def on_train_begin(self, args, state, control, **kwargs):
        if state.global_step == 0:
            return
        spec, rank = self.spec, self.spec.process_index
        resume = getattr(args, "resume_from_checkpoint", None)
        folder = (
            Path(resume)
            if isinstance(resume, str) and os.path.isdir(resume)
            else Path(args.output_dir) / f"checkpoint-{state.global_step}"
        )
        if len(spec.cache) == 0:
            path = spec.checkpoint_file(folder, rank)
            if path.is_file():
                spec.load_cache(path)
            else:
                warnings.warn(
                    f"spec-rl: resuming at step {state.global_step} without a rollout cache at {path}; "
                    "the first epoch after resuming generates from scratch",
                    stacklevel=2,
                )
        if spec.history_index is not None and len(spec.history_index) == 0:
            path = spec.history_file(folder, rank)
            if path.is_file():  # else tail speculation starts from an empty history (still lossless)
                spec.load_history(path)

    def on_save(self, args, state, control, **kwargs):
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if folder.is_dir():
            rank = self.spec.process_index
            self.spec.cache.save(self.spec.checkpoint_file(folder, rank))
            if self.spec.history_index is not None:
                self.spec.history_index.save(self.spec.history_file(folder, rank))
        self._save_at_cache_path()

    def on_train_end(self, args, state, control, **kwargs):
        self._save_at_cache_path()

    def _save_at_cache_path(self) -> None:
        if self.spec.cache_path is not None:
            rank = self.spec.process_index
            self.spec.cache.save(ranked_path(self.spec.cache_path, rank))
            if self.spec.history_index is not None:
                self.spec.history_index.save(ranked_path(history_path(self.spec.cache_path), rank))
