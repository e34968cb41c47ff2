"""Atomic file writes: a reader (or a restarted run) sees the old file or the new one, never a torn one.

Every file spec-rl stores (rollout caches, draft files, run summaries) is
written to a temporary file in the target's folder, optionally fsynced, and
renamed over the target with :func:`os.replace`, which POSIX makes atomic
within one filesystem. Temporary names start with ``.`` and end with
``.tmp`` so leftovers of a killed process are easy to find and remove.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from .faults import fault_point

TMP_SUFFIX = ".tmp"


def fsync_dir(folder: str | os.PathLike) -> None:
    """Make a rename inside ``folder`` durable (best effort: some filesystems refuse)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_file(path: str | os.PathLike) -> None:
    """Flush one file's data to disk."""
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def is_leftover(path: str | os.PathLike) -> bool:
    """Whether ``path`` is the temporary file of an interrupted :func:`atomic_write` (``.<name>.<random>.tmp``)."""
    name = Path(path).name
    return name.startswith(".") and name.endswith(TMP_SUFFIX)


def remove_leftovers(folder: str | os.PathLike) -> list[Path]:
    """Delete the temporary files that killed writers left directly in ``folder``; returns what was removed.

    Only plain files named like :func:`atomic_write`'s temporaries are touched; a missing folder is fine.
    """
    folder = Path(folder)
    if not folder.is_dir():
        return []
    removed = [p for p in folder.iterdir() if p.is_file() and not p.is_symlink() and is_leftover(p)]
    for p in removed:
        p.unlink(missing_ok=True)
    return removed


def atomic_write(path: str | os.PathLike, write: Callable[[str], None], fsync: bool = True) -> Path:
    """Call ``write(tmp_path)``, then rename the temporary file over ``path``.

    Args:
        path: the target file; its folder is created if missing.
        write: writes the complete content to the path it is given.
        fsync: flush the file (and the folder after the rename) to disk, so
            the write also survives a machine crash.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        whatever ``write`` or the filesystem raises; the temporary file is
        removed and any earlier file at ``path`` is left untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=TMP_SUFFIX, dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        if fsync:
            fsync_file(tmp)
        fault_point(f"write:{path.name}")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    if fsync:
        fsync_dir(path.parent)
    return path


def atomic_write_text(path: str | os.PathLike, text: str, fsync: bool = True) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically (see :func:`atomic_write`)."""

    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)

    return atomic_write(path, write, fsync)


def atomic_save_safetensors(
    path: str | os.PathLike, tensors: dict[str, torch.Tensor], metadata: dict[str, str], fsync: bool = True
) -> Path:
    """Save ``tensors`` with string ``metadata`` as one safetensors file, atomically."""
    from safetensors.torch import save_file

    contiguous = {k: v.contiguous() for k, v in tensors.items()}
    return atomic_write(path, lambda tmp: save_file(contiguous, tmp, metadata=metadata), fsync)
