"""benchmarks/gpu_check.sh in smoke mode (CPU) and its summary (benchmarks/gpu_report.py).

`make gpu-check-smoke` runs every stage in CI; these tests run single stages of the same script:
a deliberately broken benchmark shape must fail the run, $OUT must hold exactly the archive and the
summary, and the summary must show each stage's wall time beside its H200 budget.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from repo_paths import REPO_ROOT

ROOT = REPO_ROOT
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_decode_cache  # noqa: E402
import bench_engine  # noqa: E402
import gpu_report  # noqa: E402
import gpu_suite  # noqa: E402

kernels = pytest.importorskip("spec_rl.kernels")


def smoke(tmp_path: Path, stages: str, **env) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path / "out"
    base = {k: v for k, v in os.environ.items() if k not in ("SPEC_RL_FAULT", "DEADLINE_S")}
    full_env = {
        **base,
        "SMOKE": "1",
        "PYTHON": sys.executable,
        "OUT": str(out),
        "WORK": str(tmp_path / "work"),
        "STAGES": stages,
        **env,
    }
    proc = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_check.sh")], env=full_env, capture_output=True, text=True, timeout=600
    )
    return proc, out


def stage_rows(summary: str) -> dict[str, list[str]]:
    rows = {}
    for line in summary.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 7 and cells[0].isdigit():
            rows[cells[1]] = cells
    return rows


def test_smoke_stage_reports_wall_time_beside_its_budget(tmp_path):
    if not kernels.is_available("cpu"):
        pytest.skip("the smoke run needs the Triton interpreter on the CPU")
    proc, out = smoke(tmp_path, "3")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert sorted(p.name for p in out.iterdir()) == ["gpu-check.tar.gz", "summary.md"]  # nothing else in $OUT
    summary = (out / "summary.md").read_text()
    _, name, status, wall, budget, limit, _ = stage_rows(summary)["suite"]
    assert (name, status, budget, limit) == ("suite", "ok", "40", "180") and float(wall) > 0
    assert "## Verification kernels (stage 3" in summary and "not** measurements" in summary
    with tarfile.open(out / "gpu-check.tar.gz") as tar:
        names = set(tar.getnames())
        assert {"./summary.md", "./stages.tsv", "./logs/3-suite.log", "./json/gpu_suite.json"} <= names
        record = json.load(tar.extractfile("./json/gpu_suite.json"))
    assert record["status"] == "ok" and record["checks"]
    assert "== stage 3 suite: ok" in proc.stdout and "H200 budget 40 s" in proc.stdout


def test_smoke_run_fails_on_a_broken_benchmark_shape(tmp_path):
    if not kernels.is_available("cpu"):
        pytest.skip("the smoke run needs the Triton interpreter on the CPU")
    proc, out = smoke(tmp_path, "4", SPEC_RL_FAULT="broken-shape:bench_paged_attention")
    assert proc.returncode == 1, proc.stdout[-4000:]
    summary = (out / "summary.md").read_text()
    assert stage_rows(summary)["paged"][2] == "FAIL (exit 1)"
    assert "### stage 4 paged: FAIL (exit 1)" in summary  # the log's tail is in the summary
    assert "AssertionError" in summary and "vs kv_cache" in summary
    assert "gpu_check: total" in proc.stdout and "FAILED" in proc.stdout


def test_stages_past_the_deadline_are_skipped_and_recorded(tmp_path):
    proc, out = smoke(tmp_path, "3 4", DEADLINE_S="30")  # under 20 s left for every stage
    assert proc.returncode == 0, proc.stdout[-3000:]
    rows = stage_rows((out / "summary.md").read_text())
    assert rows["suite"][2] == rows["paged"][2] == "skipped: out of time"


def _write(work: Path, name: str, record: dict, report) -> None:
    """``record`` as its benchmark writes it: with its markdown (``report``, rendered from the record)."""
    (work / "json").mkdir(parents=True, exist_ok=True)
    (work / "json" / name).write_text(json.dumps({**record, "report": report(record)}))


def test_report_renders_gpu_records_as_results_tables(tmp_path):
    """What a device run writes (CUDA rows with memory, competitor rows, a cut stage) renders as tables."""
    work = tmp_path
    (work / "logs").mkdir()
    (work / "meta.tsv").write_text("mode\tGPU\ncommit\tabc123\n")
    (work / "stages.tsv").write_text(
        "1\tinstall\tok\t61.0\t75\t300\t\n2\ttests\tTIMEOUT after 240 s\t240.1\t150\t240\t\n"
    )
    (work / "current.tsv").write_text("3\tsuite\trunning\t\t60\t180\t\n")
    (work / "logs" / "2-tests.log").write_text("collected\n" + "x\n" * 30 + "last line of the log\n")
    meta = {
        "device": "NVIDIA H200",
        "commit": "abc123",
        "date": "2026-12-02",
        "torch": "2.11",
        "triton": "3.6",
        "n": 16384,
        "vocab": 151936,
        "dtype": "bf16",
    }
    rows = [
        {
            "name": "copy logits (floor, read+write)",
            "section": "logits",
            "ms": 2.1,
            "gb_per_s": 4700.0,
            "fraction_of_copy_bandwidth": 1.0,
            "extra_mb": 0.0,
        },
        {
            "name": "ours: from-logits kernel",
            "section": "logits",
            "ms": 1.2,
            "gb_per_s": 4100.0,
            "fraction_of_copy_bandwidth": 0.87,
            "extra_mb": 0.2,
            "speedup_vs_eager": 5.0,
        },
        {
            "name": "ours: fused LM-head kernel d=2048",
            "section": "hidden-2048",
            "ms": 15.5,
            "tflops": 660.0,
            "ratio_to_matmul": 1.04,
            "extra_mb": 12.0,
            "speedup_vs_liger": 1.2,
        },
        {
            "name": "liger d=4096",
            "section": "hidden-4096",
            "skipped": "skipped: liger-kernel not importable",
            "optional": True,
        },
    ]
    _write(
        work,
        "gpu_suite.json",
        {"meta": meta, "rows": rows, "checks": {"fused_d2048": 1e-3}, "status": "running", "failures": []},
        gpu_suite.report,
    )
    _write(
        work,
        "engine.json",
        {
            "device": "NVIDIA H200",
            "preset": "qwen3-0.6b",
            "batch": 64,
            "status": "failed",
            "decode_batches": [16, 64],
            "decode": [
                {
                    "name": "spec-rl PagedEngine, static step + CUDA graphs",
                    "batch": 64,
                    "tokens_per_s": 9000.0,
                    "ms_per_step": 7.1,
                    "engine_speedup_vs_this": 1.0,
                    "graph_steps": 63,
                    "tokens_identical_to_eager": True,
                },
                {"name": "transformers generate", "batch": 64, "error": "OutOfMemoryError: x"},
            ],
            "splice": [],
            "failures": ["transformers generate: OutOfMemoryError: x"],
        },
        bench_engine.report,
    )
    text = gpu_report.render(str(work))
    assert "| 2 | tests | TIMEOUT after 240 s | 240.1 | 150 | 240 | - |" in text
    assert "| 3 | suite | running | - | 60 | 180 | - |" in text
    assert "| ours: from-logits kernel | 1.200 | 4100 | 0.87 | 0.2 | eager 5.00x |" in text
    assert "| 2048 | ours: fused LM-head kernel d=2048 | 15.500 | 660 | 1.04 | 12.0 | liger 1.20x |" in text
    assert "| 4096 | liger d=4096 | skipped: liger-kernel not importable | - | - | - | - |" in text
    assert "decode batches [16, 64]" in text
    assert "| b=64 spec-rl PagedEngine, static step + CUDA graphs | 9000 | 7.10 | 1.00x | 63 | True |" in text
    assert "| b=64 transformers generate | OutOfMemoryError: x | - | - | - | - |" in text
    assert "**FAILED**: transformers generate: OutOfMemoryError: x" in text
    assert "### stage 2 tests: TIMEOUT after 240 s" in text and "last line of the log" in text
    assert "not** measurements" not in text  # a GPU run's numbers are measurements


def test_report_renders_the_decode_cache_comparison(tmp_path):
    (tmp_path / "logs").mkdir()
    (tmp_path / "stages.tsv").write_text("6\trollout\tok\t70.2\t75\t165\t\n")
    _write(
        tmp_path,
        "decode_cache.json",
        {
            "preset": "qwen3-0.6b",
            "device": "NVIDIA H200",
            "commit": "abc123",
            "results": [
                {
                    "width": 1,
                    "rows": 64,
                    "context": 512,
                    "concatenating_s": 0.0121,
                    "in_place_s": 0.0071,
                    "ratio": 0.5868,
                    "max_logit_diff": 0.0,
                }
            ],
        },
        bench_decode_cache.report,
    )
    text = gpu_report.render(str(tmp_path))
    assert "## Decode cache (stage 6, bench_decode_cache.py)" in text
    assert "| 1 | 64 | 512 | 12.10 | 7.10 | 0.587 | 0.0e+00 |" in text


@pytest.mark.real_model
def test_smoke_stage_8_runs_the_real_model_benchmark_on_a_tiny_llama_with_the_real_tokenizer(tmp_path, real_model_path):
    proc, out = smoke(tmp_path, "8", SPEC_RL_CACHE=str(real_model_path.parent))
    summary = (out / "summary.md").read_text()
    assert stage_rows(summary)["model"][2] == "ok", proc.stdout[-3000:]
    # two runs: more samples than the paged engine's rows (continuous batching), then one full batch
    assert summary.count("## Real-model rollouts (stage 8, bench_real_model.py)") == 2
    assert "2 prompts x G=2" in summary and "1 prompts x G=2" in summary and "paged engine rows 3" in summary
    assert "| paged | spec |" in summary and "| transformers | spec |" in summary
    assert "full step x" in summary and "scoring / prefill" in summary


def test_a_model_that_is_not_a_folder_is_refused(tmp_path):
    proc = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--model", str(tmp_path / "missing")],
        env={**os.environ, "SMOKE": "1", "OUT": str(tmp_path / "out")},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "is not a folder" in proc.stderr
