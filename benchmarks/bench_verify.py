"""pytest-benchmark micro-benchmarks of verification.

    pytest benchmarks/bench_verify.py                 # CPU: torch reference only, small shapes
    pytest benchmarks/bench_verify.py --benchmark-json out.json

On a CUDA machine the shapes grow and the Triton kernels are timed too
(``torch.cuda.synchronize`` inside each timed call). Kernels are never timed
under the Triton interpreter: those numbers say nothing about performance.
For the issue-#3 comparison table (floors, Liger, CCE) use
``benchmarks/gpu_suite.py``.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("pytest_benchmark")

from spec_rl.philox import philox_uniform
from spec_rl.acceptance import reference_verify

CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")
# (B, R, V, d): small on CPU, realistic on GPU (Qwen3 vocabulary).
SHAPE = (32, 512, 151936, 2048) if CUDA else (4, 64, 4096, 256)
DTYPE = torch.bfloat16 if CUDA else torch.float32


def _sync():
    if CUDA:
        torch.cuda.synchronize()


@pytest.fixture(scope="module")
def inputs():
    bsz, max_len, vocab, d = SHAPE
    gen = torch.Generator(device=DEV).manual_seed(0)
    hidden = torch.randn(bsz, max_len, d, device=DEV, generator=gen).to(DTYPE)
    weight = (torch.randn(vocab, d, device=DEV, generator=gen) * (2.5 / d**0.5)).to(DTYPE)
    ids = torch.randint(0, vocab, (bsz, max_len), device=DEV, generator=gen)
    old = -torch.rand(bsz, max_len, device=DEV, generator=gen) * 4
    lengths = torch.randint(max_len // 2, max_len + 1, (bsz,), device=DEV, generator=gen)
    uids = torch.arange(bsz, device=DEV, dtype=torch.int64)
    logits = hidden @ weight.T
    return dict(hidden=hidden, weight=weight, ids=ids, old=old, lengths=lengths, uids=uids, logits=logits)


def _kernels():
    if not CUDA or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        pytest.skip("Triton kernels are benchmarked on CUDA only (interpreter timings are meaningless)")
    pytest.importorskip("triton")
    import spec_rl.kernels as K

    return K


def _common(x):
    return dict(seed=1, uids=x["uids"], log_lenience=0.5)


def test_bench_reference_from_logits(benchmark, inputs):
    x = inputs

    def run():
        out = reference_verify(x["ids"], x["old"], x["lengths"], logits=x["logits"], **_common(x))
        _sync()
        return out

    benchmark(run)


def test_bench_reference_from_hidden(benchmark, inputs):
    x = inputs

    def run():
        out = reference_verify(
            x["ids"], x["old"], x["lengths"], hidden_states=x["hidden"], lm_head_weight=x["weight"], **_common(x)
        )
        _sync()
        return out

    benchmark(run)


def test_bench_reference_philox(benchmark, inputs):
    max_len = inputs["ids"].shape[1]
    idx = torch.arange(max_len, device=DEV).unsqueeze(0)

    def run():
        u = philox_uniform(1, inputs["uids"].unsqueeze(1), idx)
        _sync()
        return u

    benchmark(run)


def test_bench_triton_from_logits(benchmark, inputs):
    K = _kernels()
    x = inputs

    def run():
        return K.verify_triton(x["ids"], x["old"], x["lengths"], logits=x["logits"], **_common(x))

    benchmark(run)


def test_bench_triton_fused_lm_head(benchmark, inputs):
    K = _kernels()
    x = inputs

    def run():
        return K.verify_triton(
            x["ids"], x["old"], x["lengths"], hidden_states=x["hidden"], lm_head_weight=x["weight"], **_common(x)
        )

    benchmark(run)


def test_bench_triton_philox(benchmark, inputs):
    K = _kernels()
    max_len = inputs["ids"].shape[1]
    idx = torch.arange(max_len, device=DEV).unsqueeze(0)

    def run():
        u = K.philox_uniform_triton(1, inputs["uids"].unsqueeze(1), idx)
        _sync()
        return u

    benchmark(run)
