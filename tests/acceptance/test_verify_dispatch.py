"""The verify functions' dispatch: the Triton backend gives the reference's decisions; auto stays on the reference
on CPU."""

import pytest
import torch

from spec_rl.acceptance.dispatch import VerifyOptions, verify_hidden, verify_logits
from spec_rl.acceptance.rules import Lenient
from spec_rl.sampling.distribution import SamplingSettings

kernels = pytest.importorskip("spec_rl.kernels")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not kernels.is_available(DEVICE), reason="triton kernels not runnable here")


def _case(seed=0, bsz=5, max_len=9, vocab=300, d=16):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(bsz, max_len, d, generator=g)
    weight = torch.randn(vocab, d, generator=g) * 0.5
    ids = torch.randint(0, vocab, (bsz, max_len), generator=g)
    lengths = torch.tensor([0, 1, max_len, 4, 7])[:bsz]
    logits = hidden @ weight.T
    old = (
        torch.log_softmax(logits / 0.8, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
        + torch.rand(bsz, max_len, generator=g) * 0.4
        - 0.3
    )
    old = old.clamp(max=0)
    return [t.to(DEVICE) for t in (hidden, weight, ids, lengths, logits, old)]


def _verify(source, ids, old, logits, hidden, weight, lengths, backend, seed, uids=None, **options):
    options = VerifyOptions(backend=backend, **options)
    if source == "logits":
        return verify_logits(ids, old, logits, lengths, seed=seed, uids=uids, options=options)
    return verify_hidden(ids, old, hidden, weight, lengths, seed=seed, uids=uids, options=options)


@pytest.mark.parametrize("source", ["logits", "hidden"])
def test_triton_backend_matches_reference(source):
    hidden, weight, ids, lengths, logits, old = _case()
    kw = dict(
        sampling=SamplingSettings(temperature=0.8),
        mode=Lenient(1.2),
        seed=77,
        uids=torch.arange(5, device=DEVICE) * 1000 + 3,
    )
    ref = _verify(source, ids, old, logits, hidden, weight, lengths, "reference", **kw)
    tri = _verify(source, ids, old, logits, hidden, weight, lengths, "triton", **kw)
    assert torch.equal(ref.accepted_len.cpu(), tri.accepted_len.cpu())
    assert torch.allclose(ref.new_logprobs.cpu(), tri.new_logprobs.cpu(), atol=1e-4)
    assert ref.stats.to_dict() == tri.stats.to_dict()


def test_triton_backend_raises_on_nan_and_on_top_k():
    hidden, weight, ids, lengths, logits, old = _case(seed=1)
    logits[2, 1, 5] = float("nan")
    top_k = SamplingSettings(top_k=5)
    with pytest.raises(ValueError, match="NaN"):
        verify_logits(ids, old, logits, lengths, options=VerifyOptions(backend="triton"))
    with pytest.raises(NotImplementedError):
        verify_logits(ids, old, logits.nan_to_num(), lengths, options=VerifyOptions(backend="triton", sampling=top_k))
    # auto falls back to the reference for top-k and still scans for NaN there.
    with pytest.raises(ValueError, match="NaN"):
        verify_logits(ids, old, logits, lengths, options=VerifyOptions(backend="auto", sampling=top_k))


@pytest.mark.parametrize("source", ["logits", "hidden"])
def test_triton_backend_random_reuse_matches_reference(source):
    # random reuse: the kernels only score; its rule decides n on the host.
    hidden, weight, ids, lengths, logits, old = _case(seed=2)
    kw = dict(sampling=SamplingSettings(temperature=0.8), mode="random", seed=9, return_accept_mask=True)
    ref = _verify(source, ids, old, logits, hidden, weight, lengths, "reference", **kw)
    tri = _verify(source, ids, old, logits, hidden, weight, lengths, "triton", **kw)
    assert torch.equal(ref.accepted_len.cpu(), tri.accepted_len.cpu())
    assert torch.equal(ref.accept_mask.cpu(), tri.accept_mask.cpu())
    assert torch.allclose(ref.new_logprobs.cpu(), tri.new_logprobs.cpu(), atol=1e-4)
    assert ref.stats.to_dict() == tri.stats.to_dict()


@pytest.mark.parametrize("source", ["logits", "hidden"])
def test_triton_backend_exact_rule_matches_reference(source):
    # exact: both backends test log u <= lp_new (old log-probs unread, l = 1).
    hidden, weight, ids, lengths, logits, old = _case(seed=3)
    kw = dict(mode="exact", seed=5, return_accept_mask=True)
    ref = _verify(source, ids, old, logits, hidden, weight, lengths, "reference", **kw)
    tri = _verify(source, ids, None, logits, hidden, weight, lengths, "triton", **kw)
    assert torch.equal(ref.accepted_len.cpu(), tri.accepted_len.cpu())
    assert torch.equal(ref.accept_mask.cpu(), tri.accept_mask.cpu())
    assert torch.allclose(ref.new_logprobs.cpu(), tri.new_logprobs.cpu(), atol=1e-4)
