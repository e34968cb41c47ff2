"""The decode-cache benchmark runs end to end on CPU (tiny preset); no timing is asserted."""

import json
import sys

import pytest
from repo_paths import BENCHMARKS

sys.path.insert(0, str(BENCHMARKS))

import bench_decode_cache  # noqa: E402


def test_bench_decode_cache_tiny_preset_gives_identical_logits(tmp_path, capsys):
    out = tmp_path / "decode_cache.json"
    rc = bench_decode_cache.main(
        [
            "--preset",
            "tiny",
            "--device",
            "cpu",
            "--rows",
            "3",
            "--context",
            "5",
            "--widths",
            "1,3",
            "--repeats",
            "2",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    record = json.loads(out.read_text())
    assert [r["width"] for r in record["results"]] == [1, 3]
    assert all(
        r["max_logit_diff"] == 0.0 and r["concatenating_s"] > 0 and r["in_place_s"] > 0 for r in record["results"]
    )
    assert "in-place ms" in capsys.readouterr().out


def test_bench_decode_cache_refuses_the_gpu_preset_on_cpu(capsys):
    assert bench_decode_cache.main(["--preset", "qwen3-0.6b", "--device", "cpu", "--json", ""]) == 0
    assert "needs a CUDA device" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args, named",
    [
        (["--rows", "0"], "--rows"),
        (["--context", "-1"], "--context"),
        (["--repeats", "0"], "--repeats"),
        (["--widths", "1,x"], "--widths"),
        (["--widths", "0"], "--widths"),
        (["--device", "nope"], "--device"),
        (["--device", "meta"], "--device"),
        (["--json", "/proc/x.json"], "--json"),
    ],
)
def test_bench_decode_cache_names_a_bad_argument(args, named, capsys):
    with pytest.raises(SystemExit) as exc:
        bench_decode_cache.main(["--preset", "tiny", "--device", "cpu", *args])
    assert exc.value.code == 2 and named in capsys.readouterr().err


@pytest.mark.parametrize(
    "script",
    ["bench_decode_cache", "bench_engine", "bench_paged_attention", "bench_real_model", "bench_rollout", "gpu_suite"]
    + ["compile_check", "real_model_acceptance", "train_memory"],
)
def test_every_benchmark_refuses_an_unwritable_json_before_it_runs(script, tmp_path, capsys):
    """--json is probed while the flags are read (a record written only at the end would lose the measurement)."""
    main = __import__(script).main
    folders = (str(tmp_path), f"{tmp_path}/new/")  # an existing folder, and a path naming a folder not made yet
    for bad, why in (("/proc/x.json", "No such file"), *((f, "a folder; name a file") for f in folders)):
        with pytest.raises(SystemExit) as exc:
            main(["--json", bad])
        assert exc.value.code == 2 and f"--json: {bad}: cannot write it ({why}" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # no probe left behind


def test_the_json_probe_makes_the_folder_and_leaves_nothing(tmp_path, monkeypatch):
    import _harness

    ap = _harness.arguments("doc", "r.json")
    path = tmp_path / "new" / "r.json"
    assert ap.parse_args(["--json", str(path)]).json == str(path)
    assert list((tmp_path / "new").iterdir()) == [] and ap.parse_args(["--json", ""]).json == ""
    monkeypatch.chdir(tmp_path / "new")
    _harness.write_json("", {"a": 1})  # --json '': nothing written (the scripts that write at the end call it too)
    assert list((tmp_path / "new").iterdir()) == []
