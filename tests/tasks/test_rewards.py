"""Final-answer extraction and the math-verify reward (spec_rl.tasks.rewards).

Comparisons that need math-verify skip, with the reason, where it is not installed (the GPU machine's
image lacks it unless its wheels travel in .whl/); plain-number comparisons run everywhere.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
from repo_paths import SHARED_DATA

from spec_rl.tasks.data import load_jsonl
from spec_rl.tasks.rewards import (
    REWARD_FUNCTIONS,
    MathVerifyUnavailable,
    extract_boxed,
    extract_final_answer,
    get_reward_fn,
    math_reward,
)

DATA = SHARED_DATA
GSM8K = DATA / "gsm8k_test.jsonl"
MATH500 = DATA / "math500_test.jsonl"


def scored(completion, gold) -> float:
    """math_reward, or a skip where the comparison needs math-verify and it cannot be imported."""
    try:
        return math_reward(completion, gold)
    except MathVerifyUnavailable as exc:
        pytest.skip(str(exc))


def test_extract_final_answer():
    assert extract_final_answer("a\nb = 72\n#### 72") == "72"
    assert extract_final_answer("#### 1\n#### 2 \nmore text") == "2"
    assert extract_final_answer("so $\\boxed{\\frac{1}{2}}$ and") == "\\frac{1}{2}"
    assert extract_final_answer("\\boxed{1} then \\boxed{\\sqrt{x^{2}}}") == "\\sqrt{x^{2}}"
    # unclosed last box (truncated generation): previous complete box
    assert extract_final_answer("\\boxed{3} ... \\boxed{4") == "3"
    # empty #### falls back to the box
    assert extract_final_answer("\\boxed{5}\n####  \n") == "5"
    assert extract_final_answer("no answer here") is None
    assert extract_final_answer("") is None
    assert extract_boxed("\\boxed{") is None


@pytest.mark.parametrize(
    "completion, gold, expected",
    [
        ("He has 70 + 2 = 72.\n#### 72", "72", 1.0),
        ("#### 72", "72.0", 1.0),
        ("#### 1,000", "1000", 1.0),
        ("#### $18.", "18", 1.0),
        ("#### 18 apples", "18", 1.0),
        ("#### -3", "-3", 1.0),
        ("#### 73", "72", 0.0),
        ("The answer is $\\boxed{0.5}$.", "\\frac{1}{2}", 1.0),
        ("The answer is $\\boxed{\\frac{1}{2}}$.", "0.5", 1.0),
        ("$\\boxed{\\dfrac{14}{3}}$", "\\frac{14}{3}", 1.0),
        ("$\\boxed{\\frac{13}{3}}$", "\\frac{14}{3}", 0.0),
        ("\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}", "\\left( 3, \\frac{\\pi}{2} \\right)", 1.0),
        ("\\boxed{(3, \\pi/2)}", "\\left( 3, \\frac{\\pi}{2} \\right)", 1.0),
        ("\\boxed{3\\sqrt{2}}", "\\sqrt{18}", 1.0),
        ("#### 2", "2x", 0.0),
        ("the answer is 72", "72", 0.0),  # no final-answer marker
        ("", "72", 0.0),
        ("#### }{\\frac{{", "5", 0.0),
        ("\\boxed{\\frac{1}{0}}", "5", 0.0),
        ("#### " + "9" * 5000, "9", 0.0),
        ("\x00\x01 #### \\\\\\", "1", 0.0),
    ],
)
def test_math_reward(completion, gold, expected):
    assert scored(completion, gold) == expected


def test_math_reward_bad_gold():
    with pytest.raises(TypeError, match="gold"):
        math_reward("#### 1", None)
    with pytest.raises(ValueError, match="gold"):
        math_reward("#### 1", "  ")
    assert math_reward(None, "1") == 0.0


def test_math_reward_off_main_thread():
    """math-verify's signal timeouts only work in the main thread; the reward must still work elsewhere."""
    cases = [("\\boxed{0.5}", "\\frac{1}{2}", 1.0), ("\\boxed{x}", "5", 0.0), ("#### 7", "7", 1.0)]
    results: list = []

    def work():
        try:
            results.extend(math_reward(c, g) for c, g, _ in cases)
        except BaseException as e:  # pragma: no cover - reported below
            results.append(e)

    t = threading.Thread(target=work)
    t.start()
    t.join()
    if any(isinstance(r, MathVerifyUnavailable) for r in results):
        pytest.skip(str(results[-1]))
    assert results == [e for _, _, e in cases]


@pytest.mark.skipif(not GSM8K.is_file(), reason=f"{GSM8K} not present")
def test_gsm8k_gold_solutions_score_one():
    exs = load_jsonl(GSM8K, limit=50)
    assert [scored(e.solution, e.answer) for e in exs] == [1.0] * 50
    # a solution scored against another problem's answer fails (when the answers differ)
    wrong = [scored(a.solution, b.answer) for a, b in zip(exs, exs[1:]) if a.answer != b.answer]
    assert wrong and all(r == 0.0 for r in wrong)


@pytest.mark.skipif(not MATH500.is_file(), reason=f"{MATH500} not present")
def test_math500_gold_solutions_score_one():
    exs = load_jsonl(MATH500, limit=40)
    assert [scored(e.solution, e.answer) for e in exs] == [1.0] * 40


def test_registry():
    assert REWARD_FUNCTIONS["math"] is math_reward
    assert get_reward_fn("math") is math_reward

    def mine(completion: str, gold: str) -> float:
        return 0.5

    assert get_reward_fn(mine) is mine
    with pytest.raises(ValueError, match=r"unknown reward 'gsm'.*'math'"):
        get_reward_fn("gsm")
    with pytest.raises(TypeError, match="reward"):
        get_reward_fn(3)


@pytest.mark.parametrize(
    "completion, gold, form, both",
    [
        ("so 3 + 4 = 7\n#### 7", "7", 1.0, 1.0),  # right, in the form
        ("so 3 + 4 = 8\n#### 8", "7", 1.0, 0.5),  # wrong, in the form
        ("The answer is \\boxed{7}.", "7", 1.0, 1.0),
        ("The answer is 7.", "7", 0.0, 0.0),  # right but not in the form: math_reward reads only the form too
        ("#### ", "7", 0.0, 0.0),  # an empty answer line is no answer
        ("", "7", 0.0, 0.0),
    ],
)
def test_format_and_partial_credit_rewards(completion, gold, form, both):
    assert get_reward_fn("format")(completion, gold) == form
    assert get_reward_fn("math+format")(completion, gold) == both
    assert both == 0.5 * form + 0.5 * math_reward(completion, gold)


def test_missing_math_verify_is_an_error_not_a_zero(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # `import math_verify` now raises ImportError
    with pytest.raises(MathVerifyUnavailable, match="pip install"):
        math_reward("The answer is $\\boxed{0.5}$.", "\\frac{1}{2}")
    with pytest.raises(ImportError):  # callers that catch ImportError see it too
        math_reward("#### 2", "2x")
    # Decided without math-verify: plain numbers, no final answer, junk-length answers.
    assert math_reward("#### 1,000", "1000") == 1.0
    assert math_reward("#### 73", "72") == 0.0
    assert math_reward("the answer is 72", "\\frac{1}{2}") == 0.0


def test_reward_tests_skip_without_math_verify(tmp_path):
    """This file on a machine without math-verify (the GPU image): every test passes or skips, none fails."""
    blocker = tmp_path / "math_verify"
    blocker.mkdir()
    (blocker / "__init__.py").write_text("raise ImportError('math-verify hidden by the test')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-rs",
        __file__,
        "-k",
        "not skip_without_math_verify and not missing_math_verify",
    ]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)  # not the checkout
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "skipped" in out.stdout and "math-verify hidden by the test" in out.stdout, out.stdout[-3000:]
