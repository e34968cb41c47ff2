"""pytest-benchmark runs of benchmarks/: record the harness provenance with every result file."""

from __future__ import annotations

import _harness  # pytest (import mode "prepend") puts this folder on sys.path
import pytest


@pytest.hookimpl(optionalhook=True)
def pytest_benchmark_update_machine_info(config, machine_info):
    """Add device, torch / triton versions, commit and date to ``machine_info`` in ``--benchmark-json``."""
    machine_info["spec_rl"] = _harness.provenance()
