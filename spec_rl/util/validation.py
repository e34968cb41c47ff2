"""Argument checks of the public API, one helper per kind of value: a wrong type is a TypeError, a wrong value a
ValueError, each naming the argument, what it takes and what it got. Nothing is coerced silently (no float ids, no bool
numbers)."""

from __future__ import annotations

import math
import numbers

import torch

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
_BOUND_TEXT = {INT32_MAX: "2**31 - 1", INT64_MAX: "2**63 - 1"}
#: Stored log-probs may exceed 0 by this much (float rounding of a log-softmax near 0).
LOGPROB_SLACK = 1e-4


def _got(value) -> str:
    """``type value`` for the error messages (``NoneType`` alone for None)."""
    return "NoneType" if value is None else f"{type(value).__name__} {value!r}"


def check_type(name: str, value, kinds, what: str | None = None, hint: str = ""):
    """``value`` itself, or a TypeError "<name> must be <what>, got <its type><hint>" when it is not an instance of
    ``kinds`` (a class or a tuple of them; ``what`` defaults to "a <class name>", joined by "or")."""
    if not isinstance(value, kinds):
        what = what or " or ".join(f"a {k.__name__}" for k in (kinds if isinstance(kinds, tuple) else (kinds,)))
        raise TypeError(f"{name} must be {what}, got {type(value).__name__}{hint}")
    return value


def check_int(name: str, value, *, low: int | None = None, high: int | None = None, hint: str = "") -> int:
    """``value`` as a Python int; TypeError unless it is an integer (not a bool, not a float), ValueError outside
    [low, high]. ``hint`` is appended to the message (e.g. " (0 disables top-k)")."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {_got(value)}{hint}")
    value = int(value)
    if low is not None and value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}{hint}")
    if high is not None and value > high:
        raise ValueError(f"{name} must be <= {high}, got {value}{hint}")
    return value


def check_real(
    name: str,
    value,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
    finite: bool = True,
    hint: str = "",
) -> float:
    """``value`` as a Python float; TypeError unless it is a real number (numpy scalars included, bool not), ValueError
    when NaN, infinite (unless ``finite`` is False) or outside the range ([low, high]; ``*_open`` excludes that end)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {_got(value)}{hint}")
    value = float(value)
    below = low is not None and (value <= low if low_open else value < low)
    above = high is not None and (value >= high if high_open else value > high)
    if math.isnan(value) or (finite and math.isinf(value)) or below or above:
        span = [f"{'>' if low_open else '>='} {low:g}"] if low is not None else []
        span += [f"{'<' if high_open else '<='} {high:g}"] if high is not None else []
        kind = "a finite number" if finite else "a number (inf allowed)"
        raise ValueError(f"{name} must be {kind}{' ' + ' and '.join(span) if span else ''}, got {value!r}{hint}")
    return value


def check_choice(name: str, value, choices: tuple, hint: str = ""):
    """``value`` when it is one of ``choices`` (compared as a plain value: arrays are refused), else ValueError."""
    if not isinstance(value, (str, int, float, type(None))) or value not in choices:
        raise ValueError(f"{name} must be one of {choices}{f' ({hint})' if hint else ''}, got {value!r}")
    return value


def _as_tensor(name: str, values, kind: str, high: int) -> torch.Tensor:
    """``values`` as a tensor without changing its dtype; TypeError/ValueError naming ``name`` otherwise."""
    if isinstance(values, torch.Tensor):
        return values
    expected = f"{name} must be a sequence of {kind}s or a 1-D {'integer' if kind == 'int' else kind} tensor"
    if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
        raise TypeError(f"{expected}, got {type(values).__name__}")
    if len(values) == 0:
        return torch.zeros(0, dtype=torch.int64 if kind == "int" else torch.float32)
    try:
        return torch.as_tensor(values)
    except (TypeError, ValueError, RuntimeError, OverflowError) as exc:
        big = [v for v in values if isinstance(v, numbers.Integral) and not -(2**63) <= int(v) <= INT64_MAX]
        if kind == "int" and big:
            raise ValueError(f"{name} must be token ids in [0, {_BOUND_TEXT.get(high, high)}], got {big[0]}") from exc
        odd = [v for v in values if not isinstance(v, numbers.Number)][:1]
        got = f"got {_got(odd[0])}" if odd else str(exc)
        raise TypeError(f"{expected}, {got}") from exc


def _check_1d(name: str, t: torch.Tensor) -> None:
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    if t.device.type == "meta":
        raise ValueError(f"{name} is on the meta device (it holds no data); pass a tensor with values")


def as_id_vector(name: str, values, *, high: int = INT32_MAX) -> torch.Tensor:
    """Token ids (list/tuple of ints, numpy integer array or integer tensor) as a 1-D int64 tensor on the same device.
    TypeError: not integers (floats, even 2.0, are never rounded); ValueError: not 1-D, or outside [0, high]."""
    t = _as_tensor(name, values, "int", high)
    if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
        # name the offending element of a list (``float 1.7``), else the dtype of the array or tensor
        listed = values if isinstance(values, (list, tuple)) else ()
        odd = [v for v in listed if isinstance(v, bool) or not isinstance(v, numbers.Integral)][:1]
        raise TypeError(f"{name} must hold integers, got {_got(odd[0]) if odd else t.dtype}; ids are never rounded")
    _check_1d(name, t)
    t = t.to(torch.int64)
    if t.numel():
        lo, hi = torch.stack([t.min(), t.max()]).tolist()
        if lo < 0 or hi > high:
            raise ValueError(
                f"{name} must be token ids in [0, {_BOUND_TEXT.get(high, high)}], got {lo if lo < 0 else hi}"
            )
    return t


def as_float_vector(name: str, values) -> torch.Tensor:
    """Real values as a 1-D float32 tensor (same device); TypeError for strings, bools or complex numbers."""
    t = _as_tensor(name, values, "float", INT64_MAX)
    if t.dtype == torch.bool or t.is_complex():
        raise TypeError(f"{name} must hold real numbers, got {t.dtype}")
    _check_1d(name, t)
    return t.to(torch.float32)


def logprob_problem(lps: torch.Tensor) -> str | None:
    """Why ``lps`` are not log-probabilities (NaN, or above 0 by more than float rounding), or None."""
    bad = torch.isnan(lps) | (lps > LOGPROB_SLACK)
    return f"must be log-probabilities (<= 0, not NaN), got {lps[bad][0].item()}" if bool(bad.any()) else None


def format_positions(positions: list[tuple[int, ...]], total: int, limit: int = 8) -> str:
    """``"(1, 2), (3, 0)"`` for the first ``limit`` positions, with ``", ..."`` when there are more."""
    text = ", ".join("(" + ", ".join(str(int(i)) for i in p) + ")" for p in positions[:limit])
    return text + (", ..." if total > limit else "")


def invalid_scores_message(source: str, positions: list[tuple[int, int]], total: int) -> str:
    """The error for scored positions without a valid distribution, worded as the Triton kernels do; ``source``
    names the scores, ``positions`` are the first (sample, token) pairs of ``total``."""
    return (
        f"{source} give no valid distribution at {total} scored position{'s' if total != 1 else ''} (sample, token): "
        f"{format_positions(positions, total)}: NaN, +inf, or every logit -inf. The policy forward produced invalid "
        "scores: check it for overflow (fp16/bf16, huge hidden states), or mask those positions out with lengths"
    )
