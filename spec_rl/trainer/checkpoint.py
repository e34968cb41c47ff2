"""Versioned checkpoints of one trainer run: a version is committed as one unit or not at all.

A ``checkpoint-<steps>/`` folder (a plain transformers checkpoint plus the trainer's files) gets its ``COMPLETE`` marker
last; only then does ``LATEST`` move to it and are older versions deleted (docs/design.md "Crash safety")."""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..util.atomic import atomic_write_text, fsync_dir, fsync_file, remove_leftovers

POINTER = "LATEST"
MARKER = "COMPLETE"
STATE_FILE = "trainer_state.json"
CACHE_FILE = "rollout_cache.safetensors"
HISTORY_FILE = "history.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
_VERSION = re.compile(r"checkpoint-(\d+)")


@dataclass(frozen=True)
class Checkpoint:
    """One complete checkpoint version: its folder and the parsed trainer_state.json (``epoch`` and ``step`` done,
    ``config``, ``records``)."""

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


def _remove_versions(run_dir: Path, keep: Path | None) -> list[Path]:
    """Delete every version of ``run_dir`` but ``keep``; returns them."""
    removed = [path for _, path in _versions(run_dir) if path != keep]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


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


def latest_checkpoint(run_dir: str | os.PathLike, log: Callable[[str], None] | None = None) -> Checkpoint | None:
    """The committed checkpoint of a trainer's ``run_dir`` (``out/<label>``): the one ``LATEST`` names, else the
    newest complete one (told to ``log``); None when no version is complete."""
    run_dir = Path(run_dir)
    try:
        pointed = (run_dir / POINTER).read_text().strip()
    except (OSError, UnicodeDecodeError):  # missing or damaged
        pointed = ""
    if _VERSION.fullmatch(pointed) and (ckpt := _verified(run_dir / pointed)) is not None:
        return ckpt
    for _, path in reversed(_versions(run_dir)):
        if (ckpt := _verified(path)) is not None:
            if log is not None:
                log(f"{run_dir / POINTER} is missing or names no complete checkpoint; using {path.name}")
            return ckpt
    return None


def remove_stale(run_dir: str | os.PathLike, keep: Checkpoint | None) -> list[Path]:
    """At resume, delete temporary files and every version but ``keep`` (partial, uncommitted or superseded);
    returns what was removed."""
    run_dir = Path(run_dir)
    return remove_leftovers(run_dir) + _remove_versions(run_dir, None if keep is None else keep.path)


def commit_checkpoint(run_dir: str | os.PathLike, state: dict, write_files: Callable[[Path], None]) -> Checkpoint:
    """Write version ``checkpoint-<state["step"]>`` (``state``: JSON, with int ``epoch`` and ``step``; ``write_files``
    fills the folder with model, optimizer, cache and history) and make it the committed one."""
    run_dir = Path(run_dir)
    folder = run_dir / f"checkpoint-{int(state['step'])}"
    if folder.exists():  # written by a killed run past the committed step: never committed
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    write_files(folder)
    atomic_write_text(folder / STATE_FILE, json.dumps(state), fsync=False)
    files = {}
    for path in sorted(folder.iterdir()):
        if path.is_file():
            fsync_file(path)
            files[path.name] = path.stat().st_size
    fsync_dir(folder)
    marker = {"epoch": int(state["epoch"]), "step": int(state["step"]), "files": files}
    atomic_write_text(folder / MARKER, json.dumps(marker))
    atomic_write_text(run_dir / POINTER, folder.name + "\n")
    _remove_versions(run_dir, keep=folder)
    return Checkpoint(folder, state)
