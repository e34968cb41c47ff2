"""`spec-rl sweep --model` on SmolLM2-135M-Instruct (chat template, the demo's word problems), small: every output
of a sweep, and the residual draw's rollouts on a real vocabulary."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spec_rl.cli import main

pytestmark = [pytest.mark.real_model]


def test_a_small_sweep_on_the_real_model(real_model_path, tmp_path, capsys):
    out = tmp_path / "sweep"
    argv = ["sweep", "--model", str(real_model_path), "--data", "demo", "--limit", "2", "--eval-limit", "2"]
    argv += ["--settings", "vanilla,l=1-res,spec-age1", "--seeds", "1", "--epochs", "2", "--group-size", "2"]
    argv += ["--prompts-per-step", "2", "--max-response-len", "12", "--lr", "1e-5", "--reward", "math+format"]
    argv += ["--eval-samples", "1", "--temperature", "0.7", "--out", str(out), "--no-progress"]
    assert main(argv) == 0
    assert "| l=1-res |" in capsys.readouterr().out
    data = json.loads((out / "sweep.json").read_text())
    rows = {r["setting"]: r for r in data["rows"]}
    assert set(rows) == {"vanilla", "l=1-res", "spec-age1"}
    assert data["info"]["task"].startswith(Path(real_model_path).name + " on demo (2 prompts x G=2, 2 epochs")
    assert rows["l=1-res"]["accepted_share"] > 0  # the residual draw reuses drafts of a real model at T = 0.7
    assert len(data["runs"]["vanilla"][0]["prompt_rewards"]) == 2
    assert (out / "report.md").is_file() and (out / "sweep.png").stat().st_size > 0
