"""`spec-rl sweep`: settings x seeds of one recipe, paired with vanilla, resumable (also after kill -9)."""

import json
import math
import os
import subprocess
import sys

import pytest
from repo_paths import TESTS
from test_crash_safety import _gsm8k_lines

from spec_rl.acceptance.mode import MODES, RolloutMode
from spec_rl.acceptance.rules import Lenient
from spec_rl.sampling.distribution import SamplingSettings
from spec_rl.tasks.data import Example
from spec_rl.trainer.config import GRPOConfig
from spec_rl.trainer.heldout import HeldoutEvaluator
from spec_rl.trainer.sweep import (
    DEMO_SETTINGS,
    MODEL_SETTINGS,
    PAPER,
    Sweep,
    aggregate,
    chosen_settings,
    markdown,
    paired_interval,
    run_sweep,
)


def _examples(pairs, tag):
    return [
        Example(
            f"Question: Tom has {a} apples . Ann buys {b} more . how many now ? Answer:",
            str(a + b),
            f"{tag}:{a}:{b}",
            "test",
        )
        for a, b in pairs
    ]


def _parity(text: str, gold: str) -> float:
    return float(len(text) % 2)


def test_sweep_runs_every_setting_and_seed_and_resumes(model_dir, tmp_path, monkeypatch):
    evaluated = []  # (seed, epoch) of every held-out evaluation made
    real = HeldoutEvaluator.evaluate

    def counted(self, model, epoch):
        evaluated.append((self.run_seed, epoch))
        return real(self, model, epoch)

    monkeypatch.setattr(HeldoutEvaluator, "evaluate", counted)
    base = GRPOConfig(
        epochs=2,
        group_size=2,
        prompts_per_step=2,
        sampling=SamplingSettings(max_tokens=6),
        lr=1e-2,
        eval_samples=2,
        max_model_len=64,
        device="cpu",
    )
    settings = chosen_settings("l=inf,exact")
    train, heldout = _examples([(1, 2), (3, 4)], "t"), _examples([(1, 1), (2, 5), (3, 3)], "e")
    out = tmp_path / "sweep"
    job = Sweep(model_dir, train, heldout, _parity, base, settings, 2, out, {"task": "parity"})
    rows = run_sweep(job, progress=False)
    assert [r["setting"] for r in rows] == ["vanilla", "l=inf", "exact"]
    assert all(r["seeds"] == 2 for r in rows)
    by = {r["setting"]: r for r in rows}
    assert by["vanilla"]["generated_tokens_ratio"] == 1.0 and by["vanilla"]["heldout_gap"] == 0.0
    assert by["vanilla"]["heldout_low"] == by["vanilla"]["heldout_high"] == 0.0
    assert by["l=inf"]["generated_tokens"] == 0  # l = inf reuses every draft from epoch 2 on
    assert by["l=inf"]["accepted_share"] == 1.0 and by["l=inf"]["epoch_generated_tokens"][1] == 0
    assert by["exact"]["heldout_low"] <= by["exact"]["heldout_gap"] <= by["exact"]["heldout_high"]
    for name in ("vanilla", "l=inf", "exact"):
        for seed in range(2):
            runs = json.loads((out / name / f"seed{seed}" / "summary.json").read_text())["runs"]
            assert list(runs) == [name]  # each run's label is its setting's name
            assert runs[name][0]["acceptance"] == {"vanilla": None, "l=inf": "lenient", "exact": "exact"}[name]
            assert len(runs[name][-1]["heldout_prompt_rewards"]) == 3
    for seed in range(2):  # the warm start is evaluated by the seed's first run and reused by the others
        starts = [
            json.loads((out / name / f"seed{seed}" / "summary.json").read_text())["runs"][name][0]
            for name in ("vanilla", "l=inf", "exact")
        ]
        keys = [k for k in starts[0] if k.startswith("start_heldout") and k != "start_heldout_seconds"]
        assert "start_heldout_prompt_rewards" in keys and all(
            {k: s[k] for k in keys} == {k: starts[0][k] for k in keys} for s in starts
        )
        assert "start_epoch" not in starts[1]
        assert "start_heldout_seconds" in starts[0] and "start_heldout_seconds" not in starts[1]
    assert sorted(e for e in evaluated if e[1] == 0) == [(base.seed, 0), (base.seed + 1, 0)]
    data = json.loads((out / "sweep.json").read_text(), parse_constant=pytest.fail)  # strict JSON: no NaN
    assert data["rows"][0]["drift"] is None  # vanilla reuses nothing: not measured
    assert data["info"]["seeds"] == 2 and data["info"]["task"] == "parity"
    assert set(data["runs"]) == {"vanilla", "l=inf", "exact"}
    assert data["runs"]["l=inf"][1]["curve"][0][0] == 0  # held-out reward against tokens spent, from the start
    assert (out / "sweep.png").stat().st_size > 0
    md = (out / "report.md").read_text()
    assert "14.86x" in md and "| l=inf | 0 | 0.000 |" in md and "epoch 2" in md
    stamp = (out / "vanilla" / "seed0" / "summary.json").stat().st_mtime_ns
    again = run_sweep(job, progress=False)
    assert (out / "vanilla" / "seed0" / "summary.json").stat().st_mtime_ns == stamp  # finished runs are not redone
    assert again == rows


def _run(tokens, steps, reward, prompts, greedy=None):
    return dict(
        epoch_generated_tokens=[tokens, tokens],
        epoch_decode_steps=[steps, steps],
        generated_tokens=tokens,
        decode_steps=steps,
        rollout_seconds=tokens / 10,
        accepted_share=0.0,
        drift=None,
        wall_seconds=1.0,
        heldout_reward=reward,
        heldout_greedy_accuracy=reward,
        prompt_rewards=prompts,
        greedy_rewards=greedy or prompts,
        curve=[(0, 0.1), (2 * tokens, reward)],
    )


def test_paired_interval_over_seeds_and_problems():
    vanilla = [_run(100, 50, 0.5, [0.5, 0.5, 0.5, 0.5]) for _ in range(3)]
    same_gap = [_run(20, 10, 0.4, [0.4, 0.4, 0.4, 0.4]) for _ in range(3)]
    gap, low, high = paired_interval(same_gap, vanilla, "prompt_rewards")
    assert gap == pytest.approx(-0.1) and low == pytest.approx(-0.1) and high == pytest.approx(-0.1)
    spread = [_run(20, 10, 0.5, [0.3, 0.7, 0.5, 0.5]) for _ in range(3)]
    gap, low, high = paired_interval(spread, vanilla, "prompt_rewards")
    assert gap == pytest.approx(0.0) and -0.2 <= low < 0 < high <= 0.2  # problems differ: an interval around 0
    assert all(math.isnan(x) for x in paired_interval([_run(1, 1, 0.5, None)], vanilla[:1], "prompt_rewards"))
    rows = aggregate({"vanilla": vanilla, "l=e^0.5": spread})
    row = rows[1]
    assert row["generated_tokens_ratio"] == pytest.approx(0.2) and row["decode_steps_ratio"] == pytest.approx(0.2)
    assert row["epoch_generated_tokens"] == [20, 20] and row["heldout_gap"] == pytest.approx(0.0)
    md = markdown(rows, {"task": "toy", "seeds": 3})
    assert "| l=e^0.5 | 20 | 0.200 | 0.200 |" in md and str(PAPER["l=e^0.5"]["speedup"]) in md
    assert "+0.000 [" in md and "nan" not in md and "| vanilla | 100 / 50 | 100 / 50 |" in md


def test_settings_are_run_modes_by_name_with_vanilla_first():
    assert list(chosen_settings("l=1-res,spec-age2")) == ["vanilla", "l=1-res", "spec-age2"]
    age = chosen_settings("spec-age2")["spec-age2"].mode
    assert age.max_draft_age == 2 and age.rule == MODES["spec"].rule
    by = {name: x.mode for name, x in chosen_settings(None, MODEL_SETTINGS).items()}
    assert by["l=1-res"] == RolloutMode(Lenient(1.0, "residual")) and by["exact"] == MODES["exact"]
    assert by["coupled"] == MODES["coupled"] and by["spec+tis"] == MODES["spec"]
    assert chosen_settings(None, MODEL_SETTINGS)["spec+tis"].correction.kind == "tis"
    assert list(chosen_settings(" exact , vanilla")) == ["exact", "vanilla"]
    assert chosen_settings("spec+mis:3")["spec+mis:3"].correction.threshold == 3.0
    demo = {name: x.mode for name, x in chosen_settings(None).items()}
    assert list(demo) == list(DEMO_SETTINGS) and demo["l=e^0.2-excl"] == RolloutMode(
        Lenient(math.exp(0.2), "without-draft")
    )
    assert demo["l=inf"] == RolloutMode(Lenient(math.inf))
    with pytest.raises(ValueError, match=r"--settings: bogus: mode must be one of vanilla"):
        chosen_settings("l=1-excl,bogus")
    with pytest.raises(ValueError, match="--settings is empty"):
        chosen_settings(" , ")
    with pytest.raises(ValueError, match="--settings names a run twice"):
        chosen_settings("spec,spec")


def test_a_sweep_killed_mid_run_resumes_and_loses_no_finished_run(tmp_path):
    """kill -9 in the third run, twice; the rerun reads the two finished runs as they were, resumes the third from
    its files, and reports what an uninterrupted sweep reports."""
    from tiny_models import tiny_model, tiny_tokenizer

    policy, data = tmp_path / "policy", tmp_path / "data.jsonl"
    tiny_model(seed=0).save_pretrained(policy)
    tiny_tokenizer().save_pretrained(policy)
    data.write_text(_gsm8k_lines([(1, 2), (3, 4), (2, 2), (5, 1), (4, 4), (2, 6)]))

    def sweep(out, kill=None):
        argv = ["sweep", "--model", str(policy), "--data", str(data), "--eval-fraction", "0.34", "--seeds", "2"]
        argv += ["--settings", "vanilla,l=inf", "--epochs", "2", "--group-size", "2", "--prompts-per-step", "2"]
        argv += ["--max-response-len", "6", "--lr", "5e-2", "--reward", "gold_word", "--out", str(out)]
        env = {k: v for k, v in os.environ.items() if k != "KILL_AT"}
        env.update({"KILL_AT": kill} if kill else {})
        cmd = [sys.executable, str(TESTS / "crash_cli.py"), *argv, "--no-progress"]
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)

    # 4 steps a run: killed in the third run's first step (nothing of it committed), then again in the rerun's third
    # step of that run (its first epoch committed)
    for kill in ("step.end@9", "step.end@3"):
        killed = sweep(tmp_path / "killed", kill=kill)
        assert killed.returncode == -9, killed.stderr[-2000:]
    finished = tmp_path / "killed" / "vanilla" / "seed0" / "summary.json"
    stamp = finished.stat().st_mtime_ns
    resumed = sweep(tmp_path / "killed")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert finished.stat().st_mtime_ns == stamp
    plain = sweep(tmp_path / "plain")
    assert plain.returncode == 0, plain.stderr[-2000:]

    def numbers(out):
        rows = json.loads((out / "sweep.json").read_text())["rows"]
        drop = ("rollout_seconds", "wall_seconds", "rollout_seconds_ratio")
        return [{k: v for k, v in r.items() if k not in drop} for r in rows]

    assert numbers(tmp_path / "killed") == numbers(tmp_path / "plain")


def test_a_sweep_without_learning_signal_says_so_instead_of_a_gap():
    flat = [dict(_run(100, 50, 0.5, [0.5, 0.5]), no_signal=True) for _ in range(2)]
    some = [dict(_run(20, 10, 0.5, [0.5, 0.5]), no_signal=seed == 0) for seed in range(2)]
    rows = aggregate({"vanilla": flat, "spec": some})
    assert all(r["no_signal"] for r in rows)  # vanilla never learnt: no gap measures anything
    assert rows[1]["no_signal_seeds"] == 1
    md = markdown(rows, {"task": "toy", "seeds": 2})
    assert "+0.000 [" not in md and md.count("no learning signal") >= 4
    assert "vanilla: 2 of 2 seed(s) had no learning signal" in md and "its gaps are not shown" in md
    learnt = aggregate({"vanilla": [_run(100, 50, 0.5, [0.5, 0.4])] * 2, "spec": some})
    assert not learnt[1]["no_signal"] and "1 of 2 seed(s)" in markdown(learnt, {})
