"""The rollout benchmark runs end to end on CPU (tiny preset); no timing is asserted."""

import json
import sys

from repo_paths import BENCHMARKS

sys.path.insert(0, str(BENCHMARKS))

import bench_rollout  # noqa: E402


def test_bench_rollout_tiny_preset_reports_every_mode(tmp_path, capsys):
    out = tmp_path / "rollout.json"
    assert bench_rollout.main(["--preset", "tiny", "--device", "cpu", "--perturb", "0.5", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert set(rows) == {"e1-vanilla", "e1-histspec", "vanilla", "histspec", "spec", "exact"}
    assert rows["vanilla"]["generated_tokens_ratio"] == 1.0 and rows["e1-vanilla"]["generated_tokens_ratio"] == 1.0
    # Lossless tail speculation generates the same number of tokens as vanilla decoding.
    assert rows["histspec"]["generated_tokens"] == rows["vanilla"]["generated_tokens"]
    # Nothing to draft (empty history): the same steps over the same positions as vanilla.
    for k in ("generated_tokens", "decode_steps", "positions"):
        assert rows["e1-histspec"][k] == rows["e1-vanilla"][k], k
    # float64: the lossless rows give plain decoding's responses exactly; no response lists stay in the JSON.
    assert all(rows[name]["differs"] == 0 for name in ("e1-histspec", "histspec", "exact"))
    assert not any("_responses" in r for r in rows.values())
    for r in rows.values():  # what the steps computed: at least one position per row and step
        assert r["positions"] >= r["decode_steps"] and r["width"] >= 1.0 or r["decode_steps"] == 0
    assert rows["spec"]["generated_tokens"] < rows["vanilla"]["generated_tokens"]
    assert "tokens x" in capsys.readouterr().out


def test_bench_rollout_refuses_a_bad_lenience(capsys):
    import pytest

    with pytest.raises(SystemExit):
        bench_rollout.main(["--preset", "tiny", "--device", "cpu", "--lenience", "-1"])
    assert "--lenience must be a number (inf allowed) >= 0, got -1.0" in capsys.readouterr().err
