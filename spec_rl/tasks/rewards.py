"""Verifiable rewards: final-answer checking for GSM8K- and MATH-style tasks (the paper's rule-based reward).

A reward ``fn(completion, gold) -> float`` in [0, 1] gets the response text only and ``Example.answer``.
:func:`math_reward` decides equivalence with HuggingFace's math-verify; without it, a comparison that needs it raises
:class:`MathVerifyUnavailable` instead of scoring 0 (a silent 0 would train on wrong rewards)."""

from __future__ import annotations

import functools
import logging
import re
import threading
from collections.abc import Callable
from fractions import Fraction

from ..util.validation import check_type

RewardFn = Callable[[str, str], float]

#: Longer extracted answers (characters) score 0 without math-verify: bounds sympy work on junk.
MAX_ANSWER_CHARS = 1000

# Seconds per math-verify parse or comparison; its timeouts use signal.alarm, so the main thread only.
_MV_TIMEOUT_S = 5

_BOX_OPENER = re.compile(r"\\(?:boxed|fbox)\{")
_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)")
_COMMA_IN_NUMBER = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
# "18 apples", "5 dollars": a number followed by plain words (units), predictions only.
_LEADING_NUMBER_WITH_UNITS = re.compile(r"([-+]?(?:\d+(?:\.\d*)?|\.\d+))\s+[A-Za-z]{2,}[A-Za-z\s]*")


def extract_boxed(text: str) -> str | None:
    """Stripped content of the last complete ``\\boxed{...}`` or ``\\fbox{...}`` (nested braces kept), or None. An
    unclosed box (a truncated generation) is skipped in favour of the previous complete one."""
    if not isinstance(text, str):
        return None
    for opener in reversed(list(_BOX_OPENER.finditer(text))):
        open_idx = opener.end() - 1
        depth = 0
        for j, c in enumerate(text[open_idx:], start=open_idx):
            if c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
                if depth == 0:
                    return text[open_idx + 1 : j].strip()
    return None


def extract_final_answer(text: str) -> str | None:
    """The stripped final answer of a response: the rest of the line after the last ``####`` (GSM8K) if non-empty,
    else the last complete ``\\boxed{...}`` (MATH), else None."""
    if not isinstance(text, str):
        return None
    answer = text.rpartition("####")[2].split("\n", 1)[0].strip() if "####" in text else ""
    return answer or extract_boxed(text)


def _plain_number(s: str, allow_units: bool = False) -> Fraction | None:
    """Exact value of a plain decimal answer (``"1,234"``, ``"$18."``; ``allow_units``: ``"18 apples"``), else None."""
    t = _COMMA_IN_NUMBER.sub("", s.strip().replace("\\$", "").replace("$", "").replace("\\!", "").strip())
    t = t.removesuffix(".").rstrip()
    m = _LEADING_NUMBER_WITH_UNITS.fullmatch(t) if allow_units else None
    if m:
        t = m.group(1)
    if not _NUMBER.fullmatch(t):
        return None
    try:
        return Fraction(t)
    except (ValueError, ZeroDivisionError):
        return None


class MathVerifyUnavailable(ImportError):
    """math-verify is needed for this comparison (not two plain numbers) but cannot be imported."""


def _require_math_verify() -> None:
    try:
        import math_verify  # noqa: F401
    except ImportError as exc:
        raise MathVerifyUnavailable(
            f"math_reward needs math-verify to compare non-numeric answers, and it cannot be imported ({exc}); "
            "install it: pip install 'math-verify>=0.7' (offline: the wheels from `make gpu-wheels`)"
        ) from exc


@functools.lru_cache(maxsize=2)
def _math_verify(timeout: int | None):
    """math-verify's (parse, verify), given ``timeout`` seconds where this version takes a timeout keyword."""
    import inspect

    from math_verify import parse, verify

    def timed(fn, key: str):
        return functools.partial(fn, **{key: timeout}) if key in inspect.signature(fn).parameters else fn

    return timed(parse, "parsing_timeout"), timed(verify, "timeout_seconds")


@functools.lru_cache(maxsize=8192)
def _parsed_gold(gold: str, timeout: int | None):
    return _math_verify(timeout)[0]("\\boxed{" + gold + "}")


@functools.cache  # install once
def _install_log_filter() -> None:
    """Drop math-verify's warning that its timeout is disabled: we disable it on purpose off the main thread."""
    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).addFilter(lambda record: "Timeout is disabled" not in record.getMessage())


def math_reward(completion: str, gold: str) -> float:
    """1.0 if the completion's final answer (:func:`extract_final_answer`) equals ``gold``, else 0.0. Two plain decimal
    numbers (after ``$``, thousands commas, a trailing period and, in the prediction, trailing unit words) are compared
    exactly as rationals, anything else by ``math_verify.verify(parse(gold), parse(answer))``. Junk, no answer, an
    answer over :data:`MAX_ANSWER_CHARS` characters or an error inside math-verify give 0.0. Thread-safe: math-verify's
    signal-based timeouts are used in the main thread only. Raises TypeError when ``gold`` is not a str, ValueError when
    it is empty, MathVerifyUnavailable when math-verify is needed but missing."""
    check_type("gold", gold, str, "a str (Example.answer)")
    if not gold.strip():
        raise ValueError("gold is empty; pass the gold final answer (Example.answer)")
    pred = extract_final_answer(completion)  # None for a non-str completion
    if not pred or len(pred) > MAX_ANSWER_CHARS:
        return 0.0

    gold_num = _plain_number(gold)
    pred_num = _plain_number(pred, allow_units=True)
    if gold_num is not None and pred_num is not None:
        return 1.0 if gold_num == pred_num else 0.0

    _require_math_verify()  # outside the try: a missing library is not "not verified"
    try:
        timeout = _MV_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
        if timeout is None:
            _install_log_filter()
        parse, verify = _math_verify(timeout)
        gold_parsed = _parsed_gold(gold.strip(), timeout)
        pred_parsed = parse("\\boxed{" + pred + "}") if gold_parsed else None
        return 1.0 if pred_parsed and verify(gold_parsed, pred_parsed) else 0.0
    except Exception:  # noqa: BLE001 - any failure inside math-verify/sympy means "not verified"
        return 0.0


def format_reward(completion: str, gold: str) -> float:
    """1.0 when the response gives a final answer in the requested form (a ``#### <answer>`` line or a ``\\boxed{}``),
    right or wrong, else 0.0: a signal a small model can earn while correctness is still out of reach."""
    return 1.0 if extract_final_answer(completion) is not None else 0.0


def math_format_reward(completion: str, gold: str) -> float:
    """Partial credit: half for the answer form (:func:`format_reward`), half for the right answer
    (:func:`math_reward`)."""
    return 0.5 * format_reward(completion, gold) + 0.5 * math_reward(completion, gold)


#: Reward functions by name, each ``fn(completion: str, gold: str) -> float``.
REWARD_FUNCTIONS: dict[str, RewardFn] = {
    "math": math_reward,
    "format": format_reward,
    "math+format": math_format_reward,
}


def get_reward_fn(name_or_callable: str | RewardFn) -> RewardFn:
    """The reward function registered as ``name_or_callable`` (:data:`REWARD_FUNCTIONS`), or the callable itself. Raises
    ValueError for an unknown name (listing the known ones), TypeError for neither a str nor a callable."""
    if callable(name_or_callable):
        return name_or_callable
    if isinstance(name_or_callable, str):
        if name_or_callable in REWARD_FUNCTIONS:
            return REWARD_FUNCTIONS[name_or_callable]
        raise ValueError(
            f"unknown reward {name_or_callable!r}; known rewards: {sorted(REWARD_FUNCTIONS)} "
            f"(or pass a callable fn(completion, gold) -> float)"
        )
    raise TypeError(
        f"reward must be a name in {sorted(REWARD_FUNCTIONS)} or a callable, got {type(name_or_callable).__name__}"
    )
