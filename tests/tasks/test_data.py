"""Loaders for GSM8K- and MATH-format data (spec_rl.tasks.data) on the shared real files."""

from __future__ import annotations

import json

import pytest
from repo_paths import SHARED_DATA

from spec_rl.tasks.data import Example, format_prompt, load_hf_dataset, load_jsonl, records_to_examples

DATA = SHARED_DATA
GSM8K = DATA / "gsm8k_test.jsonl"
MATH500 = DATA / "math500_test.jsonl"

needs_gsm8k = pytest.mark.skipif(not GSM8K.is_file(), reason=f"{GSM8K} not present")
needs_math = pytest.mark.skipif(not MATH500.is_file(), reason=f"{MATH500} not present")


def test_format_prompt():
    assert format_prompt("  What is 2+2? ") == "Question: What is 2+2?\nAnswer:"
    with pytest.raises(ValueError, match="question"):
        format_prompt("   ")
    with pytest.raises(TypeError, match="question"):
        format_prompt(3)


@needs_gsm8k
def test_gsm8k_file():
    exs = load_jsonl(GSM8K)
    assert len(exs) == 1319
    first = exs[0]
    assert isinstance(first, Example)
    assert first.answer == "18"
    assert first.source == "gsm8k"
    assert first.uid == "gsm8k_test:0"
    assert first.prompt.startswith("Question: Janet")
    assert first.prompt.endswith("\nAnswer:")
    assert first.solution.rstrip().endswith("#### 18")
    assert first.question.startswith("Janet")
    # thousands separators are removed from gold answers
    assert exs[146].answer == "2125"
    assert exs[201].answer == "114200"
    assert len({e.uid for e in exs}) == len(exs)


@needs_gsm8k
def test_gsm8k_limit_and_explicit_format():
    exs = load_jsonl(GSM8K, fmt="gsm8k", limit=5, uid_prefix="gsm8k")
    assert len(exs) == 5
    assert exs[3].uid == "gsm8k:3"


@needs_math
def test_math_file():
    exs = load_jsonl(str(MATH500))
    assert len(exs) == 500
    assert exs[0].answer == "\\left( 3, \\frac{\\pi}{2} \\right)"
    assert exs[2].answer == "\\frac{14}{3}"
    assert exs[0].uid == "math500_test:test/precalculus/807.json"
    assert exs[0].source == "math"
    assert "\\boxed" in exs[0].solution
    assert exs[0].prompt.startswith("Question: Convert the point $(0,3)$")


@needs_gsm8k
@needs_math
def test_wrong_explicit_format(tmp_path):
    with pytest.raises(ValueError, match=r"line 1: .*'problem'"):
        load_jsonl(GSM8K, fmt="math")
    with pytest.raises(ValueError, match=r"line 1: .*'question'"):
        load_jsonl(MATH500, fmt="gsm8k")


def test_math_answer_from_solution(tmp_path):
    p = tmp_path / "m.jsonl"
    p.write_text(json.dumps({"problem": "1/2+0?", "solution": "It is $\\boxed{\\frac{1}{2}}$."}) + "\n")
    (ex,) = load_jsonl(p)
    assert ex.answer == "\\frac{1}{2}"
    assert ex.uid == "m:0"


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_jsonl(tmp_path / "nope.jsonl")


def test_empty_file(tmp_path):
    p = tmp_path / "empty.jsonl"
    p.write_text("\n  \n")
    with pytest.raises(ValueError, match="empty"):
        load_jsonl(p)


def test_bad_fmt_and_limit(tmp_path):
    p = tmp_path / "a.jsonl"
    p.write_text(json.dumps({"question": "q", "answer": "#### 1"}) + "\n")
    with pytest.raises(ValueError, match="fmt must be one of"):
        load_jsonl(p, fmt="csv")
    with pytest.raises(ValueError, match="limit"):
        load_jsonl(p, limit=0)


def test_malformed_line_number(tmp_path):
    p = tmp_path / "bad.jsonl"
    good = json.dumps({"question": "q", "answer": "x\n#### 3"})
    p.write_text(good + "\n\n" + good + "\n{not json\n")
    with pytest.raises(ValueError, match="line 4 is not valid JSON"):
        load_jsonl(p)
    p.write_text(good + "\n[1, 2]\n")
    with pytest.raises(ValueError, match="line 2.*JSON object"):
        load_jsonl(p)
    p.write_bytes(good.encode() + b"\n\xff\xfe{}\n")  # UTF-16 bytes, say
    with pytest.raises(ValueError, match=r"bad.jsonl: line 2 is not UTF-8 text \(byte 0xff at column 1\)"):
        load_jsonl(p)


def test_gsm8k_without_hashes(tmp_path):
    p = tmp_path / "g.jsonl"
    p.write_text(
        json.dumps({"question": "q", "answer": "3"}) + "\n" + json.dumps({"question": "q", "answer": "5"}) + "\n"
    )
    with pytest.raises(ValueError, match="line 1.*####"):
        load_jsonl(p)


def test_undetectable_format(tmp_path):
    p = tmp_path / "u.jsonl"
    p.write_text(json.dumps({"prompt": "q", "label": 3}) + "\n")
    with pytest.raises(ValueError, match="cannot detect the format.*fmt="):
        load_jsonl(p)


def test_records_to_examples_in_memory():
    recs = [{"problem": "p", "answer": 7}, {"problem": "p2", "answer": "x^2"}]
    exs = records_to_examples(recs, uid_prefix="mem")
    assert [e.answer for e in exs] == ["7", "x^2"]
    assert [e.uid for e in exs] == ["mem:0", "mem:1"]
    with pytest.raises(ValueError, match="no records"):
        records_to_examples([])


def test_hf_dataset_in_memory():
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_list(
        [{"question": "How many?", "answer": "2 + 2 = 4\n#### 4"}, {"question": "And now?", "answer": "#### 1,000"}]
    )
    exs = load_hf_dataset(ds)
    assert [e.answer for e in exs] == ["4", "1000"]
    assert exs[0].source == "gsm8k"
    assert exs[1].uid == "dataset:1"


def test_hf_dataset_missing_library_message(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name == "datasets" or name.startswith("datasets."):
            raise ImportError("No module named 'datasets'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    with pytest.raises(ImportError, match=r"pip install spec-rl\[datasets\]"):
        load_hf_dataset("openai/gsm8k", split="test", name="main")


def test_prompt_format_applies_the_chat_template_when_there_is_one():
    from tiny_models import tiny_tokenizer

    from spec_rl.tasks.data import CHAT_USER_TEMPLATE, PromptFormat

    plain = tiny_tokenizer()
    chat = tiny_tokenizer()
    chat.chat_template = (
        "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} <eos> {% endfor %}"
        "{% if add_generation_prompt %}Answer:{% endif %}"
    )
    ex = [
        Example(prompt="Question: Tom has 2\nAnswer:", answer="2", uid="a", source="gsm8k", question="Tom has 2"),
        Example(prompt="Question: x\nAnswer:", answer="1", uid="b", source="math", question="x"),
    ]
    # auto: the plain prompt without a template, the chat template with one
    assert PromptFormat().encode(plain, ex) == [plain(e.prompt)["input_ids"] for e in ex]
    assert PromptFormat("off").encode(chat, ex) == [plain(e.prompt)["input_ids"] for e in ex]
    got = PromptFormat("auto", system_prompt="be brief").encode(chat, ex)
    user = CHAT_USER_TEMPLATE.format(question="Tom has 2", form="#### <answer>")
    text = f"system : be brief <eos> user : {user} <eos> Answer:"
    assert got[0] == chat(text, add_special_tokens=False)["input_ids"]
    assert PromptFormat("on").encode(chat, ex[1:])[0][-1] == chat.convert_tokens_to_ids("Answer:")
    assert "\\boxed{<answer>}" in CHAT_USER_TEMPLATE.format(question="q", form="\\boxed{<answer>}")
    with pytest.raises(ValueError, match="chat_template is 'on' but the tokenizer has no chat template"):
        PromptFormat("on").encode(plain, ex)
    with pytest.raises(ValueError, match=r"chat_template must be one of \('auto', 'on', 'off'\), got 'yes'"):
        PromptFormat("yes")
    with pytest.raises(TypeError, match="system_prompt must be a str or None"):
        PromptFormat(system_prompt=3)
