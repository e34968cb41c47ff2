"""pytest-benchmark micro-benchmarks of verification.

    pytest benchmarks/bench_verify.py                 # CPU: torch reference only, small shapes
    pytest benchmarks/bench_verify.py --benchmark-json out.json
    python benchmarks/bench_verify.py [pytest args]   # the same, e.g. --help

On a CUDA machine the shapes grow and the Triton kernels are timed too
(``torch.cuda.synchronize`` inside each timed call, ``_harness.synced``).
Kernels are never timed under the Triton interpreter: those numbers say
nothing about performance. For the comparison table against the floors,
Liger-Kernel and Cut Cross-Entropy use ``benchmarks/gpu_suite.py``.

The group ``real-vocab`` times verification at a real model's vocabulary (SmolLM2's V = 49152, d = 576, B = 8, R = 48)
against the plain torch computation of the same result (log_softmax, gather, the same Philox uniforms, the test, the
first rejection; from hidden states: the matmul first), on whatever device runs it:

    pytest benchmarks/bench_verify.py -k real_vocab --benchmark-group-by=group

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

from spec_rl.acceptance.dispatch import VerifyOptions, verify_hidden, verify_logits
from spec_rl.acceptance.reference import reference_verify
from spec_rl.acceptance.rules import Lenient
from spec_rl.acceptance.scores import DraftScores
from spec_rl.sampling.philox import STREAM_ACCEPT, philox_uniform

CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")
# (B, R, V, d): small on CPU, realistic on GPU (Qwen3 vocabulary).
SHAPE = (32, 512, 151936, 2048) if CUDA else (4, 64, 4096, 256)
DTYPE = torch.bfloat16 if CUDA else torch.float32
SEED, LOG_LENIENCE = 1, 0.5
OPTIONS = VerifyOptions(mode=Lenient(math.exp(LOG_LENIENCE)))


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


TRITON = VerifyOptions(mode=OPTIONS.mode, backend="triton")


def test_bench_triton_from_logits(benchmark, inputs):
    _kernels()
    x = inputs
    benchmark(synced(verify_logits, DEV), *_drafts(x)[:2], x["logits"], x["lengths"], seed=SEED, options=TRITON)


def test_bench_triton_fused_lm_head(benchmark, inputs):
    _kernels()
    x = inputs
    benchmark(
        synced(verify_hidden, DEV),
        x["ids"],
        x["old"],
        x["hidden"],
        x["weight"],
        x["lengths"],
        seed=SEED,
        options=TRITON,
    )


REAL_VOCAB = (8, 48, 49152, 576)


@pytest.fixture(scope="module")
def real_vocab():
    bsz, max_len, vocab, d = REAL_VOCAB
    gen = torch.Generator(device=DEV).manual_seed(1)
    hidden = torch.randn(bsz, max_len, d, device=DEV, generator=gen)
    weight = random_lm_head(vocab, d, torch.float32, DEV, gen)
    logits = hidden @ weight.T
    ids = torch.distributions.Categorical(logits=logits).sample()  # drafts the policy could have sampled
    sampled = torch.log_softmax(logits, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    old = sampled - 0.3 * torch.rand(sampled.shape, device=DEV, generator=gen)
    lengths = torch.randint(max_len // 2, max_len + 1, (bsz,), device=DEV, generator=gen)
    return dict(hidden=hidden, weight=weight, logits=logits, ids=ids, old=old, lengths=lengths)


def plain_torch_verify(logits, x):
    """The same decisions in plain torch: log_softmax over V, gather, Philox uniforms, test, first rejection."""
    lp = torch.log_softmax(logits.float(), -1).gather(-1, x["ids"].unsqueeze(-1)).squeeze(-1)
    max_len = lp.shape[1]
    uids = torch.arange(lp.shape[0], device=lp.device)
    u = philox_uniform(SEED, uids.unsqueeze(1), torch.arange(max_len, device=lp.device).unsqueeze(0), STREAM_ACCEPT)
    valid = torch.arange(max_len, device=lp.device) < x["lengths"].unsqueeze(1)
    accept = (torch.log(u.double()) <= lp.double() - x["old"].double() + LOG_LENIENCE) | ~valid
    n = torch.where(accept, max_len, torch.arange(max_len, device=lp.device)).amin(1)
    return lp, torch.minimum(n, x["lengths"])


def _ours(x, **scores):
    ids, old, lengths = x["ids"], x["old"], x["lengths"]
    options = VerifyOptions(mode=OPTIONS.mode, backend="reference" if not CUDA else "auto")
    if "hidden" in scores:
        return verify_hidden(ids, old, scores["hidden"], x["weight"], lengths, seed=SEED, options=options)
    return verify_logits(ids, old, scores["logits"], lengths, seed=SEED, options=options)


def test_real_vocab_decisions_agree(real_vocab):
    x = real_vocab
    lp, n = plain_torch_verify(x["logits"], x)
    for ours in (_ours(x, logits=x["logits"]), _ours(x, hidden=x["hidden"])):
        assert torch.equal(ours.accepted_len, n)
        valid = torch.arange(lp.shape[1], device=DEV) < x["lengths"].unsqueeze(1)
        torch.testing.assert_close(ours.new_logprobs[valid], lp[valid], atol=2e-4, rtol=0)


@pytest.mark.benchmark(group="real-vocab: from logits")
def test_bench_real_vocab_ours_from_logits(benchmark, real_vocab):
    benchmark(synced(_ours, DEV), real_vocab, logits=real_vocab["logits"])


@pytest.mark.benchmark(group="real-vocab: from logits")
def test_bench_real_vocab_plain_torch_from_logits(benchmark, real_vocab):
    benchmark(synced(plain_torch_verify, DEV), real_vocab["logits"], real_vocab)


@pytest.mark.benchmark(group="real-vocab: from hidden states")
def test_bench_real_vocab_ours_from_hidden(benchmark, real_vocab):
    benchmark(synced(_ours, DEV), real_vocab, hidden=real_vocab["hidden"])


@pytest.mark.benchmark(group="real-vocab: from hidden states")
def test_bench_real_vocab_plain_torch_from_hidden(benchmark, real_vocab):
    x = real_vocab
    benchmark(synced(lambda: plain_torch_verify(x["hidden"] @ x["weight"].T, x), DEV))


if __name__ == "__main__":
    sys.exit(run_pytest_file(__file__))
