"""The engine benchmark script runs end to end on CPU (tiny preset); no timing is asserted."""

import json
import sys

import pytest
from repo_paths import BENCHMARKS

sys.path.insert(0, str(BENCHMARKS))

import bench_engine  # noqa: E402


def test_bench_engine_tiny_preset_writes_its_table(tmp_path, capsys):
    out = tmp_path / "engine.json"
    rc = bench_engine.main(
        [
            "--preset",
            "tiny",
            "--device",
            "cpu",
            "--batch",
            "2,3",
            "--new-tokens",
            "6",
            "--prompt-len",
            "5",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    result = json.loads(out.read_text())
    names = [r["name"] for r in result["decode"]]
    assert names[0].startswith("spec-rl PagedEngine") and "transformers generate" in names
    assert result["decode_batches"] == [2, 3] and [r["batch"] for r in result["decode"]] == [2] * 5 + [3] * 5
    graph_rows = [r for r in result["decode"] if r["name"].endswith("CUDA graphs")]
    # On a CPU the "graph" row runs the static step eagerly, and its tokens are the eager row's.
    assert [(r["graph_steps"], r["tokens_identical_to_eager"]) for r in graph_rows] == [(0, True), (0, True)]
    splice, reprefill = result["splice"]
    # Same drafts, same seed: both paths verify the same tokens; only the re-prefill path prefills again.
    assert splice["accepted_tokens"] == reprefill["accepted_tokens"]
    assert splice["reprefill_tokens"] == 0
    assert splice["engine_stats"]["prefill_tokens"] == splice["engine_stats"]["scoring_tokens"]
    assert "## Paged engine (stage 5, bench_engine.py)" in capsys.readouterr().out


def test_every_benchmark_checks_device_as_the_trainer_does(capsys):
    import bench_rollout

    for main in (bench_engine.main, bench_rollout.main):
        for bad in ("tpu9", ""):  # "" is refused as by spec-rl train, not taken for auto
            with pytest.raises(SystemExit) as err:
                main(["--device", bad, "--json", ""])
            assert err.value.code == 2
            assert f"--device must be auto, cpu, cuda, cuda:<index> or mps, got {bad!r}" in capsys.readouterr().err
