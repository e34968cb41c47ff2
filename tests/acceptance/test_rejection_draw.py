"""The token at a lenient rejection: drawn from pi_t (the paper), from pi_t without the rejected draft token, or from
the residual max(0, pi_t - q) with q the draft's own policy (speculative sampling: exact at l = 1 for any q).

Every sample's draft is one token y drawn from an old policy q and stored with log q(y), as a cached
response is. The first response token is then counted over 24,000 keyed samples and compared by a
chi-square test with its float64 law:

    P(z) = sum_y q(y) [ a(y) 1[z = y] + (1 - a(y)) r_y(z) ],   a(y) = min(1, l p(y) / q(y)),

with r_y = p for the paper's draw, r_y = p without y, renormalised, for "without-draft", and r_y = max(0, p - q),
renormalised, for "residual" (P = p at l = 1). With two tokens and l = 1 "without-draft" is exact as well: the residual
then sits on the one token that is not y. A float64 enumeration over whole responses checks the residual draw where
positions depend on their prefix.
"""

import itertools
import math

import pytest
import torch
from _stats import assert_fits

from spec_rl.acceptance.mode import RolloutMode
from spec_rl.acceptance.rules import Exact, Lenient
from spec_rl.acceptance.scores import DraftScores
from spec_rl.backends.base import BackendStats, Scored
from spec_rl.backends.reprefill import ReprefillBackend
from spec_rl.drafts.cache import CacheKey, RolloutCache
from spec_rl.rollout.speculative import RolloutRequest, SpeculativeRollout
from spec_rl.sampling.distribution import SamplingSettings, residual_logprobs

PROMPT, N = 9, 24000


class FixedPolicy(ReprefillBackend):
    """pi_t(. | anything) = ``probs`` (the prompt token has probability 0); one-token responses only."""

    def __init__(self, probs: torch.Tensor):
        self.stats = BackendStats()
        self.probs = probs

    @property
    def device(self):
        return torch.device("cpu")

    def score(self, prompts, drafts, logprobs=None):
        width = max(len(d) for d in drafts)
        logp = torch.full((10,), -math.inf, dtype=torch.float64)
        logp[: len(self.probs)] = self.probs.log()
        return Scored(DraftScores(logits=logp.float().expand(len(drafts), width, 10).clone()), prompts, drafts)

    def generate(self, jobs, settings, seed):
        assert not jobs, "one-token drafts are reused or rejected at n = 0: nothing is generated"
        return []


class FixedOldPolicy:
    """q(. | anything) = ``probs``: the weights of every draft's step, as PolicyVersions gives them."""

    def __init__(self, probs: torch.Tensor):
        self.probs = probs

    def __contains__(self, version):
        return version == 0

    def next_token_logits(self, versions, contexts):
        logq = torch.full((10,), -math.inf, dtype=torch.float64)
        logq[: len(self.probs)] = self.probs.log()
        return logq.float().expand(len(contexts), 10).clone()


def law(p: torch.Tensor, q: torch.Tensor, lenience: float, draw: str) -> torch.Tensor:
    """Float64 law of the first response token (module docstring)."""
    out = torch.zeros_like(p)
    for y in range(len(p)):
        if q[y] == 0:
            continue
        a = min(1.0, lenience * float(p[y]) / float(q[y]))
        redraw = p.clone()
        if draw == "without-draft" and p[y] < 1:
            redraw[y] = 0.0
            redraw /= redraw.sum()
        if draw == "residual":
            redraw = residual_logprobs(p.log(), q.log()).exp()
        out += q[y] * (1 - a) * redraw
        out[y] += q[y] * a
    return out


def first_tokens(p: torch.Tensor, q: torch.Tensor, lenience: float, draw: str, seed: int) -> tuple[torch.Tensor, list]:
    """Counts of the first response token over N samples whose drafts are drawn from q; and (draft, token) pairs."""
    settings = SamplingSettings(max_tokens=1)
    drafts = torch.multinomial(q, N, replacement=True, generator=torch.Generator().manual_seed(seed)).tolist()
    cache = RolloutCache()
    requests = [RolloutRequest([PROMPT], slot=s) for s in range(N)]
    for r, y in zip(requests, drafts):
        cache.store(CacheKey.make(r.prompt_ids, r.slot), [y], [math.log(float(q[y]))], "length", 0, settings)
    mode = RolloutMode(Lenient(lenience, draw), tail=0)
    rollout = SpeculativeRollout(
        FixedPolicy(p),
        cache,
        settings,
        eos_ids=[len(p) - 1],
        max_model_len=8,
        seed=seed,
        mode=mode,
        old_policies=FixedOldPolicy(q),
    )
    result = rollout.run(requests, step=1)
    tokens = [r[0] for r in result.response_ids]
    return torch.bincount(torch.tensor(tokens), minlength=len(p)).double(), list(zip(drafts, tokens))


@pytest.mark.parametrize("draw", ["policy", "without-draft"])
@pytest.mark.parametrize("lenience", [1.0, math.exp(0.5)])
def test_first_token_follows_its_float64_law(draw, lenience):
    p = torch.tensor([0.45, 0.25, 0.2, 0.1], dtype=torch.float64)
    q = torch.tensor([0.1, 0.5, 0.15, 0.25], dtype=torch.float64)
    counts, _ = first_tokens(p, q, lenience, draw, seed=11)
    assert_fits(counts, law(p, q, lenience, draw))


def test_the_residual_draw_at_l1_samples_the_policy_whatever_the_drafts():
    p = torch.tensor([0.45, 0.25, 0.2, 0.1], dtype=torch.float64)
    for q in (torch.tensor([0.1, 0.5, 0.15, 0.25]), torch.tensor([0.05, 0.05, 0.1, 0.8]), p):
        q = q.double()
        assert torch.allclose(law(p, q, 1.0, "residual"), p, atol=1e-15)
        counts, pairs = first_tokens(p, q, 1.0, "residual", seed=7)
        assert_fits(counts, p)
        if not torch.equal(q, p):  # a rejected token is never redrawn: the residual is 0 where q >= p
            assert all(float(q[z]) < float(p[z]) for y, z in pairs if z != y)


def _sequence_probs(table: torch.Tensor, seq: tuple) -> float:
    """Probability of ``seq`` under an autoregressive table [V, V, V] (next-token law after each prefix)."""
    prob, prefix = 1.0, ()
    for token in seq:
        prob *= float(_next(table, prefix)[token])
        prefix += (token,)
    return prob


def _next(table: torch.Tensor, prefix: tuple) -> torch.Tensor:
    """Next-token law after ``prefix`` (length < 3) from a [V, V, V] table: row by the last two tokens."""
    a, b = ((0, 0) + prefix)[-2:]
    return table[a, b]


def test_residual_draw_preserves_the_policy_over_whole_responses_in_float64():
    """Every draft y ~ q of length 3 over 3 tokens is verified at l = 1 by the rule's own test and, at its rejection
    index n, continued with the residual (the product's residual_logprobs) then with p: the output law, summed over
    drafts and acceptance outcomes in float64, is p's for every response, for context-dependent p and q. The paper's
    draw, enumerated the same way, is not."""
    gen = torch.Generator().manual_seed(3)
    vocab, length = 3, 3
    p = torch.rand((vocab, vocab, vocab), generator=gen, dtype=torch.float64) + 0.05
    q = torch.rand((vocab, vocab, vocab), generator=gen, dtype=torch.float64) ** 3 + 0.01
    p, q = p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)
    rule = Lenient(1.0, "residual")
    seqs = list(itertools.product(range(vocab), repeat=length))

    def output_law(redraw) -> dict:
        out = dict.fromkeys(seqs, 0.0)
        for y in seqs:
            prob_y, stay = _sequence_probs(q, y), 1.0  # stay: every token before i accepted
            for i in range(length + 1):
                if i == length:
                    out[y] += prob_y * stay
                    break
                pn, qn = _next(p, y[:i]), _next(q, y[:i])
                # the rule's test accepts y_i iff u <= p/q: with u uniform on (0, 1], probability min(1, p/q)
                u = torch.tensor([[min(1.0, float(pn[y[i]] / qn[y[i]]))]], dtype=torch.float64)
                lp_new, lp_old = pn[y[i]].log().view(1, 1), qn[y[i]].log().view(1, 1)
                assert bool(rule.test(lp_new, lp_old, u * (1 - 1e-9)))  # accepted up to u = p/q, not beyond
                assert float(u) == 1.0 or not bool(rule.test(lp_new, lp_old, u * (1 + 1e-9)))
                accept = float(u)
                for z in range(vocab):  # rejected at i: z from the redraw, the rest from p
                    for rest in itertools.product(range(vocab), repeat=length - i - 1):
                        tail_prob = _sequence_probs(p, y[:i] + (z,) + rest) / _sequence_probs(p, y[:i] + (z,))
                        out[y[:i] + (z,) + rest] += prob_y * stay * (1 - accept) * float(redraw(pn, qn)[z]) * tail_prob
                stay *= accept
        return out

    residual = output_law(lambda pn, qn: residual_logprobs(pn.log(), qn.log()).exp())
    for s in seqs:
        assert residual[s] == pytest.approx(_sequence_probs(p, s), abs=1e-13)
    assert sum(residual.values()) == pytest.approx(1.0, abs=1e-13)
    paper = output_law(lambda pn, qn: pn)
    assert max(abs(paper[s] - _sequence_probs(p, s)) for s in seqs) > 0.01


def test_without_draft_is_exact_with_two_tokens_at_l1_and_the_paper_is_not():
    p = torch.tensor([0.3, 0.7], dtype=torch.float64)
    q = torch.tensor([0.6, 0.4], dtype=torch.float64)
    assert torch.allclose(law(p, q, 1.0, "without-draft"), p)
    counts, _ = first_tokens(p, q, 1.0, "without-draft", seed=5)
    assert_fits(counts, p)
    paper, _ = first_tokens(p, q, 1.0, "policy", seed=5)
    assert_fits(paper, torch.tensor([0.39, 0.61], dtype=torch.float64))  # 0.3 kept + 0.3 rejected x 0.3 redrawn
    assert float(paper[0]) / N > 0.37  # the old token is over-sampled by ~0.09 under the paper's draw


def test_a_rejected_draft_token_is_never_drawn_again():
    p = torch.tensor([0.45, 0.25, 0.2, 0.1], dtype=torch.float64)
    q = torch.tensor([0.1, 0.5, 0.15, 0.25], dtype=torch.float64)
    _, pairs = first_tokens(p, q, 1.0, "without-draft", seed=2)
    rejected = [(y, z) for y, z in pairs if z != y]
    assert len(rejected) > 0.2 * N  # token 1 (q 0.5, p 0.25) is rejected half the time
    # a kept draft token is the only way z == y: its rate is exactly a(y) (no redraw of y after a rejection)
    kept_1 = sum(1 for y, z in pairs if y == 1 and z == 1) / sum(1 for y, _ in pairs if y == 1)
    assert abs(kept_1 - 0.5) < 0.02


def test_bad_rejection_draw_is_refused():
    import numpy as np

    def rollout(mode):
        return SpeculativeRollout(
            FixedPolicy(torch.tensor([0.5, 0.5])), RolloutCache(), SamplingSettings(), [1], 8, mode=mode
        )

    for bad in ("resid", None, 1, b"policy", ["policy"], np.array(["policy"])):  # an array compares element-wise
        with pytest.raises(ValueError, match="rejection_draw must be one of"):
            Lenient(rejection_draw=bad)
    # no lenient rejection to draw at: the ablation and exact acceptance have no such field
    with pytest.raises(TypeError, match="rejection_draw"):
        Exact(rejection_draw="without-draft")
    # below l = 1 the residual keeps the rejected token (at l = 0 every draft token is "rejected")
    for lenience in (0.0, 0.5, np.float32(0.5)):
        with pytest.raises(ValueError, match=f"rejection_draw 'without-draft' needs lenience >= 1, got {lenience:g}"):
            Lenient(lenience, "without-draft")
        with pytest.raises(ValueError, match="needs lenience >= 1"):
            RolloutMode.parse(f"l={lenience}-excl")
    for lenience in (-1.0, False):  # a bad lenience is named as such, not as a draw problem
        with pytest.raises((ValueError, TypeError), match="^lenience must be"):
            Lenient(lenience, "without-draft")
    # the default lenience (e^0.5) and l = 1 take the draw
    for rule in (Lenient(rejection_draw="without-draft"), Lenient(1.0, "without-draft")):
        assert rollout(RolloutMode(rule)).mode.rule.rejection_draw == "without-draft"
