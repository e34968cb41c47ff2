"""Reading spec-rl's safetensors files back, checked before use: a file damaged after its atomic write may still
parse, and must neither load silently (bad log-probs or ids corrupt training far from the cause) nor fail deep in a
loader. :class:`FileCheck` raises one :class:`DamagedFileError` naming the file, the problem and the fix.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from ..sampling.distribution import SamplingSettings
from ..util.validation import INT32_MAX, INT64_MAX, LOGPROB_SLACK


class DamagedFileError(ValueError):
    """A stored file that parses but does not hold what spec-rl wrote: ``"<path>: <problem>; <fix>"``."""

    def __init__(self, path, problem: str, fix: str) -> None:
        super().__init__(f"{path}: {problem}; {fix}")
        self.path, self.problem = path, problem


def read_safetensors(path: str | os.PathLike, what: str) -> tuple[Path, dict[str, str], dict[str, torch.Tensor]]:
    """(path, metadata, tensors) of a safetensors file on the CPU; FileNotFoundError, or ValueError when unreadable."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no {what} at {path}")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as exc:  # safetensors raises its own error types
        raise ValueError(f"{path} is not a readable safetensors file ({what}): {exc}") from exc
    return path, meta, tensors


class FileCheck:
    """Checks of one stored file (``path``, its ``meta`` and ``tensors``); each failure raises
    :class:`DamagedFileError` ``"<path>: <problem>; <fix>"``, ``fix`` saying what to do about it."""

    def __init__(self, path, meta: dict[str, str], tensors: dict[str, torch.Tensor], fix: str) -> None:
        self.path, self.meta, self.tensors, self.fix = path, meta, tensors, fix

    def fail(self, problem: str) -> DamagedFileError:
        return DamagedFileError(self.path, problem, self.fix)

    def field(self, key: str) -> str:
        """Metadata ``key``'s text."""
        if key not in self.meta:
            raise self.fail(f"metadata {key!r} is missing")
        return self.meta[key]

    def json_field(self, key: str, kind: type, what: str | None = None):
        """Metadata ``key`` parsed as JSON, which must be a ``kind`` (e.g. list); ``what`` describes it in errors."""
        try:
            value = json.loads(self.field(key))
        except json.JSONDecodeError as exc:
            raise self.fail(f"metadata {key!r} is not valid JSON ({exc})") from exc
        if not isinstance(value, kind):
            raise self.fail(f"metadata {key!r} must be {what or 'a JSON ' + kind.__name__}, got {type(value).__name__}")
        return value

    def count_field(self, key: str) -> int:
        """Metadata ``key``: a decimal integer >= 0 written as text (e.g. a policy version)."""
        text = self.field(key)
        if not (text.isascii() and text.isdigit()):
            raise self.fail(f"metadata {key!r} must be a decimal integer >= 0, got {text!r}")
        return int(text)

    def tensor(self, name: str, dtype: torch.dtype, shape: tuple[int | None, ...]) -> torch.Tensor:
        """Tensor ``name`` with exactly ``dtype`` and ``shape`` (None: any size in that dimension)."""
        t = self.tensors.get(name)
        if t is None:
            raise self.fail(f"tensor {name!r} is missing")
        if t.dtype != dtype:
            raise self.fail(f"tensor {name!r} has dtype {t.dtype}, expected {dtype}")
        expected = tuple(n if s is None else s for n, s in zip(t.shape, shape)) if None in shape else tuple(shape)
        if tuple(t.shape) != expected or t.dim() != len(shape):
            want = f"{len(shape)}-D" if t.dim() != len(shape) and None in shape else expected
            raise self.fail(f"tensor {name!r} has shape {tuple(t.shape)}, expected {want}")
        return t

    def settings(self, value, name: str) -> SamplingSettings:
        """Sampling settings from their stored dict (:meth:`SamplingSettings.to_dict`)."""
        try:
            return SamplingSettings.from_dict(value, name=name)
        except (TypeError, ValueError) as exc:
            text = str(exc)
            raise self.fail(text if text.startswith(name) else f"{name}: {text}") from exc

    def in_range(self, name: str, t: torch.Tensor, high: int, why: str = "") -> None:
        t = t.to(torch.int64)  # compare without wrapping (2**31 does not fit in int32)
        bad = (t < 0) | (t >= high)
        if t.numel() and bool(bad.any()):
            bound = {INT32_MAX + 1: "2**31 - 1]", INT64_MAX: "inf)"}.get(high, f"{high})")
            raise self.fail(f"tensor {name!r} holds {int(t[bad][0])}, outside [0, {bound}{why}")

    def non_negative(self, name: str, t: torch.Tensor) -> None:
        self.in_range(name, t, INT64_MAX)

    def token_ids(self, name: str, t: torch.Tensor, vocab_size: int | None) -> None:
        """Token ids in [0, vocab_size) when it is known, else in the int32 range."""
        if vocab_size is None:
            self.in_range(name, t, INT32_MAX + 1)
        else:
            self.in_range(name, t, vocab_size, f" (vocab_size={vocab_size})")

    def logprobs(self, name: str, t: torch.Tensor) -> None:
        """Log-probabilities: <= 0 (up to float rounding), not NaN."""
        bad = torch.isnan(t) | (t > LOGPROB_SLACK)
        if t.numel() and bool(bad.any()):
            raise self.fail(f"tensor {name!r} must hold log-probabilities (<= 0, not NaN), got {t[bad][0].item()}")

    def offsets(self, name: str, t: torch.Tensor, total: int) -> None:
        """Offsets of back-to-back slices: start at 0, never decrease, end at ``total``."""
        if int(t[0]) != 0 or int(t[-1]) != total or bool((t[1:] < t[:-1]).any()):
            raise self.fail(f"tensor {name!r} must rise from 0 to {total} (the stored tokens), got {t.tolist()[:8]}")

    def unique(self, name: str, keys: list) -> None:
        if len(set(keys)) != len(keys):
            raise self.fail(f"{name!r} holds the same key twice")
