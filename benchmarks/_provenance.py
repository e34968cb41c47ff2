"""Provenance recorded with every benchmark result: which commit produced the numbers."""

from __future__ import annotations

import os
import subprocess


def commit() -> str:
    """``$SPEC_RL_COMMIT``, else ``git rev-parse HEAD`` (+ "-dirty" with uncommitted changes), else "unknown"."""
    env = os.environ.get("SPEC_RL_COMMIT")
    if env:
        return env
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        head = subprocess.run(["git", "-C", here, "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "-C", here, "status", "--porcelain"], capture_output=True, text=True, check=False)
        return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.CalledProcessError):  # no git: still benchmark
        return "unknown"
