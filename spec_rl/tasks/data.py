"""Prompt/answer examples and loaders for GSM8K- and MATH-format data (``.jsonl`` files or ``datasets`` tables).

GSM8K (arXiv 2110.14168): ``question`` and ``answer``, a worked solution ending ``#### <number>``; the gold answer is
the text after the last ``####`` without thousands commas, as in the dataset's own evaluation. MATH / MATH-500
(arXiv 2103.03874, 2305.20050): ``problem`` and ``answer`` (LaTeX), else the last ``\\boxed{...}`` of ``solution``."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..util.validation import check_choice, check_type
from .rewards import extract_boxed

#: Record formats accepted by the loaders ("auto" detects one of the others).
FORMATS = ("auto", "gsm8k", "math")

#: The prompt template; the response follows ``Answer:`` directly, so demo responses start with a space.
PROMPT_TEMPLATE = "Question: {question}\nAnswer:"


@dataclass
class Example:
    """One prompt with its gold answer: ``prompt``, the text the policy sees (e.g. ``format_prompt(question)``);
    ``answer``, the gold final answer as text (e.g. ``"42"`` or ``"\\frac{1}{2}"``); ``uid``, a stable id such as
    ``"gsm8k_test:17"`` that keys the rollout cache, so it must not change between runs; ``source``, ``"gsm8k"``,
    ``"math"`` or ``"arith"``; ``solution``, the worked solution (the SFT target) or None, GSM8K-format ones ending
    with ``#### <answer>``; ``question``, the raw question text, or None."""

    prompt: str
    answer: str
    uid: str
    source: str
    solution: str | None = None
    question: str | None = None


def format_prompt(question: str) -> str:
    """The prompt text for ``question`` (:data:`PROMPT_TEMPLATE`, question stripped). Raises TypeError when ``question``
    is not a str, ValueError when it is empty or only whitespace."""
    check_type("question", question, str)
    q = question.strip()
    if not q:
        raise ValueError("question is empty; pass the problem text to format_prompt(question)")
    return PROMPT_TEMPLATE.format(question=q)


#: What an instruct model's user message says (its chat template wraps it): the question and the answer form the
#: rewards read, a ``#### <answer>`` line (GSM8K-style tasks) or ``\\boxed{}`` (MATH).
CHAT_USER_TEMPLATE = "{question}\n\nSolve it step by step, then give the final answer on its own last line as: {form}"
_ANSWER_FORMS = {"math": "\\boxed{<answer>}"}
CHAT_TEMPLATE_CHOICES = ("auto", "on", "off")


@dataclass(frozen=True)
class PromptFormat:
    """How an example becomes the prompt token ids the policy sees. ``chat_template``: "on" wraps the question in the
    tokenizer's chat template (:data:`CHAT_USER_TEMPLATE` as the user message, ``system_prompt`` first when given, the
    assistant turn opened); "off" tokenizes the example's plain prompt (:data:`PROMPT_TEMPLATE`); "auto" is "on" when
    the tokenizer has a chat template. Raises ValueError for another choice, or "on" with a tokenizer that has no chat
    template (from :meth:`encode`)."""

    chat_template: str = "auto"
    system_prompt: str | None = None

    def __post_init__(self) -> None:
        check_choice("chat_template", self.chat_template, CHAT_TEMPLATE_CHOICES)
        check_type("system_prompt", self.system_prompt, (str, type(None)), "a str or None")

    def uses_chat(self, tokenizer) -> bool:
        has = bool(getattr(tokenizer, "chat_template", None))
        if self.chat_template == "on" and not has:
            raise ValueError("chat_template is 'on' but the tokenizer has no chat template; use 'auto' or 'off'")
        return has if self.chat_template == "auto" else self.chat_template == "on"

    def encode(self, tokenizer, examples) -> list[list[int]]:
        """The prompt token ids of each example (a chat template adds its own special tokens)."""
        if not self.uses_chat(tokenizer):
            return [tokenizer(e.prompt)["input_ids"] for e in examples]
        out = []
        for e in examples:
            question = e.question if e.question is not None else e.prompt
            user = CHAT_USER_TEMPLATE.format(question=question, form=_ANSWER_FORMS.get(e.source, "#### <answer>"))
            system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
            messages = [*system, {"role": "user", "content": user}]
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
        return out

    def to_dict(self) -> dict:
        return {"chat_template": self.chat_template, "system_prompt": self.system_prompt}


_COMMA_IN_NUMBER = re.compile(r"(?<=\d),(?=\d)")


def _text_field(record: Mapping[str, Any], name: str, fmt: str, where: str) -> str:
    """``record[name]`` as a non-empty string, or a ValueError naming the location and the field."""
    if name not in record:
        raise ValueError(
            f"{where}: {fmt} record lacks the field {name!r} (has {sorted(record)}); fix the data or pass the right "
            "fmt (--data-format)"
        )
    value = record[name]
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{where}: field {name!r} must be a non-empty string, got {value!r}")
    return value


def _gsm8k_fields(record: Mapping[str, Any], where: str) -> tuple[str, str, str | None, str]:
    """(question, gold answer, solution, uid key field) of a GSM8K record (gold as the module docstring says)."""
    question = _text_field(record, "question", "gsm8k", where)
    solution = _text_field(record, "answer", "gsm8k", where)
    gold = _COMMA_IN_NUMBER.sub("", solution.rsplit("####", 1)[1].strip()) if "####" in solution else ""
    if not gold:
        raise ValueError(f"{where}: GSM8K 'answer' must end with a line '#### <answer>', got {solution[-80:]!r}")
    return question, gold, solution, "idx"


def _math_fields(record: Mapping[str, Any], where: str) -> tuple[str, str, str | None, str]:
    """(question, gold answer, solution or None, uid key field) of a MATH record. The gold answer is the ``answer``
    field (numbers accepted, whitespace stripped), else the solution's last ``\\boxed{...}``."""
    question = _text_field(record, "problem", "math", where)
    solution = record.get("solution")
    if solution is not None and not isinstance(solution, str):
        raise ValueError(f"{where}: field 'solution' must be a string, got {type(solution).__name__}")
    answer = record.get("answer")
    if answer is None:
        answer = extract_boxed(solution or "")
        if not answer:
            raise ValueError(f"{where}: MATH record has no 'answer' and its 'solution' has no \\boxed{{...}} answer")
    elif isinstance(answer, (int, float)) and not isinstance(answer, bool):
        answer = str(answer)
    if not isinstance(answer, str) or not answer.strip():
        raise ValueError(f"{where}: field 'answer' must be a non-empty string, got {answer!r}")
    return question, answer.strip(), solution or None, "unique_id"


def _check_fmt_limit(fmt: str, limit: int | None) -> None:
    check_choice("fmt", fmt, FORMATS)
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
    """Convert GSM8K- or MATH-format records (dicts, e.g. JSON lines or ``datasets`` rows) to examples, in order.
    ``fmt``: ``"gsm8k"``, ``"math"`` or ``"auto"`` (from the first record's fields); ``limit``: at most this many (None:
    all). uid = ``f"{uid_prefix}:{key}"``, key the ``idx`` (GSM8K) / ``unique_id`` (MATH) field, else the record's
    0-based index. ``where`` names records in errors (``"<where> #<n>"``, 1-based). Raises ValueError for an unknown
    ``fmt``, a bad ``limit``, an undetectable format, a missing field, or no records."""
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
    """(location, record) pairs -> examples, detecting the format from the first record."""
    _check_fmt_limit(fmt, limit)
    out: list[Example] = []
    detected = None if fmt == "auto" else fmt
    for index, (loc, rec) in enumerate(located):
        if not isinstance(rec, Mapping):
            raise ValueError(f"{loc}: expected a JSON object (dict), got {type(rec).__name__}")
        if detected is None:
            if "question" in rec and "answer" in rec:
                detected = "gsm8k"
            elif "problem" in rec and ("answer" in rec or "solution" in rec):
                detected = "math"
            else:
                raise ValueError(
                    f"{loc}: cannot detect the format from fields {sorted(rec)}; expected GSM8K "
                    f"(question, answer) or MATH (problem, answer[, solution]); pass fmt='gsm8k' or fmt='math' "
                    "(--data-format)"
                )
        question, answer, solution, key_field = (_gsm8k_fields if detected == "gsm8k" else _math_fields)(rec, loc)
        uid = f"{uid_prefix}:{rec.get(key_field, index)}"
        out.append(Example(prompt_fn(question), answer, uid, detected, solution, question))
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
    """Load GSM8K- or MATH-format examples from a ``.jsonl`` file (blank lines skipped), in file order. ``uid_prefix``
    defaults to the file name without extension (uids ``"gsm8k_test:17"``); the other arguments and errors are those of
    :func:`records_to_examples`, plus ValueError for a line that is not JSON."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"path {str(p)!r} does not exist or is not a file; pass a GSM8K- or MATH-format .jsonl")
    prefix = uid_prefix if uid_prefix is not None else p.stem

    def located() -> Iterable[tuple[str, Any]]:
        with p.open("rb") as f:
            for lineno, raw in enumerate(f, start=1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise ValueError(
                        f"{p}: line {lineno} is not UTF-8 text (byte {raw[e.start]:#04x} at column {e.start + 1}); "
                        "write the file as UTF-8 JSON lines"
                    ) from None
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(
                        f"{p}: line {lineno} is not valid JSON ({e.msg} at column {e.colno}); "
                        "write one JSON object a line"
                    ) from None
                yield f"{p}: line {lineno}", rec

    empty_msg = f"{p} is empty (no JSON records); pass a non-empty GSM8K- or MATH-format .jsonl"
    return _convert(located(), fmt, limit, prefix, prompt_fn, empty_msg=empty_msg)


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
    """Load GSM8K- or MATH-format examples with ``datasets``: ``load_hf_dataset("openai/gsm8k", "test", name="main")``.
    ``path``: a name for ``datasets.load_dataset(path, split=split, **kwargs)``, or a loaded ``datasets.Dataset``.
    ``uid_prefix`` defaults to ``f"{path}:{split}"`` (``"dataset"`` for a Dataset); the rest and the errors as in
    :func:`records_to_examples`, plus ImportError without ``datasets`` and ValueError for a DatasetDict (pass
    ``split``)."""
    _check_fmt_limit(fmt, limit)
    try:
        import datasets
    except ImportError as e:
        raise ImportError(
            "load_hf_dataset needs the 'datasets' library: pip install spec-rl[datasets] "
            "(or pip install datasets); or use load_jsonl on a local .jsonl file"
        ) from e

    named = isinstance(path, str)
    ds = datasets.load_dataset(path, split=split, **kwargs) if named else path
    prefix = uid_prefix if uid_prefix is not None else (f"{path}:{split}" if named else "dataset")
    if isinstance(ds, (datasets.DatasetDict, datasets.IterableDatasetDict)):
        raise ValueError(f"path resolved to a DatasetDict with splits {list(ds)}; pass split=<one of them>")
    return records_to_examples(
        iter(ds), fmt=fmt, limit=limit, uid_prefix=prefix, prompt_fn=prompt_fn, where=f"dataset {prefix}"
    )
