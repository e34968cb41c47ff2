"""The step-floor benchmark runs `spec-rl train` end to end on a tiny policy; no timing is asserted."""

import json
import sys

import pytest
from repo_paths import BENCHMARKS

sys.path.insert(0, str(BENCHMARKS))

import bench_step_floor  # noqa: E402


def write_problems(path, n=4):
    with path.open("w") as f:
        for i in range(n):
            f.write(json.dumps({"question": f"What is {i} + {i + 1}?", "answer": f"{i} + {i + 1} = {2 * i + 1}\n#### {2 * i + 1}"}) + "\n")


def test_step_floor_logs_every_decode_step_the_trainer_counts(model_dir, tmp_path, capsys):
    data, out, keep = tmp_path / "train.jsonl", tmp_path / "floor.json", tmp_path / "run"
    write_problems(data)
    code = bench_step_floor.main([
        "--keep", str(keep), "--json", str(out), "--from-epoch", "2",
        "--model", str(model_dir), "--data", str(data), "--epochs", "2", "--group-size", "2", "--prompts-per-step", "2",
        "--max-response-len", "6", "--max-model-len", "96", "--modes", "vanilla,spec,histspec", "--no-checkpoint",
    ])
    assert code == 0
    rec = json.loads(out.read_text())
    assert rec["status"] == "ok" and rec["failures"] == []  # the log matched the trainer's counters at every step
    rows = rec["rows"]
    assert set(rows) == {"vanilla", "spec", "histspec"}
    summary = json.loads((keep / "summary.json").read_text())
    for mode, row in rows.items():
        assert row["rollouts"] == 2  # epoch 2 of 4 prompts, 2 per step
        assert row["steps"] <= summary[mode][1]["decode_steps"]  # the trainer also counts the prefills
        assert row["positions"] >= row["rows"] >= row["steps"]
        assert row["table_s"] > 0 or row["steps"] == 0
        assert row["time_x"] == pytest.approx(row["rollout_s"] / rows["vanilla"]["rollout_s"])
        assert row["floor_x"] == pytest.approx((row["scoring_s"] + row["table_s"]) / rows["vanilla"]["rollout_s"])
    assert rows["vanilla"]["steps"] > 0 and rows["histspec"]["steps"] > 0
    assert rows["vanilla"]["scoring_s"] < 1e-3 and rows["vanilla"]["table_x"] == pytest.approx(1.0)
    printed = capsys.readouterr().out
    assert "floor x" in printed and "histspec" in printed


def test_step_floor_refuses_its_own_train_arguments(tmp_path, capsys):
    json_arg = ["--json", str(tmp_path / "x.json")]
    for bad in (["--out", "r"], ["--out=r"], ["--ou", "r"], ["--resume"], ["--res"], ["--backend", "paged"], ["--backend=vllm"]):
        with pytest.raises(SystemExit, match="is managed by this script"):
            bench_step_floor.main(json_arg + bad)
    assert bench_step_floor.train_arguments(["--backend", "transformers"], tmp_path)[-2:] == ["--backend", "transformers"]
    with pytest.raises(SystemExit) as exit_info:
        bench_step_floor.main(["--from-epoch", "0"])
    assert exit_info.value.code == 2 and "--from-epoch must be >= 1, got 0" in capsys.readouterr().err
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "summary.json").write_text("{}")
    with pytest.raises(SystemExit) as exit_info:
        bench_step_floor.main(["--keep", str(tmp_path / "old")])
    assert exit_info.value.code == 2 and "already exists and is not an empty folder" in capsys.readouterr().err


def test_step_floor_records_a_failed_train_call(tmp_path, capsys):
    out = tmp_path / "x.json"
    assert bench_step_floor.main(["--json", str(out), "--bogus", "3"]) == 1
    rec = json.loads(out.read_text())
    assert rec["status"] == "failed" and "spec-rl train exited with 2" in rec["failures"][0]
    assert "unrecognized arguments: --bogus 3" in capsys.readouterr().err


def test_step_floor_fails_clearly_without_a_summed_epoch(model_dir, tmp_path):
    data, out = tmp_path / "train.jsonl", tmp_path / "floor.json"
    write_problems(data)
    code = bench_step_floor.main([
        "--json", str(out), "--model", str(model_dir), "--data", str(data), "--epochs", "1", "--group-size", "2",
        "--prompts-per-step", "2", "--max-response-len", "4", "--max-model-len", "96", "--modes", "vanilla", "--no-checkpoint",
    ])
    rec = json.loads(out.read_text())
    assert code == 1 and rec["status"] == "failed" and rec["rows"] == {}
    assert "no rollout in epoch 2 or later" in rec["failures"][0]
