"""The rollout cache saved with TRL checkpoints and reloaded when training resumes.

Each process keeps the drafts of the samples it generated, so each writes its own
file: ``checkpoint-<step>/spec_rl_rollout_cache.safetensors`` for rank 0 and
``...rollout_cache.rank<k>.safetensors`` for rank k > 0. Writes are atomic
(:meth:`spec_rl.cache.RolloutCache.save`).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from transformers import TrainerCallback

if TYPE_CHECKING:
    from .trl import SpecRLRollout

__all__ = ["CACHE_FILENAME", "RolloutCacheCallback", "ranked_path"]

#: File name of the rollout cache inside a TRL checkpoint folder (``checkpoint-<step>/``).
#: Processes other than rank 0 add ``.rank<k>`` before the suffix.
CACHE_FILENAME = "spec_rl_rollout_cache.safetensors"


def ranked_path(path: str | os.PathLike, process_index: int) -> Path:
    """``path`` for rank 0; ``<stem>.rank<k><suffix>`` beside it for rank k > 0.

    Example
    -------
    >>> ranked_path("ckpt/spec_rl_rollout_cache.safetensors", 2).name
    'spec_rl_rollout_cache.rank2.safetensors'
    """
    path = Path(path)
    return path if process_index == 0 else path.with_name(f"{path.stem}.rank{process_index}{path.suffix}")


class RolloutCacheCallback(TrainerCallback):
    """Saves the adapter's rollout cache next to each TRL checkpoint and reloads it on resume.

    Registered by :meth:`spec_rl.integrations.trl.SpecRLRollout.attach`. It uses the
    adapter's public ``cache``, ``cache_path``, ``process_index``, ``checkpoint_file`` and
    ``load_cache``.
    """

    def __init__(self, spec: SpecRLRollout):
        self.spec = spec

    def on_train_begin(self, args, state, control, **kwargs):
        if state.global_step > 0 and len(self.spec.cache) == 0:
            resume = getattr(args, "resume_from_checkpoint", None)
            folder = (
                Path(resume)
                if isinstance(resume, str) and os.path.isdir(resume)
                else Path(args.output_dir) / f"checkpoint-{state.global_step}"
            )
            path = self.spec.checkpoint_file(folder, self.spec.process_index)
            if path.is_file():
                self.spec.load_cache(path)
            else:
                warnings.warn(
                    f"spec-rl: resuming at step {state.global_step} without a rollout cache at {path}; "
                    "the first epoch after resuming generates from scratch",
                    stacklevel=2,
                )

    def on_save(self, args, state, control, **kwargs):
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if folder.is_dir():
            self.spec.cache.save(self.spec.checkpoint_file(folder, self.spec.process_index))
        self._save_at_cache_path()

    def on_train_end(self, args, state, control, **kwargs):
        self._save_at_cache_path()

    def _save_at_cache_path(self) -> None:
        if self.spec.cache_path is not None:
            self.spec.cache.save(ranked_path(self.spec.cache_path, self.spec.process_index))
