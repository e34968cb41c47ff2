"""pytest-benchmark micro-benchmarks of verification at a real vocabulary (benchmarks/RESULTS.md "Verification at a
real vocabulary"): SmolLM2's V = 49152, d = 576, B = 8 drafts x R = 48 tokens, float32, against the plain torch
computation of the same result (log_softmax over V, gather, the same Philox uniforms, the test, the first rejection;
from hidden states the [N, V] matmul first), on whatever device runs it (``_harness.synced`` waits for the device
inside each timed call); ``test_real_vocab_decisions_agree`` checks that both decide alike.

    pytest benchmarks/bench_verify.py -k real_vocab --benchmark-group-by=group [--benchmark-json out.json]

benchmarks/conftest.py adds the harness provenance to the JSON's ``machine_info``. The kernels against their floors
and the fused-loss libraries on a GPU: ``benchmarks/gpu_suite.py``.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("pytest_benchmark")

from _harness import random_lm_head, synced  # benchmarks/ is on sys.path when a script here runs

from spec_rl.acceptance.dispatch import VerifyOptions, verify_hidden, verify_logits
from spec_rl.acceptance.rules import Lenient
from spec_rl.sampling.philox import STREAM_ACCEPT, philox_uniform

CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")
SEED, LOG_LENIENCE = 1, 0.5
MODE = Lenient(math.exp(LOG_LENIENCE))


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
    options = VerifyOptions(mode=MODE, backend="reference" if not CUDA else "auto")
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
