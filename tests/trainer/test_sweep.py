"""`spec-rl sweep`: settings x seeds from one warm start, aggregated against vanilla, resumable."""

import json
import math

import pytest

from spec_rl.acceptance.mode import MODES, RolloutMode
from spec_rl.acceptance.rules import Lenient
from spec_rl.sampling.distribution import SamplingSettings
from spec_rl.tasks.data import Example
from spec_rl.trainer.config import GRPOConfig
from spec_rl.trainer.sweep import PAPER, SETTINGS, Setting, aggregate, chosen_settings, markdown, run_sweep


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


def test_sweep_runs_every_setting_and_seed_and_resumes(model_dir, tmp_path):
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
    settings = (SETTINGS[0], Setting("l=inf", RolloutMode(Lenient(math.inf))), Setting("exact", MODES["exact"]))
    train, heldout = _examples([(1, 2), (3, 4)], "t"), _examples([(1, 1)], "e")
    out = tmp_path / "sweep"
    rows = run_sweep(model_dir, train, heldout, _parity, base, out, "small", 2, settings, progress=False)
    assert [r["setting"] for r in rows] == ["vanilla", "l=inf", "exact"]
    assert all(r["seeds"] == 2 for r in rows)
    by = {r["setting"]: r for r in rows}
    assert by["vanilla"]["generated_tokens_ratio"] == 1.0
    assert by["l=inf"]["generated_tokens"] == 0  # l = inf reuses every draft from epoch 2 on
    for name in ("vanilla", "l=inf", "exact"):
        for seed in range(2):
            runs = json.loads((out / name / f"seed{seed}" / "summary.json").read_text())["runs"]
            assert list(runs) == [name]  # each run's label is its setting's name
            assert runs[name][0]["acceptance"] == {"vanilla": None, "l=inf": "lenient", "exact": "exact"}[name]
    inf_run = json.loads((out / "l=inf" / "seed1" / "summary.json").read_text())["runs"]["l=inf"]
    assert inf_run[0]["lenience"] == math.inf
    data = json.loads((out / "sweep.json").read_text())
    assert data["info"]["seeds"] == 2 and set(data["runs"]) == {"vanilla", "l=inf", "exact"}
    assert (out / "sweep.png").stat().st_size > 0
    md = (out / "sweep.md").read_text()
    assert "14.86x" in md and "| l=inf |" in md  # the paper's numbers beside ours
    stamp = (out / "vanilla" / "seed0" / "summary.json").stat().st_mtime_ns
    again = run_sweep(model_dir, train, heldout, _parity, base, out, "small", 2, settings, progress=False)
    assert (out / "vanilla" / "seed0" / "summary.json").stat().st_mtime_ns == stamp  # finished runs are not redone
    assert again == rows


def test_aggregate_and_table_layout():
    runs = {
        "vanilla": [
            dict(
                generated_tokens=100,
                rollout_seconds=10.0,
                decode_steps=50,
                heldout_reward=0.4,
                heldout_greedy_accuracy=0.5,
            )
        ]
        * 2,
        "l=e^0.5": [
            dict(generated_tokens=20, rollout_seconds=4.0, decode_steps=10, heldout_reward=r, heldout_greedy_accuracy=g)
            for r, g in ((0.38, 0.44), (0.42, 0.48))
        ],
    }
    rows = aggregate(runs)
    row = rows[1]
    assert row["generated_tokens_ratio"] == pytest.approx(0.2) and row["speedup"] == pytest.approx(2.5)
    assert row["heldout_reward"] == pytest.approx(0.4) and row["heldout_reward_std"] == pytest.approx(0.0283, abs=1e-3)
    # paired gaps to vanilla's same seed: -0.02, +0.02 -> s.e. = stdev / sqrt(2) = 0.02
    assert row["heldout_paired_se"] == pytest.approx(0.02) and rows[0]["heldout_paired_se"] == 0.0
    # greedy: gaps -0.06, -0.02 -> mean -0.04, s.e. = stdev / sqrt(2) = 0.02
    assert row["greedy_minus_vanilla"] == pytest.approx(-0.04) and row["greedy_paired_se"] == pytest.approx(0.02)
    md = markdown(rows, {"preset": "small", "seeds": 2})
    assert "+0.000 ± 0.020 | 0.460 (-0.040 ± 0.020) |" in md and "| 0.500 (+0.000 ± 0.000) |" in md
    one_seed = markdown(aggregate({k: v[:1] for k, v in runs.items()}), {"preset": "small", "seeds": 1})
    assert "nan" not in one_seed and "+0.000 ± - |" in one_seed  # no standard error from one pair
    assert "| l=e^0.5 | 20 | 0.200 |" in md and str(PAPER["l=e^0.5"]["speedup"]) in md
    with pytest.raises(ValueError, match="preset"):
        run_sweep(".", [], [], _parity, GRPOConfig(), ".", "huge", 1)


def test_the_settings_and_their_modes():
    by = {x.name: x.mode for x in SETTINGS}
    assert list(by)[:2] == ["vanilla", "random"]
    assert by["vanilla"] == MODES["vanilla"] and by["random"] == MODES["random"]
    assert by["exact"] == MODES["exact"] and "random-ref" not in by and "auto" not in by
    grid = {
        "1": 1.0,
        "e^0.2": math.exp(0.2),
        "e^0.5": math.exp(0.5),
        "e^1": math.e,
        "e^2": math.exp(2.0),
        "inf": math.inf,
    }
    for name, lenience in grid.items():
        assert by[f"l={name}"] == RolloutMode(Lenient(lenience, "policy"), tail=8)
    for name in ("1", "e^0.2", "e^0.5"):
        assert by[f"l={name}-excl"] == RolloutMode(Lenient(grid[name], "without-draft"))
    assert len(SETTINGS) == 2 + len(grid) + 1 + 3


def test_settings_flag_names_the_unknown_setting_and_puts_vanilla_first():
    assert [x.name for x in chosen_settings("l=1-excl")] == ["vanilla", "l=1-excl"]
    assert [x.name for x in chosen_settings(" exact , vanilla")] == ["exact", "vanilla"]
    assert chosen_settings(None) == SETTINGS
    with pytest.raises(ValueError, match=r"unknown name\(s\) bogus in 'l=1-excl,bogus'; choose from vanilla"):
        chosen_settings("l=1-excl,bogus")
    with pytest.raises(ValueError, match="no setting named"):
        chosen_settings(" , ")
