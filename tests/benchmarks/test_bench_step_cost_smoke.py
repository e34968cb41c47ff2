"""The step-cost benchmark runs end to end on CPU (tiny preset); no timing is asserted."""

import json
import sys

from repo_paths import BENCHMARKS

sys.path.insert(0, str(BENCHMARKS))

import bench_step_cost  # noqa: E402


def test_bench_step_cost_reports_table_plan_and_every_policy(tmp_path, capsys):
    out = tmp_path / "step_cost.json"
    args = ["--preset", "tiny", "--device", "cpu", "--perturb", "0.1", "--repeats", "1", "--json", str(out)]
    assert bench_step_cost.main(args) == 0
    rec = json.loads(out.read_text())
    assert rec["status"] == "ok" and rec["padded"] is True
    for row in rec["table"]:  # every measured row count, every width, relative to width 1
        assert len(row["ms"]) == len(rec["widths"]) and row["relative"][0] == 1.0 and min(row["ms"]) > 0
    assert {row["context"] for row in rec["table"]} == {row["context"] for row in rec["plan"]} == {64}  # 128 positions: one
    for row in rec["plan"]:
        assert all(1 <= w <= 9 for w in row["width"])  # max_k = 8 proposed tokens + the pending one
    rows = rec["rows"]
    policies = ("plain", "flat", "measured", "corrected")
    assert set(rows) == {f"{s}/{p}" for s in ("e1-siblings", "histspec") for p in policies}
    for setting in ("e1-siblings", "histspec"):
        plain, flat = rows[f"{setting}/plain"], rows[f"{setting}/flat"]
        assert plain["width"] == 1.0 and plain["time_x"] == 1.0
        for policy in policies:  # float64: every policy decodes plain decoding's tokens
            r = rows[f"{setting}/{policy}"]
            assert r["same_tokens"] is True and r["generated_tokens"] == plain["generated_tokens"]
        for policy in ("measured", "corrected"):
            assert flat["positions"] >= rows[f"{setting}/{policy}"]["positions"] >= plain["positions"]
        assert all(0.5 <= f <= 2.0 for f in rows[f"{setting}/corrected"]["wide_factor"].values())
        assert rows[f"{setting}/measured"]["wide_factor"] == {}
    assert rows["histspec/flat"]["positions"] > rows["histspec/plain"]["positions"]  # flat feeds every history draft
    assert "same tokens under every policy: True" in capsys.readouterr().out
