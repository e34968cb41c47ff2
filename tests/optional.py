"""Optional engines and trainers (vLLM, verl, OpenRLHF, TRL, Ray): import them, or skip the test module.

They are installed in .venv-vllm only (`make test-vllm`). There ``SPEC_RL_REQUIRE=1`` turns a missing or broken
install into a failure instead of a skip.
"""

import importlib
import os

import pytest


def require(*modules: str) -> None:
    """Import every module, or skip the calling test module (fail under ``SPEC_RL_REQUIRE=1``)."""
    for name in modules:
        if os.environ.get("SPEC_RL_REQUIRE") == "1":
            importlib.import_module(name)
        else:
            pytest.importorskip(name, reason=f"{name} is installed in .venv-vllm only (make test-vllm)")
