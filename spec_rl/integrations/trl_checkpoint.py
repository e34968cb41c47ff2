"""The rollout cache and history index saved with TRL checkpoints (one file each per process) and reloaded on resume."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

from transformers import TrainerCallback

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
        spec = self.spec
        resume = getattr(args, "resume_from_checkpoint", None)
        folder = (
            Path(resume)
            if isinstance(resume, str) and os.path.isdir(resume)
            else Path(args.output_dir) / f"checkpoint-{state.global_step}"
        )
        cache_file = ranked_path(folder / CACHE_FILENAME, spec.process_index)
        history_file = ranked_path(folder / HISTORY_FILENAME, spec.process_index)
        if len(spec.cache) == 0:
            if cache_file.is_file():
                spec.load_cache(cache_file)
            else:
                warnings.warn(
                    f"spec-rl: resuming at step {state.global_step} without a rollout cache at {cache_file}; "
                    "the first epoch after resuming generates from scratch",
                    stacklevel=2,
                )
        # Without a saved history index, tail speculation starts from an empty history (still lossless).
        if spec.history_index is not None and len(spec.history_index) == 0 and history_file.is_file():
            spec.load_history(history_file)

    def on_save(self, args, state, control, **kwargs):
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if folder.is_dir():
            self._save(folder / CACHE_FILENAME, folder / HISTORY_FILENAME)
        self.on_train_end(args, state, control)  # the copy at cache_path too

    def on_train_end(self, args, state, control, **kwargs):
        if self.spec.cache_path is not None:
            self._save(self.spec.cache_path, history_path(self.spec.cache_path))

    def _save(self, cache_file: Path, history_file: Path) -> None:
        """Save the cache and history index to these files, ranked for this process (:func:`ranked_path`)."""
        rank = self.spec.process_index
        self.spec.cache.save(ranked_path(cache_file, rank))
        if self.spec.history_index is not None:
            self.spec.history_index.save(ranked_path(history_file, rank))
