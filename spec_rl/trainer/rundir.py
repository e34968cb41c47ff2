"""May a new run or a resume use this run directory (:func:`~spec_rl.trainer.run.run_modes`)?

A new run never writes into a directory that holds a run (it would mix or overwrite results); a resume needs one, and
every label that finished an epoch must have a committed checkpoint (:mod:`spec_rl.trainer.checkpoint`)."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from pathlib import Path

from .checkpoint import POINTER, Checkpoint, latest_checkpoint

SUMMARY_FILE = "summary.json"
INFO_FILE = "run_info.json"
_RUN_FILES = (SUMMARY_FILE, INFO_FILE)
_LABEL_MARKS = re.compile(rf"metrics\.jsonl|{POINTER}|checkpoint(-\d+)?")


class RunDirError(ValueError):
    """The run directory cannot be used as asked (it holds a run, holds none to resume, or is not writable)."""


def check_writable_dir(out_dir: str | os.PathLike) -> Path:
    """Create ``out_dir`` if needed; RunDirError when it is a file, cannot be created or is not writable."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise RunDirError(f"--out {out_dir} is a file, not a folder; pass a folder for the run directory")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        why = err.strerror or err
        raise RunDirError(f"--out {out_dir}: cannot create the folder ({why}); choose a writable place") from None
    if not os.access(out_dir, os.W_OK | os.X_OK):
        raise RunDirError(f"--out {out_dir}: the folder is not writable; choose a writable place")
    return out_dir


def run_contents(out_dir: str | os.PathLike) -> list[str]:
    """What in ``out_dir`` belongs to an earlier run (paths relative to it; empty for a fresh folder)."""
    out_dir = Path(out_dir)
    found = [name for name in _RUN_FILES if (out_dir / name).exists()]
    for folder in sorted(p for p in out_dir.iterdir() if p.is_dir()) if out_dir.is_dir() else []:
        found += sorted(f"{folder.name}/{p.name}" for p in folder.iterdir() if _LABEL_MARKS.fullmatch(p.name))
    return found


def read_summary(out_dir: str | os.PathLike) -> dict[str, list[dict]]:
    """The per-label epoch records of ``out_dir/summary.json`` ({} without it); RunDirError when it is not a summary."""
    path = Path(out_dir) / SUMMARY_FILE
    if not path.is_file():
        return {}
    try:
        summary = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise RunDirError(f"{path} is not readable JSON ({err}); move it away to resume without it") from None
    runs = summary.get("runs") if isinstance(summary, dict) else None
    if not isinstance(runs, dict) or not all(isinstance(v, list) for v in runs.values()):
        raise RunDirError(
            f'{path} is not a run summary ({{"runs": {{label: [epoch record, ...]}}}}); '
            "move it away to resume without it"
        )
    return runs


def plan_run(out_dir: str | os.PathLike, modes: Sequence[str], resume: bool) -> dict[str, Checkpoint | None]:
    """Check that ``out_dir`` can take this run; the checkpoint each label resumes from (None: epoch 1). RunDirError:
    it holds a run (no ``resume``), none (``resume``), a label with epochs but no checkpoint, or is not writable."""
    if resume and not Path(out_dir).is_dir():  # nothing to resume: create nothing
        raise RunDirError(f"--resume: {out_dir} does not exist; drop --resume to start a new run there")
    out_dir = check_writable_dir(out_dir)
    found = run_contents(out_dir)
    if not resume:
        if found:
            shown = ", ".join(found[:4]) + (", ..." if len(found) > 4 else "")
            raise RunDirError(
                f"--out {out_dir} already holds a run ({shown}); pass --resume to continue it, "
                "or a fresh --out to start a new run"
            )
        return {mode: None for mode in modes}
    if not found:
        raise RunDirError(
            f"--resume: {out_dir} holds no run to resume (no summary.json, metrics or checkpoint); "
            "drop --resume to start a new run there"
        )
    previous = read_summary(out_dir)
    plan = {}
    for mode in modes:
        plan[mode] = latest_checkpoint(out_dir / mode)
        done = len(previous.get(mode, []))
        if plan[mode] is None and done:
            raise RunDirError(
                f"--resume: {out_dir / mode} has {done} finished epoch(s) in summary.json but no complete checkpoint "
                "to continue from (was it run with --no-checkpoint?); start a new run with a fresh --out"
            )
    return plan
