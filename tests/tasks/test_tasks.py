"""Arithmetic task generator and the demo policy build (spec_rl.tasks)."""

from __future__ import annotations

import json
import re

import pytest
from tiny_models import tiny_demo_config

from spec_rl.tasks import check_solution, generate_problems
from spec_rl.tasks import demo_policy as dp
from spec_rl.tasks.data import format_prompt
from spec_rl.tasks.rewards import math_reward

# ---------------------------------------------------------------------------
# An independent reading of the questions: recompute the answer from the text.
# ---------------------------------------------------------------------------

_CONN = r"^(?:First,|Then|Next,|After that,|Later,|Finally,) (?:he|she) "
_SENTENCE_RULES = [
    (re.compile(r"^\w+ has (\d+) \w+\.$"), lambda x, m: int(m[1])),
    (re.compile(_CONN + r"(?:buys|finds) (\d+) more \w+\.$"), lambda x, m: x + int(m[1])),
    (re.compile(_CONN + r"gets (\d+) \w+ from \w+\.$"), lambda x, m: x + int(m[1])),
    (
        re.compile(_CONN + r"(?:gives (\d+) \w+ to \w+|loses (\d+) \w+|sells (\d+) \w+)\.$"),
        lambda x, m: x - int(m[1] or m[2] or m[3]),
    ),
    (re.compile(_CONN + r"buys (\d+) \w+ with (\d+) \w+ in each \w+\.$"), lambda x, m: x + int(m[1]) * int(m[2])),
    (re.compile(_CONN + r"doubles (?:his|her) \w+\.$"), lambda x, m: 2 * x),
    (re.compile(_CONN + r"triples (?:his|her) \w+\.$"), lambda x, m: 3 * x),
    (
        re.compile(_CONN + r"splits (?:his|her) \w+ into (\d+) equal groups and keeps one group\.$"),
        lambda x, m: _exact_div(x, int(m[1])),
    ),
]


def _exact_div(a: int, b: int) -> int:
    assert a % b == 0, f"{a} not divisible by {b}"
    return a // b


def recompute_answer(question: str) -> int:
    sentences = re.findall(r"[^.?]+[.?]", question)
    assert sentences[-1].strip().startswith("How many")
    x = None
    for s in sentences[:-1]:
        s = s.strip()
        for pattern, fn in _SENTENCE_RULES:
            m = pattern.match(s)
            if m:
                x = fn(x, m)
                break
        else:
            raise AssertionError(f"unparsed sentence {s!r}")
        assert 0 < x < 100
    return x


def test_generate_is_deterministic_and_seeded():
    a = generate_problems(40, seed=3)
    b = generate_problems(40, seed=3)
    c = generate_problems(40, seed=4)
    assert a == b
    assert [e.question for e in a] != [e.question for e in c]
    assert [e.uid for e in a] == [f"arith:3:{i}" for i in range(40)]
    assert len({e.question for e in a}) == 40
    assert generate_problems(0, seed=1) == []


def test_solutions_are_correct():
    exs = generate_problems(300, seed=11)
    n_ops = set()
    for e in exs:
        assert e.prompt == format_prompt(e.question)
        assert e.source == "arith"
        last = e.solution.split("\n")[-1]
        assert last == f"#### {e.answer}"
        assert int(e.answer) == recompute_answer(e.question)
        assert check_solution(e.solution)
        assert math_reward(e.solution, e.answer) == 1.0
        assert math_reward(" " + e.solution, str(int(e.answer) + 1)) == 0.0
        n_steps = len(e.solution.split("\n")) - 2
        assert 2 <= n_steps <= 4
        n_ops |= set(re.findall(r"\d ([-+*/]) \d", e.solution))
    assert n_ops == {"+", "-", "*", "/"}


def test_slips_keep_true_answer():
    exs = generate_problems(400, seed=5, slip_prob=0.2)
    assert all(int(e.answer) == recompute_answer(e.question) for e in exs)
    ok = sum(e.solution.endswith(f"#### {e.answer}") for e in exs) / len(exs)
    assert 0.3 < ok < 0.8
    # without slips nothing changes and every solution is consistent
    assert generate_problems(20, seed=5, slip_prob=0.0) == generate_problems(20, seed=5)
    with pytest.raises(ValueError, match="slip_prob"):
        generate_problems(3, slip_prob=1.0)


def test_misconception_adds_instead_of_multiplying_and_keeps_the_true_answer():
    from spec_rl.tasks.arithmetic import arithmetic_reward

    exs = generate_problems(600, seed=7, misconception_prob=0.6)
    assert all(int(e.answer) == recompute_answer(e.question) for e in exs)
    group = [ln for e in exs for ln in e.solution.split("\n") if " in each " in ln]
    added = [ln for ln in group if re.search(r"has (\d+) \+ (\d+) = (\d+) more", ln)]
    for ln in added:  # k + m, written as the count of more items
        k, m, p = map(int, re.search(r"has (\d+) \+ (\d+) = (\d+) more", ln).groups())
        assert p == k + m
    assert 0.5 < len(added) / len(group) < 0.7  # 0.6 of the group lines, no other line
    assert all(" in each " in ln for e in exs for ln in e.solution.split("\n") if "more, and" in ln)
    wrong = [e for e in exs if not e.solution.endswith(f"#### {e.answer}")]
    assert wrong and all(check_solution(e.solution) and arithmetic_reward(e.solution, e.answer) == 0.0 for e in wrong)
    assert generate_problems(30, seed=5, misconception_prob=0.0) == generate_problems(30, seed=5)
    with pytest.raises(ValueError, match="misconception_prob"):
        generate_problems(3, misconception_prob=1.0)


def test_check_solution_rejects_wrong_steps():
    (e,) = generate_problems(1, seed=0)
    lines = e.solution.split("\n")
    bad_final = "\n".join(lines[:-1] + [f"#### {int(e.answer) + 1}"])
    assert not check_solution(bad_final)
    m = re.search(r"= (\d+)", e.solution)
    wrong = e.solution[: m.start(1)] + str(int(m[1]) + 1) + e.solution[m.end(1) :]
    assert not check_solution(wrong)


def test_arithmetic_reward_pays_consistent_solutions_with_the_gold_answer_only():
    from spec_rl.tasks.arithmetic import arithmetic_reward

    clean = generate_problems(50, seed=3)
    assert all(arithmetic_reward(" " + e.solution + "\n", e.answer) == 1.0 for e in clean)
    e = clean[0]
    assert arithmetic_reward(e.solution, str(int(e.answer) + 1)) == 0.0  # another gold answer
    m = re.search(r"= (\d+)", e.solution)
    slipped = e.solution[: m.start(1)] + str(int(m[1]) + 1) + e.solution[m.end(1) :]
    assert math_reward(slipped, e.answer) == 1.0  # the final answer is unchanged...
    assert arithmetic_reward(slipped, e.answer) == 0.0  # ...but a step is wrong: no reward
    # slipped solutions that propagate the slip end in a wrong answer: no reward either
    noisy = [x for x in generate_problems(200, seed=5, slip_prob=0.3) if not x.solution.endswith(f"#### {x.answer}")]
    assert noisy and all(arithmetic_reward(x.solution, x.answer) == 0.0 for x in noisy)


def test_generate_bad_args():
    with pytest.raises(ValueError, match="n must be"):
        generate_problems(-1)
    with pytest.raises(ValueError, match="min_steps"):
        generate_problems(3, min_steps=3, max_steps=2)
    with pytest.raises(ValueError, match="max_value"):
        generate_problems(3, max_value=5)
    with pytest.raises(TypeError, match="seed"):
        generate_problems(3, seed="a")


def test_exclude_keeps_sets_disjoint():
    base = generate_problems(50, seed=1)
    other = generate_problems(50, seed=1, exclude={e.question for e in base})
    assert not ({e.question for e in base} & {e.question for e in other})


def test_demo_sets_fixed_and_disjoint():
    train, evals = dp.demo_train_set(), dp.demo_eval_set()
    assert len(train) == 256 and len(evals) == 640
    assert train == dp.demo_train_set()
    assert not ({e.question for e in train} & {e.question for e in evals})
    assert len({e.uid for e in train + evals}) == 896
    assert all(e.solution.endswith(f"#### {e.answer}") for e in train)


# ---------------------------------------------------------------------------
# Tokenizer and the (tiny) policy build
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    texts = [e.prompt + dp.demo_response(e) for e in generate_problems(200, seed=9)]
    return dp.build_demo_tokenizer(texts, vocab_size=500)


def test_tokenizer_round_trip_and_digits(tokenizer):
    for e in generate_problems(20, seed=21):
        s = e.prompt + dp.demo_response(e)
        ids = tokenizer(s, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(ids) == s
        for t in tokenizer.convert_ids_to_tokens(ids):
            digits = re.sub(r"\D", "", t)
            assert len(digits) <= 1 and (not digits or t == digits), t
    odd = "Ünïcödé 12,345 \t tabs\n\n and emoji 🙂 {}\\boxed{x}"
    assert tokenizer.decode(tokenizer(odd, add_special_tokens=False)["input_ids"]) == odd
    assert tokenizer.eos_token == dp.EOS_TOKEN and tokenizer.pad_token == dp.PAD_TOKEN
    assert tokenizer.eos_token_id != tokenizer.pad_token_id
    assert tokenizer(s, add_special_tokens=True)["input_ids"] == ids  # nothing added silently


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("cache")
    path = dp.build_demo_policy(root, progress=False, config=tiny_demo_config())
    return root, path


def test_checkpoint_loads(tiny_ckpt):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root, path = tiny_ckpt
    assert path.parent == root and path.name == f"demo-policy-{tiny_demo_config().cache_key()}"
    assert (path / "model.safetensors").is_file()
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    assert model.config.model_type == "qwen2"
    assert model.config.eos_token_id == tok.eos_token_id
    assert model.config.pad_token_id == tok.pad_token_id
    assert model.generation_config.eos_token_id == tok.eos_token_id
    assert model.generation_config.pad_token_id == tok.pad_token_id
    assert model.config.vocab_size == len(tok)
    info = json.loads((path / "demo_info.json").read_text())
    assert info["num_parameters"] == sum(p.numel() for p in model.parameters())
    assert info["steps"] == 3
    # no leftovers of the temporary build directory
    assert [p.name for p in root.iterdir()] == [path.name]


def test_cached_build_does_not_retrain(tiny_ckpt, monkeypatch):
    root, path = tiny_ckpt
    mtime = (path / "model.safetensors").stat().st_mtime_ns

    def boom(*a, **k):
        raise AssertionError("retrained although a cached checkpoint exists")

    monkeypatch.setattr(dp, "_sft", boom)
    assert dp.build_demo_policy(root, progress=False, config=tiny_demo_config()) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime


def test_failed_build_leaves_nothing(tmp_path, monkeypatch):
    def crash(*a, **k):
        raise RuntimeError("simulated crash during SFT")

    monkeypatch.setattr(dp, "_sft", crash)
    with pytest.raises(RuntimeError, match="simulated crash"):
        dp.build_demo_policy(tmp_path, progress=False, config=tiny_demo_config())
    assert list(tmp_path.iterdir()) == []


def test_force_rebuild_and_env_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPEC_RL_CACHE", str(tmp_path / "env-cache"))
    cfg = tiny_demo_config(sft_steps=1)
    path = dp.build_demo_policy(progress=False, config=cfg)
    assert path.parent == tmp_path / "env-cache"
    calls = []
    real = dp._sft
    monkeypatch.setattr(dp, "_sft", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert dp.build_demo_policy(progress=False, config=cfg, force=True) == path
    assert calls == [1]
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]
    assert (path / "demo_info.json").is_file()


def test_the_config_names_its_checkpoint():
    assert dp.DemoConfig().cache_key() != dp.DemoConfig(sft_steps=7).cache_key()
    with pytest.raises(TypeError, match="config"):
        dp.build_demo_policy("/nonexistent-never-created", config={"sft_steps": 1})


@pytest.mark.slow
@pytest.mark.long  # builds the real demo policy: about 2 min on 2 cores (cached)
def test_demo_policy_calibration():
    """The default demo policy's warm-start calibration targets: temperature-1 reward on
    the train set in [0.15, 0.6] and mean response length >= 48 tokens."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from spec_rl.sampling.distribution import SamplingSettings
    from spec_rl.tasks.arithmetic import arithmetic_reward
    from spec_rl.tasks.evaluation import evaluate_heldout

    path = dp.build_demo_policy(progress=False)
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    settings = SamplingSettings(max_tokens=160)
    r = evaluate_heldout(model, tok, dp.demo_train_set(), settings, samples_per_prompt=1, reward_fn=arithmetic_reward)
    assert 0.15 <= r["heldout_reward"] <= 0.6, r
    assert r["heldout_response_tokens"] >= 48, r


def test_the_default_demo_policy_is_the_shipped_warm_start_checked_against_its_sha256(tmp_path, monkeypatch):
    import shutil

    path = dp.build_demo_policy(tmp_path / "cache", progress=False)
    assert path.name == f"demo-policy-{dp.DemoConfig().cache_key()}-{dp.WARM_START_SHA256['model.safetensors'][:8]}"
    for name in dp.WARM_START_SHA256:
        assert (path / name).read_bytes() == (dp.WARM_START / name).read_bytes()
    damaged = tmp_path / "damaged"
    shutil.copytree(dp.WARM_START, damaged)
    data = bytearray((damaged / "model.safetensors").read_bytes())
    data[-1] ^= 1
    (damaged / "model.safetensors").write_bytes(bytes(data))
    monkeypatch.setattr(dp, "WARM_START", damaged)
    with pytest.raises(ValueError, match="model.safetensors does not match its sha256"):
        dp.build_demo_policy(tmp_path / "other", progress=False)
    assert [p.name for p in (tmp_path / "other").iterdir()] == []  # no half-installed policy left
