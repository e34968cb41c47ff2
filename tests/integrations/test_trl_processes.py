"""TRL across processes: ``torchrun --nproc_per_node 2`` (gloo, ``use_cpu=True``) with SpecRLRollout.

Every group of G = 4 samples straddles the two ranks (2 samples per process). Checked: the ranks agree
on the slots of each group (0..3 over the concatenated global batch, one prompt per group); from the
second epoch on every sample finds its draft; each checkpoint holds one cache file per rank; and a
resumed run reloads them, so its first rollout finds every draft again.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl", reason="trl is not installed (pip install 'spec-rl[trl]')")

from repo_paths import TESTS  # noqa: E402

from spec_rl.integrations.trl import CACHE_FILENAME  # noqa: E402

WORKER = TESTS / "integrations" / "trl_ranks_worker.py"


def _torchrun(out: Path, epochs: int, resume: Path | None = None) -> dict[int, dict]:
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")
    cmd = [torchrun, "--standalone", "--nproc_per_node", "2", str(WORKER), str(out), str(epochs)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        cmd + ([str(resume)] if resume else []), capture_output=True, text=True, env=env, timeout=600, cwd=out.parent
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {r: json.loads((out / f"calls.rank{r}.json").read_text()) for r in (0, 1)}


def _groups_by_step(ranks: dict[int, dict]) -> dict[int, list]:
    """Per global step: the global batch (rank 0's samples, then rank 1's)."""
    steps: dict[int, list] = {}
    for r in (0, 1):
        for call in ranks[r]["calls"]:
            steps.setdefault(call["step"], [None, None])[r] = list(zip(call["samples"], call["found"]))
    return {s: parts[0] + parts[1] for s, parts in steps.items()}


@pytest.mark.slow
def test_two_processes_agree_on_slots_find_every_draft_and_resume_with_their_caches(tmp_path):
    out = tmp_path / "run"
    ranks = _torchrun(out, epochs=2)
    assert ranks[0]["processes"] == ranks[1]["processes"] == 2
    batches = _groups_by_step(ranks)
    steps_per_epoch = len(batches) // 2
    for step, batch in batches.items():
        for g in range(0, len(batch), 4):
            group = batch[g : g + 4]
            assert [slot for (_, slot, _), _ in group] == [0, 1, 2, 3]  # both ranks derived the same slots
            assert len({(tuple(p), d) for (p, _, d), _ in group}) == 1  # one prompt and dataset id per group
        if step >= steps_per_epoch:
            assert all(found for _, found in batch), f"step {step}: a sample of epoch 2 found no draft"
        else:
            assert not any(found for _, found in batch)  # epoch 1 starts from empty caches
    checkpoints = sorted(out.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    assert len(checkpoints) == 2
    for ckpt in checkpoints:
        assert (ckpt / CACHE_FILENAME).is_file()
        assert (ckpt / CACHE_FILENAME.replace(".safetensors", ".rank1.safetensors")).is_file()
    resumed = _torchrun(out, epochs=3, resume=checkpoints[-1])
    first = min(c["step"] for c in resumed[0]["calls"])
    assert first == 2 * steps_per_epoch
    for r in (0, 1):
        assert all(all(c["found"]) for c in resumed[r]["calls"])  # caches reloaded per rank
