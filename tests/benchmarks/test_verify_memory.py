"""Verification from hidden states + LM head at a real vocabulary keeps its extra memory <= 1/4 of the [N, V] float32
logits it never forms (measured: peak resident memory, Linux)."""

import math
import sys

import pytest
import torch
from repo_paths import BENCHMARKS

from spec_rl.acceptance.dispatch import VerifyOptions, verify_hidden
from spec_rl.acceptance.rules import Lenient

sys.path.insert(0, str(BENCHMARKS))

from _harness import peak_extra_rss_mb  # noqa: E402

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")


@pytest.mark.parametrize(("bsz", "max_len"), [(8, 48), (2, 7)])
def test_verify_hidden_extra_memory_is_at_most_a_quarter_of_the_logits(bsz, max_len):
    vocab, d = 49152, 576
    gen = torch.Generator().manual_seed(bsz)
    hidden = torch.randn(bsz, max_len, d, generator=gen)
    weight = torch.randn(vocab, d, generator=gen) / math.sqrt(d)
    ids = torch.randint(0, vocab, (bsz, max_len), generator=gen)
    old = -torch.rand(bsz, max_len, generator=gen) * 5
    options = VerifyOptions(mode=Lenient(math.exp(0.5)), backend="reference")
    logits_mb = bsz * max_len * vocab * 4 / 2**20
    verify_hidden(ids, old, hidden, weight, seed=3, options=options)  # warm-up: one-time allocations
    extra = peak_extra_rss_mb(lambda: verify_hidden(ids, old, hidden, weight, seed=3, options=options))
    print(f"verify_hidden [{bsz}, {max_len}] x V={vocab}: {extra:.1f} MiB extra, logits {logits_mb:.1f} MiB")
    assert extra <= logits_mb / 4 + 1.0, f"{extra:.1f} MiB extra for {logits_mb:.1f} MiB of logits"  # 1 MiB: small
