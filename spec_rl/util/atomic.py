"""Atomic file writes: a reader (or a restarted run) sees the old file or the new one, never a torn one. Content goes to
a temporary ``.<name>.<random>.tmp`` in the target's folder, then :func:`os.replace` renames it over the target."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

TMP_SUFFIX = ".tmp"


def fsync_dir(folder: str | os.PathLike) -> None:
    """Make a rename inside ``folder`` durable (best effort: some filesystems refuse)."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def fsync_file(path: str | os.PathLike) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def is_leftover(path: str | os.PathLike) -> bool:
    """Whether ``path`` is the temporary file of an interrupted :func:`atomic_write` (``.<name>.<random>.tmp``)."""
    name = Path(path).name
    return name.startswith(".") and name.endswith(TMP_SUFFIX)


def remove_leftovers(folder: str | os.PathLike) -> list[Path]:
    """Delete and return the temporaries killed writers left directly in ``folder`` (a missing folder is fine)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    removed = [p for p in folder.iterdir() if p.is_file() and not p.is_symlink() and is_leftover(p)]
    for p in removed:
        p.unlink(missing_ok=True)
    return removed


def atomic_write(path: str | os.PathLike, write: Callable[[str], None], fsync: bool = True) -> Path:
    """Call ``write(tmp_path)`` to write the whole content, then rename the temporary over ``path`` (folder created
    if missing); ``fsync`` makes it survive a machine crash. On an error the temporary is removed, the old file kept."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=TMP_SUFFIX, dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        if fsync:
            fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if fsync:
        fsync_dir(path.parent)
    return path


def atomic_write_text(path: str | os.PathLike, text: str, fsync: bool = True) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically (see :func:`atomic_write`)."""
    return atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"), fsync)


def atomic_save_safetensors(
    path: str | os.PathLike, tensors: dict[str, torch.Tensor], metadata: dict[str, str], fsync: bool = True
) -> Path:
    """Save ``tensors`` with string ``metadata`` as one safetensors file, atomically."""
    from safetensors.torch import save_file

    contiguous = {k: v.contiguous() for k, v in tensors.items()}
    return atomic_write(path, lambda tmp: save_file(contiguous, tmp, metadata=metadata), fsync)
