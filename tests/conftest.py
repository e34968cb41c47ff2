"""Test-session setup.

The Triton kernels (spec_rl.kernels) are tested on CPU through the Triton
interpreter. Triton decides between compiling and interpreting when a kernel
is *defined* (``triton.jit`` reads TRITON_INTERPRET at decoration time), so
the variable must be set before anything imports ``spec_rl.kernels`` -- hence
here, in the conftest, which pytest imports before any test module. On a
machine with a CUDA device nothing is set and the kernels are compiled.
"""

import os

import pytest

try:
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except Exception:  # pragma: no cover
    _HAS_CUDA = False

if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Backends size speculation by a measured step cost (spec_rl.backends.step_cost); measuring takes seconds
# and makes decode-step counts depend on the machine. Tests use the flat cost (verify every proposed
# token) unless they pass a StepCost themselves; tests/backends/test_step_cost.py covers the measurement.
os.environ.setdefault("SPEC_RL_STEP_COST", "flat")


@pytest.fixture()
def model_dir(tmp_path):
    """A tiny Qwen2 policy and its tokenizer saved as a local checkpoint (tests/tiny_models.py)."""
    from tiny_models import tiny_model, tiny_tokenizer

    path = tmp_path / "policy"
    tiny_model(seed=0).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="session", params=[False, True], ids=["prefix-cache-off", "prefix-cache-on"])
def vllm_engine(request, tmp_path_factory):
    """A real vLLM AsyncLLM on a tiny Qwen2 (tests/vllm_env.py), prefix caching off and on; one per
    setting for the whole session (an engine takes ~25 s to start), shared by the vLLM test files."""
    from vllm_env import save_checkpoint, start_engine, stop_engine

    path = tmp_path_factory.mktemp("vllm-ckpt")
    model = save_checkpoint(path, seed=0)
    env = start_engine(path, request.param)
    env["model"] = model
    yield env
    stop_engine(env)
