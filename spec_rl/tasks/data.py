"""Prompt/answer examples and loaders for GSM8K- and MATH-format data.

Two record formats are understood (one JSON object per line in ``.jsonl``
files, or one row per record in a ``datasets`` table):

* **GSM8K** (Cobbe et al. 2021, "Training Verifiers to Solve Math Word
  Problems", arXiv 2110.14168; github.com/openai/grade-school-math): fields
  ``question`` and ``answer``, where ``answer`` is a worked solution whose last
  line is ``#### <number>``. The gold answer is the text after the last
  ``####`` with thousands separators (commas) removed, as in the dataset's own
  evaluation script. An optional integer ``idx`` field is used in the uid.
* **MATH / MATH-500** (Hendrycks et al. 2021, arXiv 2103.03874; MATH-500 subset
  of Lightman et al. 2023, arXiv 2305.20050): fields ``problem`` and
  ``answer`` (a LaTeX expression), optionally ``solution`` (worked solution,
  final answer in ``\\boxed{...}``) and ``unique_id``. A record without
  ``answer`` but with a ``solution`` takes the content of the solution's last
  ``\\boxed{...}`` as its gold answer.

Every loaded record becomes an :class:`Example`, whose ``prompt`` is the text
the policy sees (:func:`format_prompt` by default) and whose ``uid`` is a
stable string id used as the dataset id that keys the rollout cache.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .rewards import extract_boxed

__all__ = [
    "Example",
    "FORMATS",
    "PROMPT_TEMPLATE",
    "format_prompt",
    "load_jsonl",
    "load_hf_dataset",
    "records_to_examples",
]

#: Record formats accepted by the loaders ("auto" detects one of the others).
FORMATS = ("auto", "gsm8k", "math")

#: The single prompt template. The response the policy writes follows
#: ``Answer:`` directly, so demo responses start with a space.
PROMPT_TEMPLATE = "Question: {question}\nAnswer:"


@dataclass
class Example:
    """One prompt with its gold answer.

    Attributes:
        prompt: formatted text the policy sees (e.g. ``format_prompt(question)``).
        answer: gold final answer as text, e.g. ``"42"`` or a LaTeX expression
            such as ``"\\frac{1}{2}"``; compared by :func:`spec_rl.tasks.rewards.math_reward`.
        uid: stable id such as ``"gsm8k_test:17"`` or ``"arith:0:17"``; used as
            the dataset id that keys the rollout cache, so it must not change
            between runs for the same record.
        source: where the record came from: ``"gsm8k"``, ``"math"``, ``"arith"``.
        solution: worked solution text (used as the SFT target), or None. For
            GSM8K-format data it ends with a line ``#### <answer>``.
        question: the raw question text before formatting, or None.
    """

    prompt: str
    answer: str
    uid: str
    source: str
    solution: str | None = None
    question: str | None = None


def format_prompt(question: str) -> str:
    """Format a question as the prompt text the policy sees.

    Template: ``"Question: {question}\\nAnswer:"`` (:data:`PROMPT_TEMPLATE`);
    the question is stripped of surrounding whitespace. The response is
    expected to start right after ``Answer:`` (the demo policy's responses
    start with a space).

    Raises:
        TypeError: ``question`` is not a str.
        ValueError: ``question`` is empty or only whitespace.
    """
    if not isinstance(question, str):
        raise TypeError(f"question must be a str, got {type(question).__name__}")
    q = question.strip()
    if not q:
        raise ValueError("question is empty; pass the problem text to format_prompt(question)")
    return PROMPT_TEMPLATE.format(question=q)


# ---------------------------------------------------------------------------
# Record parsing
# ---------------------------------------------------------------------------

_COMMA_IN_NUMBER = re.compile(r"(?<=\d),(?=\d)")


def _gsm8k_gold(answer_field: str) -> str | None:
    """Gold answer of a GSM8K ``answer`` field: text after the last ``####``, commas removed."""
    if "####" not in answer_field:
        return None
    gold = _COMMA_IN_NUMBER.sub("", answer_field.rsplit("####", 1)[1].strip())
    return gold or None


def _detect_format(record: Mapping[str, Any]) -> str | None:
    if "question" in record and "answer" in record:
        return "gsm8k"
    if "problem" in record and ("answer" in record or "solution" in record):
        return "math"
    return None


def _text_field(record: Mapping[str, Any], name: str, fmt: str, where: str) -> str:
    """``record[name]`` as a non-empty string, or a ValueError naming the location and the field."""
    if name not in record:
        raise ValueError(
            f"{where}: {fmt} record lacks the field {name!r} (has {sorted(record)}); fix the data or pass the right fmt"
        )
    value = record[name]
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{where}: field {name!r} must be a non-empty string, got {value!r}")
    return value


def _gsm8k_fields(record: Mapping[str, Any], where: str) -> tuple[str, str, str | None, str]:
    """(question, gold answer, solution, uid key field) of a GSM8K record."""
    question = _text_field(record, "question", "gsm8k", where)
    solution = _text_field(record, "answer", "gsm8k", where)
    gold = _gsm8k_gold(solution)
    if gold is None:
        raise ValueError(f"{where}: GSM8K 'answer' must end with a line '#### <answer>', got {solution[-80:]!r}")
    return question, gold, solution, "idx"


def _math_answer(record: Mapping[str, Any], solution: str | None, where: str) -> str:
    """The ``answer`` field (numbers accepted, whitespace stripped), else the solution's last ``\\boxed{...}``."""
    if "answer" in record and record["answer"] is not None:
        answer = record["answer"]
        if isinstance(answer, (int, float)) and not isinstance(answer, bool):
            answer = str(answer)
        if not isinstance(answer, str) or not answer.strip():
            raise ValueError(f"{where}: field 'answer' must be a non-empty string, got {answer!r}")
        return answer.strip()
    answer = extract_boxed(solution or "")
    if not answer:
        raise ValueError(f"{where}: MATH record has no 'answer' and its 'solution' has no \\boxed{{...}} answer")
    return answer


def _math_fields(record: Mapping[str, Any], where: str) -> tuple[str, str, str | None, str]:
    """(question, gold answer, solution or None, uid key field) of a MATH record."""
    question = _text_field(record, "problem", "math", where)
    solution = record.get("solution")
    if solution is not None and not isinstance(solution, str):
        raise ValueError(f"{where}: field 'solution' must be a string, got {type(solution).__name__}")
    return question, _math_answer(record, solution, where), solution or None, "unique_id"


_FIELD_READERS = {"gsm8k": _gsm8k_fields, "math": _math_fields}


def _record_to_example(
    record: Mapping[str, Any], fmt: str, index: int, uid_prefix: str, prompt_fn: Callable[[str], str], where: str
) -> Example:
    """Convert one record; ``where`` names the location (file and line) for errors."""
    if not isinstance(record, Mapping):
        raise ValueError(f"{where}: expected a JSON object (dict), got {type(record).__name__}")
    if fmt not in _FIELD_READERS:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    question, answer, solution, key_field = _FIELD_READERS[fmt](record, where)
    return Example(
        prompt=prompt_fn(question),
        answer=answer,
        uid=f"{uid_prefix}:{record.get(key_field, index)}",
        source=fmt,
        solution=solution,
        question=question,
    )


def _check_fmt_limit(fmt: str, limit: int | None) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be a positive int or None (no limit), got {limit!r}")


def records_to_examples(
    records: Iterable[Mapping[str, Any]],
    fmt: str = "auto",
    limit: int | None = None,
    uid_prefix: str = "data",
    prompt_fn: Callable[[str], str] = format_prompt,
    where: str = "record",
) -> list[Example]:
    """Convert an iterable of GSM8K- or MATH-format records to examples.

    Args:
        records: dict-like records (e.g. parsed JSON lines or ``datasets`` rows).
        fmt: ``"gsm8k"``, ``"math"`` or ``"auto"`` (detected from the first
            record's fields: question+answer -> gsm8k, problem+answer/solution -> math).
        limit: keep at most this many examples (None: all).
        uid_prefix: uid = ``f"{uid_prefix}:{key}"`` where key is the record's
            ``idx`` (GSM8K) / ``unique_id`` (MATH) field, else its 0-based index.
        prompt_fn: question text -> prompt text.
        where: name used in error messages (``"<where> #<n>"``, 1-based).

    Returns:
        list of :class:`Example` in input order.

    Raises:
        ValueError: unknown ``fmt``, bad ``limit``, undetectable format,
            records missing fields, or no records at all.
    """
    _check_fmt_limit(fmt, limit)
    located = ((f"{where} #{i + 1}", rec) for i, rec in enumerate(records))
    return _convert(located, fmt, limit, uid_prefix, prompt_fn, empty_msg=f"no records found in {where}")


def _convert(
    located: Iterable[tuple[str, Any]],
    fmt: str,
    limit: int | None,
    uid_prefix: str,
    prompt_fn: Callable[[str], str],
    empty_msg: str,
) -> list[Example]:
    """Shared loop: (location, record) pairs -> examples, detecting the format from the first record."""
    out: list[Example] = []
    detected = None if fmt == "auto" else fmt
    for index, (loc, rec) in enumerate(located):
        if not isinstance(rec, Mapping):
            raise ValueError(f"{loc}: expected a JSON object (dict), got {type(rec).__name__}")
        if detected is None:
            detected = _detect_format(rec)
            if detected is None:
                raise ValueError(
                    f"{loc}: cannot detect the format from fields {sorted(rec)}; expected GSM8K "
                    f"(question, answer) or MATH (problem, answer[, solution]); pass fmt='gsm8k' or fmt='math'"
                )
        out.append(_record_to_example(rec, detected, index, uid_prefix, prompt_fn, loc))
        if limit is not None and len(out) >= limit:
            break
    if not out:
        raise ValueError(empty_msg)
    return out


def load_jsonl(
    path: str | Path,
    fmt: str = "auto",
    limit: int | None = None,
    *,
    uid_prefix: str | None = None,
    prompt_fn: Callable[[str], str] = format_prompt,
) -> list[Example]:
    """Load GSM8K- or MATH-format examples from a JSON-lines file.

    Blank lines are skipped. Example: ``load_jsonl("gsm8k_test.jsonl")[0].answer == "18"``.

    Args:
        path: the ``.jsonl`` file (one JSON object per line).
        fmt: ``"gsm8k"``, ``"math"`` or ``"auto"`` (detected from the first record).
        limit: keep at most this many examples (None: all).
        uid_prefix: prefix of every uid (default: the file name without
            extension, e.g. ``"gsm8k_test"`` -> uid ``"gsm8k_test:17"``).
        prompt_fn: question text -> prompt text (default :func:`format_prompt`).

    Returns:
        list of :class:`Example` in file order.

    Raises:
        FileNotFoundError: ``path`` does not exist or is not a file.
        ValueError: unknown ``fmt``, bad ``limit``, empty file, a line that is
            not valid JSON or not an object, undetectable format, or a record
            missing required fields (the message gives the 1-based line number).
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"path {str(p)!r} does not exist or is not a file; pass a GSM8K- or MATH-format .jsonl")
    _check_fmt_limit(fmt, limit)
    prefix = uid_prefix if uid_prefix is not None else p.stem

    def located() -> Iterable[tuple[str, Any]]:
        with p.open("r", encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{p}: line {lineno} is not valid JSON ({e.msg} at column {e.colno})") from None
                yield f"{p}: line {lineno}", rec

    return _convert(
        located(),
        fmt,
        limit,
        prefix,
        prompt_fn,
        empty_msg=f"{p} is empty (no JSON records); pass a non-empty GSM8K- or MATH-format .jsonl",
    )


def load_hf_dataset(
    path: Any,
    split: str = "train",
    fmt: str = "auto",
    limit: int | None = None,
    *,
    uid_prefix: str | None = None,
    prompt_fn: Callable[[str], str] = format_prompt,
    **kwargs: Any,
) -> list[Example]:
    """Load GSM8K- or MATH-format examples with the ``datasets`` library.

    Example: ``load_hf_dataset("openai/gsm8k", split="test", name="main")``.

    Args:
        path: a dataset name/path for ``datasets.load_dataset`` (called as
            ``load_dataset(path, split=split, **kwargs)``), or an already
            loaded ``datasets.Dataset`` (then ``split`` and ``kwargs`` are unused).
        split: split to load, e.g. ``"train"`` or ``"test"``.
        fmt: ``"gsm8k"``, ``"math"`` or ``"auto"``.
        limit: keep at most this many examples (None: all).
        uid_prefix: prefix of every uid (default ``f"{path}:{split}"``, or
            ``"dataset"`` for an in-memory Dataset).
        prompt_fn: question text -> prompt text.
        **kwargs: passed to ``datasets.load_dataset`` (e.g. ``name="main"``).

    Returns:
        list of :class:`Example` in dataset order.

    Raises:
        ImportError: ``datasets`` is not installed (``pip install spec-rl[datasets]``).
        ValueError: as :func:`records_to_examples`, or ``path`` resolves to a
            DatasetDict (pass ``split``).
    """
    _check_fmt_limit(fmt, limit)
    try:
        import datasets  # noqa: F401
    except ImportError as e:
        raise ImportError(
            "load_hf_dataset needs the 'datasets' library: pip install spec-rl[datasets] "
            "(or pip install datasets); or use load_jsonl on a local .jsonl file"
        ) from e

    if isinstance(path, str):
        ds = datasets.load_dataset(path, split=split, **kwargs)
        prefix = uid_prefix if uid_prefix is not None else f"{path}:{split}"
    else:
        ds = path
        prefix = uid_prefix if uid_prefix is not None else "dataset"
    if isinstance(ds, (datasets.DatasetDict, datasets.IterableDatasetDict)):
        raise ValueError(f"path resolved to a DatasetDict with splits {list(ds)}; pass split=<one of them>")
    return records_to_examples(
        iter(ds), fmt=fmt, limit=limit, uid_prefix=prefix, prompt_fn=prompt_fn, where=f"dataset {prefix}"
    )
