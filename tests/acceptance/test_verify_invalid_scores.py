"""Scores without a valid distribution get one ValueError naming the positions, on every backend;
verification and sampling never build an autograd graph."""

import re
from types import SimpleNamespace

import pytest
import torch

from spec_rl.acceptance.dispatch import VerifyOptions, verify_hidden, verify_logits
from spec_rl.acceptance.rules import Lenient
from spec_rl.acceptance.scores import DraftScores
from spec_rl.sampling.distribution import SamplingSettings, keyed_sample

kernels = pytest.importorskip("spec_rl.kernels")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = ["reference"] + (["triton"] if kernels.is_available(DEVICE) else [])
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # interpreter: overflow to inf is intended
NO_DISTRIBUTION = "NaN, +inf, or every logit -inf"
B, R, V, D = 3, 4, 40, 8


def _drafts():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, (B, R), generator=g)
    old = -torch.rand(B, R, generator=g) - 0.1
    hidden = torch.randn(B, R, D, generator=g)
    weight = torch.randn(V, D, generator=g) * 0.3
    return ids, old, hidden, weight


def _bad_scores(case: str) -> dict:
    """Scores that are invalid at (sample 1, token 2) only (V16, V81, V82 and NaN)."""
    _, _, hidden, weight = _drafts()
    if case in ("all -inf logits", "nan logit", "+inf logit"):
        logits = hidden @ weight.T
        value = {"all -inf logits": float("-inf"), "nan logit": float("nan"), "+inf logit": float("inf")}[case]
        if case == "all -inf logits":
            logits[1, 2, :] = value
        else:
            logits[1, 2, 7] = value
        return dict(logits=logits)
    if case == "finite hidden, logits overflow":
        hidden[1, 2] = 1e38  # finite float32, but the dot product overflows to +inf
        return dict(hidden_states=hidden, lm_head_weight=weight.abs() + 1.0)
    if case == "-inf hidden, positive head":  # every logit -inf
        hidden[1, 2] = float("-inf")
        return dict(hidden_states=hidden, lm_head_weight=weight.abs() + 0.1)
    hidden[1, 2] = float("-inf")  # "-inf hidden, mixed head": -inf * w of both signs -> +-inf logits, NaN softmax
    return dict(hidden_states=hidden, lm_head_weight=weight)


CASES = [
    "all -inf logits",
    "nan logit",
    "+inf logit",
    "finite hidden, logits overflow",
    "-inf hidden, positive head",
    "-inf hidden, mixed head",
]


def _on(device, scores):
    return {k: v.to(device) for k, v in scores.items()}


def _verify(ids, old, scores: dict, lengths=None, seed=0, **options):
    """verify_logits or verify_hidden, whichever takes ``scores`` (a dict as :func:`_bad_scores` returns)."""
    options = VerifyOptions(**options)
    if "logits" in scores:
        return verify_logits(ids, old, scores["logits"], lengths, seed=seed, options=options)
    head = SimpleNamespace(weight=scores["lm_head_weight"], bias=scores.get("lm_head_bias"))
    return verify_hidden(ids, old, scores["hidden_states"], head, lengths, seed=seed, options=options)


@pytest.mark.parametrize("mode", ["spec", "random"])
@pytest.mark.parametrize("case", CASES)
def test_invalid_scores_raise_the_same_error_on_every_backend(case, mode):
    ids, old, _, _ = _drafts()
    messages = []
    for backend in BACKENDS:
        device = "cpu" if backend == "reference" else DEVICE
        with pytest.raises(ValueError) as info:
            _verify(ids.to(device), old.to(device), _on(device, _bad_scores(case)), seed=3, backend=backend, mode=mode)
        msg = str(info.value)
        assert NO_DISTRIBUTION in msg and "(sample, token): (1, 2)" in msg and "1 scored position" in msg, msg
        assert msg.startswith("logits"), msg
        messages.append(msg)
    assert len(set(messages)) == 1, messages  # one behaviour, one message


@pytest.mark.parametrize("backend", BACKENDS)
def test_invalid_scores_at_padding_are_ignored(backend):
    ids, old, _, _ = _drafts()
    device = "cpu" if backend == "reference" else DEVICE
    for case in CASES:
        scores = _on(device, _bad_scores(case))
        res = _verify(ids.to(device), old.to(device), scores, torch.tensor([4, 2, 4]).to(device), backend=backend)
        assert not torch.isnan(res.new_logprobs).any()


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_impossible_draft_token_is_still_a_rejection(backend):
    ids, old, hidden, weight = _drafts()
    device = "cpu" if backend == "reference" else DEVICE
    logits = hidden @ weight.T
    logits[1, 2, ids[1, 2]] = float("-inf")  # the rest of the row is finite: a valid distribution
    res = verify_logits(
        ids.to(device), old.to(device), logits.to(device), options=VerifyOptions(mode=Lenient(1e6), backend=backend)
    )
    assert res.new_logprobs[1, 2].item() == float("-inf") and int(res.accepted_len[1]) == 2


def test_many_bad_positions_are_listed_with_their_count():
    ids, old, hidden, weight = _drafts()
    logits = hidden @ weight.T
    logits[:, :, :] = float("-inf")
    with pytest.raises(ValueError, match=r"12 scored positions \(sample, token\): \(0, 0\), \(0, 1\).*, \.\.\."):
        verify_logits(ids, old, logits, options=VerifyOptions(backend="reference"))


@pytest.mark.skipif("triton" not in BACKENDS, reason="triton kernels not runnable here")
def test_tagged_kernel_rows_are_named_by_sample_and_token():
    ids, old, hidden, weight = _drafts()
    logits = (hidden @ weight.T).reshape(B * R, V).to(DEVICE)
    logits[6] = float("-inf")  # sample 1, token 2
    tags = torch.arange(B * R, device=DEVICE)
    rows = kernels.DraftRows(
        ids.reshape(-1).to(DEVICE),
        old.reshape(-1).to(DEVICE),
        torch.full((B,), R, device=DEVICE),
        torch.arange(B, device=DEVICE),
        (tags // R).to(torch.int32),
        (tags % R).to(torch.int32),
        1,
        0.0,
        1.0,
        0,
    )
    with pytest.raises(kernels.InvalidScores, match=re.escape("first (sample, token): [[1, 2]]")) as bad:
        kernels.verify_logits(logits, rows)
    assert bad.value.positions == [[1, 2]] and bad.value.total == 1
    h = hidden.reshape(B * R, D).clone().to(DEVICE)
    h[6] = float("-inf")
    with pytest.raises(kernels.InvalidScores) as bad:
        kernels.verify_hidden(h, weight.abs().to(DEVICE) + 0.1, None, rows)
    assert bad.value.positions == [[1, 2]]


# ------------------------------------------------------------------ no autograd graph (V80)
def _count_saved_tensors(fn):
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        out = fn()
    return out, saved


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("source", ["hidden", "logits"])
def test_verify_builds_no_autograd_graph(backend, source):
    ids, old, hidden, weight = _drafts()
    device = "cpu" if backend == "reference" else DEVICE
    head = torch.nn.Linear(D, V).to(device)  # a Parameter with requires_grad=True, as a policy's LM head
    h = hidden.to(device).requires_grad_(True)  # hidden states of a forward that kept its graph
    options = VerifyOptions(backend=backend)
    if source == "hidden":
        run = lambda: verify_hidden(ids.to(device), old.to(device), h, head, options=options)  # noqa: E731
    else:
        logits = head(h)
        run = lambda: verify_logits(ids.to(device), old.to(device), logits, options=options)  # noqa: E731
    res, saved = _count_saved_tensors(run)
    assert not res.new_logprobs.requires_grad and res.new_logprobs.grad_fn is None
    assert saved == []  # nothing kept for a backward pass: no extra memory held by a graph


@pytest.mark.skipif(not torch.cuda.is_available(), reason="peak memory is measured on CUDA only")
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_verify_keeps_no_graph_memory_on_cuda(backend):
    # V80 at the size it was found (N = 2048 draft tokens, V = 16384): a graph over the LM head held
    # about 1.75x the full logits after verify returned.
    n, vocab, d = 2048, 16384, 256
    head = torch.nn.Linear(d, vocab, bias=False).cuda()
    hidden = torch.randn(1, n, d, device="cuda")
    ids = torch.randint(0, vocab, (1, n), device="cuda")
    old = torch.full((1, n), -5.0, device="cuda")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    res = verify_hidden(ids, old, hidden, head, options=VerifyOptions(backend=backend))
    torch.cuda.synchronize()
    logits_bytes = n * vocab * 4
    held = torch.cuda.memory_allocated() - base
    assert held < 4 * n * 8 + (1 << 20), held  # the result (a few [n] tensors), nothing kept for backward
    if backend == "triton":  # the fused LM head never forms the logits: O(N) extra memory
        assert torch.cuda.max_memory_allocated() - base < logits_bytes // 8
    assert int(res.stats.draft_tokens) == n


def test_logits_at_and_keyed_sample_build_no_graph():
    _, _, hidden, _ = _drafts()
    head = torch.nn.Linear(D, V)
    scores = DraftScores(hidden_states=hidden.requires_grad_(True), lm_head_weight=head.weight, lm_head_bias=head.bias)
    (logits, saved) = _count_saved_tensors(lambda: scores.logits_at(torch.tensor([0, 1]), torch.tensor([2, 3])))
    assert not logits.requires_grad and saved == []
    ids, lps = keyed_sample(
        head(hidden[:, 0]), SamplingSettings(), 1, torch.arange(B), torch.zeros(B, dtype=torch.long)
    )
    assert not lps.requires_grad


# ------------------------------------------------------------------ sampling the token at n
@pytest.mark.parametrize("bad", [float("-inf"), float("nan")])
def test_sampling_a_row_without_distribution_is_a_clear_error(bad):
    logits = torch.randn(3, V)
    logits[1, :] = float("-inf")
    logits[1, 5] = bad  # all -inf, or NaN
    uids, pos = torch.tensor([10, 11, 12]), torch.tensor([4, 9, 2])
    expected = r"logits row 1 \(uid 11, position 9\) has no sampling distribution"
    with pytest.raises(ValueError, match=expected):
        keyed_sample(logits, SamplingSettings(), 0, uids, pos)
    with pytest.raises(ValueError, match=expected):
        keyed_sample(logits, SamplingSettings(), 0, uids, pos, exclude=torch.tensor([0, 5, 0]))
