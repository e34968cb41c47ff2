"""Verification on the hidden-state path never holds as much memory as the full logits (CPU, N=2048, V=16384).

benchmarks/bench_memory.py measures the peak extra bytes of ``verify_hidden`` and of a whole
``SpeculativeRollout.run`` with the caller's grad mode on and the LM head a Parameter; an autograd
graph over the chunked logits would keep them all (2x the full [N, V] float32 logits before the
rollout ran under ``no_grad``).
"""

import json
import sys

import pytest
from repo_paths import BENCHMARKS

sys.path.insert(0, str(BENCHMARKS))

import bench_memory  # noqa: E402


def test_peak_extra_memory_stays_below_the_full_logits(tmp_path, capsys):
    out = tmp_path / "memory.json"
    assert bench_memory.main(["--device", "cpu", "--check", "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["shape"] == {"tokens": 2048, "vocab": 16384, "hidden": 64, "batch": 16}
    for name in ("verify", "rollout"):
        row = record["rows"][name]
        assert row["full_logits_mib"] == 128.0
        assert 0 < row["peak_extra_mib"] < row["full_logits_mib"], (name, row)  # measured: 0.38x
    assert "peak extra MiB" in capsys.readouterr().out


def test_every_benchmark_checks_device_as_the_trainer_does(capsys):
    import bench_engine
    import bench_rollout

    for main in (bench_memory.main, bench_engine.main, bench_rollout.main):
        for bad in ("tpu9", ""):  # "" is refused as by spec-rl train, not taken for auto
            with pytest.raises(SystemExit) as err:
                main(["--device", bad, "--json", ""])
            assert err.value.code == 2
            assert f"--device must be auto, cpu, cuda, cuda:<index> or mps, got {bad!r}" in capsys.readouterr().err
