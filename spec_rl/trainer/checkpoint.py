"""Versioned checkpoints of one trainer run: every version is committed as one unit or not at all.

A trainer's run directory holds::

    LATEST                  the name of the newest committed version, e.g. "checkpoint-16"
    checkpoint-16/          one version, named by the training steps done when it was written
        config.json, model.safetensors, generation_config.json, tokenizer files   (transformers format)
        optimizer.pt        AdamW state
        rollout_cache.safetensors, history.safetensors    drafts and the history index (spec_rl formats)
        trainer_state.json  epoch, step, config and the per-epoch records so far
        COMPLETE            written last: epoch, step and the size of every file above

A version is written completely (every file fsynced), then marked ``COMPLETE``, and only then does
``LATEST`` move to it (one :func:`os.replace`); older versions are deleted after that. So a process
killed at any instant leaves either the old pointer and an old complete version, or the new pointer
and the new complete version. Reading takes the version ``LATEST`` names when its marker checks out,
else the newest version whose marker does; on resume every other version and every temporary file
left by a killed writer is removed. Each version is a plain transformers checkpoint
(``AutoModelForCausalLM.from_pretrained("run/spec/checkpoint-16")`` loads it).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..util.atomic import atomic_write_text, fsync_dir, fsync_file, remove_leftovers
from ..util.faults import fault_point

POINTER = "LATEST"
MARKER = "COMPLETE"
STATE_FILE = "trainer_state.json"
CACHE_FILE = "rollout_cache.safetensors"
HISTORY_FILE = "history.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
_VERSION = re.compile(r"checkpoint-(\d+)")


@dataclass(frozen=True)
class Checkpoint:
    """One complete checkpoint version.

    Attributes:
        path: its folder (a transformers checkpoint plus the trainer's files).
        state: the parsed trainer_state.json: ``epoch`` (epochs done, 1-based), ``step`` (training
            steps done), ``config``, ``records`` (one per finished epoch).
    """

    path: Path
    state: dict

    @property
    def epoch(self) -> int:
        return int(self.state["epoch"])

    @property
    def step(self) -> int:
        return int(self.state["step"])


def _versions(run_dir: Path) -> list[tuple[int, Path]]:
    """Every ``checkpoint-<step>`` folder of ``run_dir``, oldest first."""
    if not run_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in run_dir.iterdir() if p.is_dir() and (m := _VERSION.fullmatch(p.name))]
    return sorted(found)


def _verified(path: Path) -> Checkpoint | None:
    """The checkpoint in ``path`` if its marker parses and every file it lists has the listed size."""
    try:
        marker = json.loads((path / MARKER).read_text())
        if any((path / name).stat().st_size != size for name, size in marker["files"].items()):
            return None
        state = json.loads((path / STATE_FILE).read_text())
        if int(state["step"]) != int(marker["step"]) or int(state["epoch"]) != int(marker["epoch"]):
            return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return Checkpoint(path, state)


def _pointed(run_dir: Path) -> Path | None:
    """The folder ``LATEST`` names, or None when the pointer is missing or damaged."""
    try:
        name = (run_dir / POINTER).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return run_dir / name if _VERSION.fullmatch(name) else None


def latest_checkpoint(run_dir: str | os.PathLike, log: Callable[[str], None] | None = None) -> Checkpoint | None:
    """The committed checkpoint of ``run_dir``: the one ``LATEST`` names, else the newest complete one.

    Parameters
    ----------
    run_dir : path
        A trainer's run directory (``out/<mode>`` of :func:`~spec_rl.trainer.run.run_modes`).
    log : callable, optional
        Told when the pointer is missing or damaged and an older rule picks the version.

    Returns
    -------
    Checkpoint or None
        None when no complete version exists.
    """
    run_dir = Path(run_dir)
    pointed = _pointed(run_dir)
    if pointed is not None and (ckpt := _verified(pointed)) is not None:
        return ckpt
    for _, path in reversed(_versions(run_dir)):
        if (ckpt := _verified(path)) is not None:
            if log is not None:
                log(f"{run_dir / POINTER} is missing or names no complete checkpoint; using {path.name}")
            return ckpt
    return None


def remove_stale(run_dir: str | os.PathLike, keep: Checkpoint | None) -> list[Path]:
    """Delete leftover temporary files and every checkpoint version but ``keep``; returns what was removed.

    Run at resume: versions other than the committed one are partial, uncommitted (written after the
    pointer's) or already superseded.
    """
    run_dir = Path(run_dir)
    removed = remove_leftovers(run_dir)
    for _, path in _versions(run_dir):
        if keep is None or path != keep.path:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def commit_checkpoint(run_dir: str | os.PathLike, state: dict, write_files: Callable[[Path], None]) -> Checkpoint:
    """Write one checkpoint version and make it the committed one.

    Parameters
    ----------
    run_dir : path
        The trainer's run directory.
    state : dict
        JSON-serialisable trainer state with at least ``epoch`` and ``step`` (ints); the version is
        named ``checkpoint-<step>``.
    write_files : callable
        ``write_files(folder)`` writes the model, optimizer, cache and history files into ``folder``.

    Returns
    -------
    Checkpoint
        The new committed version.
    """
    run_dir = Path(run_dir)
    folder = run_dir / f"checkpoint-{int(state['step'])}"
    if folder.exists():  # written by a killed run past the committed step: never committed
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    write_files(folder)
    fault_point("checkpoint.files")
    atomic_write_text(folder / STATE_FILE, json.dumps(state), fsync=False)
    files = {}
    for path in sorted(folder.iterdir()):
        if path.is_file():
            fsync_file(path)
            files[path.name] = path.stat().st_size
    fsync_dir(folder)
    marker = {"epoch": int(state["epoch"]), "step": int(state["step"]), "files": files}
    atomic_write_text(folder / MARKER, json.dumps(marker))
    fault_point("checkpoint.marked")
    atomic_write_text(run_dir / POINTER, folder.name + "\n")
    fault_point("checkpoint.committed")
    for _, path in _versions(run_dir):
        if path != folder:
            shutil.rmtree(path, ignore_errors=True)
    return Checkpoint(folder, state)
