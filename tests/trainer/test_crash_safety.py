"""Crash safety: `spec-rl train` killed with SIGKILL at any instant resumes with nothing lost.

The CLI runs in a subprocess (tests/crash_cli.py: the real ``main`` plus a reward that pays a tiny random
policy) on a tiny Qwen2 policy and four GSM8K-format prompts: vanilla then l=1, 2 epochs of 2 steps,
a KL term (so a resumed run must also restore the reference policy), and a held-out evaluation
before training and after every epoch (two held-out prompts). It is killed at named points
(``KILL_AT``, wrapped around the library by tests/crash_cli.py) and at random instants; ``--resume`` must then give
the per-epoch records and per-step metrics of an uninterrupted run with the same seed (rewards,
generated tokens, decode steps, held-out rewards: every field but timings), with no step listed twice and no
temporary file or uncommitted checkpoint left behind.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from repo_paths import TESTS
from tiny_models import tiny_model, tiny_tokenizer

from spec_rl.trainer.checkpoint import MARKER, POINTER, commit_checkpoint, latest_checkpoint, remove_stale
from spec_rl.trainer.rundir import run_contents

DRIVER = TESTS / "crash_cli.py"
MODES = ("vanilla", "l=1")
PROBLEMS = [(1, 2), (3, 4), (2, 2), (5, 1)]
HELDOUT = [(1, 1), (4, 3)]


def _gsm8k_lines(problems) -> str:
    return "".join(
        json.dumps(
            {
                "question": f"Tom has {a} apples . Ann buys {b} more . how many now ?",
                "answer": f"{a} + {b} = {a + b} #### {a + b}",
            }
        )
        + "\n"
        for a, b in problems
    )


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("crash")
    policy = root / "policy"
    tiny_model(seed=0).save_pretrained(policy)
    tiny_tokenizer().save_pretrained(policy)
    data, heldout = root / "data.jsonl", root / "heldout.jsonl"
    data.write_text(_gsm8k_lines(PROBLEMS))
    heldout.write_text(_gsm8k_lines(HELDOUT))
    return policy, data, heldout


def _argv(inputs, out: Path, resume: bool) -> list[str]:
    policy, data, heldout = inputs
    argv = [
        "train",
        "--model",
        str(policy),
        "--data",
        str(data),
        "--eval-data",
        str(heldout),
        "--eval-samples",
        "2",
        "--out",
        str(out),
        "--modes",
        ",".join(MODES),
        "--epochs",
        "2",
        "--group-size",
        "4",
        "--prompts-per-step",
        "2",
        "--max-response-len",
        "8",
        "--lr",
        "5e-2",
        "--kl-coef",
        "0.05",
        "--seed",
        "3",
        "--reward",
        "gold_word",
        "--no-progress",
    ]
    return argv + (["--resume"] if resume else [])


def _start(argv: list[str], log: Path, fault: str | None = None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "KILL_AT"}
    env["OMP_NUM_THREADS"] = "1"  # same thread count in every run: identical float results
    if fault:
        env["KILL_AT"] = fault
    with open(log, "ab") as f:
        return subprocess.Popen([sys.executable, str(DRIVER), *argv], stdout=f, stderr=subprocess.STDOUT, env=env)


def _run(argv: list[str], log: Path, fault: str | None = None, timeout: float = 300) -> int:
    return _start(argv, log, fault).wait(timeout=timeout)


def _without_timings(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.endswith("_seconds")}


def _results(out: Path) -> tuple[dict, dict]:
    """(summary without timings, {mode: [step metrics without timings]}); asserts every step is listed once."""
    summary = json.loads((out / "summary.json").read_text())["runs"]
    steps = {}
    for mode in MODES:
        lines = [json.loads(x) for x in (out / mode / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in lines] == list(range(len(lines))), f"{mode}: steps missing or listed twice"
        steps[mode] = [_without_timings(r) for r in lines]
    return {m: [_without_timings(r) for r in recs] for m, recs in summary.items()}, steps


def _assert_clean(out: Path) -> None:
    """No temporary file anywhere; one committed, complete checkpoint version per mode."""
    leftovers = [p for p in out.rglob("*.tmp")]
    assert not leftovers, f"temporary files left behind: {leftovers}"
    for mode in MODES:
        versions = sorted(p.name for p in (out / mode).glob("checkpoint-*"))
        assert versions == ["checkpoint-4"], f"{mode}: {versions}"
        assert (out / mode / POINTER).read_text().strip() == "checkpoint-4"


@pytest.fixture(scope="module")
def uninterrupted(inputs, tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted") / "run"
    t0 = time.perf_counter()
    assert _run(_argv(inputs, out, resume=False), out.parent / "log.txt") == 0, (out.parent / "log.txt").read_text()
    summary, steps = _results(out)
    assert [r["epoch"] for r in summary["l=1"]] == [1, 2] and summary["l=1"][1]["reused_tokens"] > 0
    assert any(r["mean_reward"] > 0 for r in summary["l=1"])  # the weights move: resume has something to get right
    assert all("heldout_reward" in r for r in summary["l=1"]) and "start_heldout_reward" in summary["vanilla"][0]
    return summary, steps, time.perf_counter() - t0


def _pointer(out: Path, mode: str) -> str | None:
    path = out / mode / POINTER
    return path.read_text().strip() if path.is_file() else None


def _epochs_in_summary(out: Path, mode: str) -> list[int]:
    return [r["epoch"] for r in json.loads((out / "summary.json").read_text())["runs"].get(mode, [])]


# (KILL_AT of one run, what that kill must have left on disk). Each run after the first resumes
# the one before; the hit counts are per process. Steps: vanilla 0-3, then l=1 0-3; a checkpoint ends
# every epoch (checkpoint-2 after epoch 1, checkpoint-4 after epoch 2).
CHAIN = [
    # during an epoch: vanilla's epoch 2 has one of its two steps done; epoch 1 is committed and reported
    (
        "step.end@3",
        lambda out: (
            _pointer(out, "vanilla") == "checkpoint-2"
            and len((out / "vanilla/metrics.jsonl").read_text().splitlines()) == 3
            and _epochs_in_summary(out, "vanilla") == [1]
        ),
    ),
    # between the checkpoint's renames: the new pointer is written to its temporary name only
    (
        "write:LATEST@1",
        lambda out: (
            _pointer(out, "vanilla") == "checkpoint-2"
            and (out / "vanilla/checkpoint-4" / MARKER).is_file()
            and any((out / "vanilla").glob(".LATEST.*.tmp"))
        ),
    ),
    # the pointer moved; the old version and the summary are not updated yet
    (
        "checkpoint.committed@1",
        lambda out: (
            _pointer(out, "vanilla") == "checkpoint-4"
            and (out / "vanilla/checkpoint-2").is_dir()
            and _epochs_in_summary(out, "vanilla") == [1]
        ),
    ),
    # during the rollout-cache write of l=1's first checkpoint (vanilla is finished and reported)
    (
        "write:rollout_cache.safetensors@1",
        lambda out: (
            _pointer(out, "l=1") is None
            and any((out / "l=1/checkpoint-2").glob(".rollout_cache*.tmp"))
            and _epochs_in_summary(out, "vanilla") == [1, 2]
        ),
    ),
    # l=1's epoch-2 version has its files but no trainer state or marker yet
    (
        "checkpoint.files@2",
        lambda out: (
            _pointer(out, "l=1") == "checkpoint-2"
            and (out / "l=1/checkpoint-4").is_dir()
            and not (out / "l=1/checkpoint-4" / MARKER).exists()
        ),
    ),
    # the version is complete and marked, the pointer still names the previous one
    (
        "checkpoint.marked@1",
        lambda out: _pointer(out, "l=1") == "checkpoint-2" and (out / "l=1/checkpoint-4" / MARKER).is_file(),
    ),
    # during the summary write after l=1's epoch 2 (the first summary write is vanilla's end-of-run report)
    (
        "write:summary.json@2",
        lambda out: (
            _pointer(out, "l=1") == "checkpoint-4"
            and any(out.glob(".summary.json.*.tmp"))
            and _epochs_in_summary(out, "l=1") == [1]
        ),
    ),
]


@pytest.mark.slow
def test_kill_at_named_points_then_resume_matches_an_uninterrupted_run(inputs, uninterrupted, tmp_path):
    out, log = tmp_path / "run", tmp_path / "log.txt"
    for i, (fault, left_behind) in enumerate(CHAIN):
        rc = _run(_argv(inputs, out, resume=i > 0), log, fault=fault)
        assert rc == -signal.SIGKILL, f"{fault}: the run was not killed (rc {rc}):\n{log.read_text()[-3000:]}"
        assert left_behind(out), f"{fault}: unexpected files after the kill: {sorted(map(str, out.rglob('*')))}"
    assert _run(_argv(inputs, out, resume=True), log) == 0, log.read_text()[-3000:]
    summary, steps, _ = uninterrupted
    assert _results(out) == (summary, steps)
    _assert_clean(out)
    runs = json.loads((out / "summary.json").read_text())["runs"]
    assert latest_checkpoint(out / "l=1").state["records"] == runs["l=1"]


@pytest.mark.slow
def test_kill_at_random_instants_always_resumes(inputs, uninterrupted, tmp_path):
    summary, steps, wall = uninterrupted
    rng = random.Random(11)
    out, log = tmp_path / "run", tmp_path / "log.txt"
    for _ in range(3):
        # A kill before the run wrote anything leaves nothing to resume: that run starts afresh.
        proc = _start(_argv(inputs, out, resume=bool(run_contents(out))), log)
        try:
            rc = proc.wait(timeout=rng.uniform(0.3, wall))
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGKILL)  # the parent kills the run at a random instant
            rc = proc.wait()
        assert rc in (0, -signal.SIGKILL), f"a resumed run failed (rc {rc}):\n{log.read_text()[-3000:]}"
    assert _run(_argv(inputs, out, resume=bool(run_contents(out))), log) == 0, log.read_text()[-3000:]
    assert _results(out) == (summary, steps)
    _assert_clean(out)


def _commit(run_dir: Path, step: int, payload: bytes = b"weights") -> Path:
    state = {"epoch": step // 2, "step": step, "records": [{"epoch": e} for e in range(1, step // 2 + 1)]}
    return commit_checkpoint(run_dir, state, lambda folder: (folder / "model.safetensors").write_bytes(payload)).path


def test_the_pointer_names_the_committed_version_and_damage_falls_back_to_a_complete_one(tmp_path):
    run = tmp_path / "spec"
    _commit(run, 2)
    _commit(run, 4, b"newer weights")
    assert [p.name for p in run.glob("checkpoint-*")] == ["checkpoint-4"]  # older versions go once the pointer moved
    assert latest_checkpoint(run).state["records"] == [{"epoch": 1}, {"epoch": 2}]
    told = []
    for damage in (b"\xff\xfe", b"checkpoint-9", b"../elsewhere"):  # not text, a missing version, not a version name
        (run / POINTER).write_bytes(damage)
        assert latest_checkpoint(run, log=told.append).path == run / "checkpoint-4"
    (run / POINTER).unlink()
    assert latest_checkpoint(run, log=told.append).step == 4 and len(told) == 4 and "LATEST" in told[0]
    # A version whose files do not match its marker (cut short) is not complete.
    (run / "checkpoint-4" / "model.safetensors").write_bytes(b"cut")
    assert latest_checkpoint(run) is None


def test_resume_cleanup_removes_partial_versions_and_temporary_files(tmp_path):
    run = tmp_path / "spec"
    kept = _commit(run, 2)
    partial = run / "checkpoint-4"
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"half")
    (run / ".metrics.jsonl.abc123.tmp").write_text("torn")
    (run / "notes.tmp").write_text("the user's, not ours")
    removed = remove_stale(run, keep=latest_checkpoint(run))
    assert sorted(p.name for p in removed) == [".metrics.jsonl.abc123.tmp", "checkpoint-4"]
    assert kept.is_dir() and (run / "notes.tmp").is_file()
    # A new commit at the step of an uncommitted leftover replaces it.
    partial.mkdir()
    (partial / "stale").write_text("x")
    assert not (_commit(run, 4) / "stale").exists()
