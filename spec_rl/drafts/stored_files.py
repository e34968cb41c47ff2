"""Reading spec-rl's safetensors files back, checked before use: a file damaged after its atomic write may still parse,
and must neither load silently (bad log-probs or ids corrupt training far from the cause) nor fail deep in a loader.
:class:`FileCheck` raises one :class:`DamagedFileError` naming the file, the problem and the fix."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from ..sampling.distribution import SamplingSettings
from ..util.validation import INT32_MAX, INT64_MAX, LOGPROB_SLACK, check_int


class DamagedFileError(ValueError):
    """A stored file that parses but does not hold what spec-rl wrote: ``"<path>: <problem>; <fix>"``."""

    def __init__(self, path, problem: str, fix: str) -> None:
        super().__init__(f"{path}: {problem}; {fix}")
        self.path, self.problem = path, problem


def open_stored(
    path: str | os.PathLike, what: str, fmt: dict[str, str], fix: str, vocab_size: int | None = None
) -> FileCheck:
    """The checks of the safetensors file ``path`` (read on the CPU), a ``what`` (e.g. "rollout cache") whose metadata
    holds ``fmt`` (its "format" and "format_version"). FileNotFoundError: no file; TypeError: a non-integer
    ``vocab_size``; ValueError: ``vocab_size`` < 1, an unreadable file or another format."""
    from safetensors import safe_open

    if vocab_size is not None:
        vocab_size = check_int("vocab_size", vocab_size, low=1)
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no {what} at {path}")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as exc:  # safetensors raises its own error types
        raise ValueError(f"{path} is not a readable safetensors file ({what}): {exc}") from exc
    if meta.get("format") != fmt["format"]:
        raise ValueError(f"{path} is not a spec-rl {what} (format={meta.get('format')!r})")
    version = fmt["format_version"]
    if meta.get("format_version") != version:
        raise ValueError(f"{path} has {what} format version {meta.get('format_version')!r}; expected {version}")
    return FileCheck(path, meta, tensors, fix, vocab_size)


class FileCheck:
    """Checks of one stored file (``path``, its ``meta`` and ``tensors``); each failure raises
    :class:`DamagedFileError` ``"<path>: <problem>; <fix>"``, ``fix`` saying what to do about it. Token ids must lie
    in [0, ``vocab_size``) when it is given, else in the int32 range."""

    def __init__(
        self, path, meta: dict[str, str], tensors: dict[str, torch.Tensor], fix: str, vocab_size: int | None = None
    ) -> None:
        self.path, self.meta, self.tensors, self.fix, self.vocab_size = path, meta, tensors, fix, vocab_size

    def fail(self, problem: str) -> DamagedFileError:
        return DamagedFileError(self.path, problem, self.fix)

    def field(self, key: str) -> str:
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

    def token_ids(self, name: str, t: torch.Tensor) -> None:
        if self.vocab_size is None:
            self.in_range(name, t, INT32_MAX + 1)
        else:
            self.in_range(name, t, self.vocab_size, f" (vocab_size={self.vocab_size})")

    def logprobs(self, name: str, t: torch.Tensor) -> None:
        bad = torch.isnan(t) | (t > LOGPROB_SLACK)
        if t.numel() and bool(bad.any()):
            raise self.fail(f"tensor {name!r} must hold log-probabilities (<= 0, not NaN), got {t[bad][0].item()}")

    def offsets(self, name: str, t: torch.Tensor, total: int) -> None:
        if int(t[0]) != 0 or int(t[-1]) != total or bool((t[1:] < t[:-1]).any()):
            raise self.fail(f"tensor {name!r} must rise from 0 to {total} (the stored tokens), got {t.tolist()[:8]}")

    def unique(self, name: str, keys: list) -> None:
        if len(set(keys)) != len(keys):
            raise self.fail(f"{name!r} holds the same key twice")
