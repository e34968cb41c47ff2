"""pytest-benchmark micro-benchmarks of verification.

    pytest benchmarks/bench_verify.py                 # CPU: torch reference only, small shapes
    pytest benchmarks/bench_verify.py --benchmark-json out.json
    python benchmarks/bench_verify.py [pytest args]   # the same, e.g. --help

On a CUDA machine the shapes grow and the Triton kernels are timed too
(``torch.cuda.synchronize`` inside each timed call, ``_harness.synced``).
Kernels are never timed under the Triton interpreter: those numbers say
nothing about performance. For the comparison table against the floors,
Liger-Kernel and Cut Cross-Entropy use ``benchmarks/gpu_suite.py``.
benchmarks/conftest.py adds the harness provenance to the JSON's ``machine_info``.
"""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch

pytest.importorskip("pytest_benchmark")

from _harness import random_lm_head, run_pytest_file, synced  # benchmarks/ is on sys.path when a script here runs

from spec_rl.acceptance.dispatch import VerifyOptions
from spec_rl.acceptance.reference import reference_verify
from spec_rl.acceptance.scores import DraftScores
from spec_rl.sampling.philox import philox_uniform

CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")
# (B, R, V, d): small on CPU, realistic on GPU (Qwen3 vocabulary).
SHAPE = (32, 512, 151936, 2048) if CUDA else (4, 64, 4096, 256)
DTYPE = torch.bfloat16 if CUDA else torch.float32
SEED, LOG_LENIENCE = 1, 0.5
OPTIONS = VerifyOptions(lenience=math.exp(LOG_LENIENCE))


@pytest.fixture(scope="module")
def inputs():
    bsz, max_len, vocab, d = SHAPE
    gen = torch.Generator(device=DEV).manual_seed(0)
    hidden = torch.randn(bsz, max_len, d, device=DEV, generator=gen).to(DTYPE)
    weight = random_lm_head(vocab, d, DTYPE, DEV, gen)
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


def _drafts(x):
    return x["ids"], x["old"], x["lengths"], x["uids"]


def test_bench_reference_from_logits(benchmark, inputs):
    scores = DraftScores(logits=inputs["logits"])
    benchmark(synced(reference_verify, DEV), *_drafts(inputs), scores, seed=SEED, options=OPTIONS)


def test_bench_reference_from_hidden(benchmark, inputs):
    scores = DraftScores(hidden_states=inputs["hidden"], lm_head_weight=inputs["weight"])
    benchmark(synced(reference_verify, DEV), *_drafts(inputs), scores, seed=SEED, options=OPTIONS)


def test_bench_reference_philox(benchmark, inputs):
    idx = torch.arange(inputs["ids"].shape[1], device=DEV).unsqueeze(0)
    benchmark(synced(philox_uniform, DEV), SEED, inputs["uids"].unsqueeze(1), idx)


def test_bench_triton_from_logits(benchmark, inputs):
    K = _kernels()
    scores = DraftScores(logits=inputs["logits"])
    benchmark(
        synced(K.verify_padded, DEV), *_drafts(inputs), scores, seed=SEED, log_lenience=LOG_LENIENCE, temperature=1.0
    )


def test_bench_triton_fused_lm_head(benchmark, inputs):
    K = _kernels()
    scores = DraftScores(hidden_states=inputs["hidden"], lm_head_weight=inputs["weight"])
    benchmark(
        synced(K.verify_padded, DEV), *_drafts(inputs), scores, seed=SEED, log_lenience=LOG_LENIENCE, temperature=1.0
    )


def test_bench_triton_philox(benchmark, inputs):
    K = _kernels()
    idx = torch.arange(inputs["ids"].shape[1], device=DEV).unsqueeze(0)
    benchmark(synced(K.philox_uniform_triton, DEV), SEED, inputs["uids"].unsqueeze(1), idx)


if __name__ == "__main__":
    sys.exit(run_pytest_file(__file__))
