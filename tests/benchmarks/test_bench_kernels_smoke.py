"""The GPU benchmark scripts run their GPU code path on the CPU (Triton interpreter, tiny shapes).

No timing is asserted. What is: every row of ours was measured (a NameError or any exception in a
row is a failed row), the accuracy checks ran, the JSON says "ok", and a deliberately broken shape
makes the script exit non-zero instead of reporting success.
"""

import json
import sys

import pytest
from repo_paths import BENCHMARKS

sys.path.insert(0, str(BENCHMARKS))

import _harness  # noqa: E402
import bench_paged_attention  # noqa: E402
import gpu_suite  # noqa: E402

kernels = pytest.importorskip("spec_rl.kernels")
if not kernels.is_available("cpu"):
    pytest.skip("the smoke path needs the Triton interpreter on the CPU (TRITON_INTERPRET=1)", allow_module_level=True)

PAGED_ARGS = [
    "--device",
    "cpu",
    "--batch",
    "2",
    "--context",
    "40",
    "--long-batch",
    "1",
    "--long-context",
    "70",
    "--q-heads",
    "4",
    "--kv-heads",
    "2",
    "--head-dim",
    "32",
    "--rep-ms",
    "1",
]
SUITE_ARGS = [
    "--device",
    "cpu",
    "--n",
    "48",
    "--vocab",
    "256",
    "--d",
    "64",
    "--tokens-per-sample",
    "16",
    "--rep-ms",
    "1",
]


def test_paged_attention_benchmark_measures_and_checks_every_shape(tmp_path, capsys):
    out = tmp_path / "paged.json"
    assert bench_paged_attention.main([*PAGED_ARGS, "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["status"] == "ok" and record["failures"] == []
    ours = [r for r in record["rows"] if r["name"].startswith("ours")]
    assert {r["section"] for r in ours} == {"B=2 ctx=40", "B=1 ctx=70"}
    assert ours and all("ms" in r and "error" not in r for r in ours)
    assert len(record["checks"]) == 6 and all(v < bench_paged_attention.ACCURACY_TOL for v in record["checks"].values())
    printed = capsys.readouterr().out
    assert "ours: no split" in printed and "## Paged decode attention (stage 4" in printed


def test_paged_attention_benchmark_fails_on_a_broken_shape(tmp_path, monkeypatch):
    monkeypatch.setenv("SPEC_RL_FAULT", _harness.broken_shape_fault("bench_paged_attention"))
    out = tmp_path / "paged.json"
    args = [*PAGED_ARGS, "--long-batch", "0", "--json", str(out)]
    assert bench_paged_attention.main(args) == 1
    record = json.loads(out.read_text())
    assert record["status"] == "failed"
    assert any(f.startswith("ours: no split: AssertionError") for f in record["failures"]), record["failures"]
    assert all("error" not in r for r in record["rows"] if r["section"] == "B=2 ctx=40")  # the good shape still ran


def test_verification_suite_orders_ours_first_and_fails_on_a_broken_shape(tmp_path, monkeypatch):
    out = tmp_path / "suite.json"
    assert gpu_suite.main([*SUITE_ARGS, "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    names = [r["name"] for r in record["rows"]]
    assert names.index("ours: fused LM-head kernel d=64") < names.index("liger d=64")  # competitors come last
    assert record["status"] == "ok" and set(record["checks"]) == {
        "from_logits_max_abs_diff_vs_eager_fp32",
        "fused_d64_max_abs_diff_vs_fp32_torch",
    }
    monkeypatch.setenv("SPEC_RL_FAULT", _harness.broken_shape_fault("gpu_suite"))
    assert gpu_suite.main([*SUITE_ARGS, "--skip-competitors", "--json", str(out)]) == 1
    failures = json.loads(out.read_text())["failures"]
    assert any(f.startswith("ours: fused LM-head kernel d=64: AssertionError") for f in failures), failures


def test_run_record_fails_on_a_check_beyond_its_bound_or_nan(tmp_path):
    path = tmp_path / "r.json"
    rec = _harness.RunRecord(str(path), {"rows": []})
    assert json.loads(path.read_text())["status"] == "running"
    assert rec.check("fine", 1e-6, 1e-3)
    assert not rec.check("nan", float("nan"), 1e-3)
    assert not rec.check("big", 1.0, 1e-3)
    assert rec.finish() == 1
    record = json.loads(path.read_text())
    assert record["status"] == "failed" and len(record["failures"]) == 2
    rows = [{"name": "ours", "error": "E"}, {"name": "liger", "error": "E", "optional": True}, {"name": "ok", "ms": 1}]
    assert _harness.failed_rows(rows) == ["ours: E"]


def test_a_broken_shape_is_armed_by_a_broken_shape_fault_only(monkeypatch):
    monkeypatch.setenv("SPEC_RL_FAULT", "broken-shape:gpu_suite, bench_paged_attention")
    assert _harness.broken_shape_requested("gpu_suite") and _harness.broken_shape_requested("bench_paged_attention")
    assert not _harness.broken_shape_requested("bench_engine")
    assert _harness.broken_shape_fault("a", "b") == "broken-shape:a,b"
    monkeypatch.setenv("SPEC_RL_FAULT", "gpu_suite")  # a kill point's form, not a broken shape
    assert not _harness.broken_shape_requested("gpu_suite")
    monkeypatch.delenv("SPEC_RL_FAULT")
    assert not _harness.broken_shape_requested("gpu_suite")
