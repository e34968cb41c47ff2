"""Behaviour log-probs of kept and drawn tokens (docs/design.md "Behaviour log-probs") and what a rollout correction
weighted by them estimates, by enumeration over a one-position float64 policy pair (docs/design.md "Rollout
correction")."""

import math

import pytest
import torch

from spec_rl.acceptance.rules import Coupled, Exact, Lenient, RandomReuse
from spec_rl.sampling.distribution import residual_logprobs
from spec_rl.trainer.correction import RolloutCorrection

V = 5


def _pair(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p, log q) [V] float64: a current and an old policy over V tokens, one much flatter than the other."""
    gen = torch.Generator().manual_seed(seed)
    p = torch.rand(V, generator=gen, dtype=torch.float64) ** 3 + 1e-3
    q = torch.rand(V, generator=gen, dtype=torch.float64) + 1e-3
    return (p / p.sum()).log(), (q / q.sum()).log()


@pytest.mark.parametrize("seed", range(4))
def test_kept_behaviour_is_the_drafted_and_kept_path_in_float64(seed):
    gen = torch.Generator().manual_seed(seed)
    lp_new = -torch.rand(3, 6, generator=gen, dtype=torch.float64) * 4
    lp_old = -torch.rand(3, 6, generator=gen, dtype=torch.float64) * 4
    drafted = -torch.rand(3, 6, generator=gen, dtype=torch.float64) * 4  # a draft kept before: not its lp_old
    lengths = torch.tensor([6, 3, 1])
    for lenience in (0.5, 1.0, math.exp(0.5), 10.0):
        got = Lenient(lenience).kept_behaviour(lp_new.float(), lp_old.float(), drafted.float(), lengths)
        want = drafted + torch.minimum(torch.zeros(()), math.log(lenience) + lp_new - lp_old)
        assert torch.allclose(got, want, atol=1e-5)
    assert torch.allclose(Lenient(math.inf).kept_behaviour(lp_new, lp_old, drafted, lengths), drafted)
    # random reuse keeps token i given tokens < i with probability (R - i) / (R - i + 1): n uniform on {0..R}
    got = RandomReuse().kept_behaviour(lp_new, lp_old, drafted, lengths)
    for row, r in enumerate(lengths.tolist()):
        for i in range(r):
            assert got[row, i].item() == pytest.approx(drafted[row, i].item() + math.log((r - i) / (r - i + 1)))
    # rules whose responses are samples of the current policy report its log-probs
    for rule in (Exact(), Coupled(), Lenient(1.0, "residual")):
        assert rule.samples_policy
        assert torch.equal(rule.kept_behaviour(lp_new, lp_old, drafted, lengths), lp_new)


def test_the_keep_probability_is_the_tests_acceptance_rate():
    lp_new, lp_old = _pair(0)
    u = (torch.arange(1, 200_001, dtype=torch.float64) / 200_000).unsqueeze(0)  # a grid on (0, 1]
    for lenience in (0.7, 1.0, math.exp(0.5)):
        rule = Lenient(lenience)
        rate = rule.test(lp_new.unsqueeze(1), lp_old.unsqueeze(1), u).double().mean(1)
        assert torch.allclose(rate, rule.log_keep(lp_new, lp_old, torch.tensor([V])).exp(), atol=1e-5)


def test_a_draw_without_the_rejected_token_renormalises():
    lp = torch.tensor([-1.0, -2.0, -0.5], dtype=torch.float64)
    excluded = torch.tensor([-0.3, -3.0, 0.0], dtype=torch.float64)  # the last: all mass on it, drawn from p
    got = Lenient(1.0, "without-draft").drawn_behaviour(lp, excluded)
    want = [-1.0 - math.log(1 - math.exp(-0.3)), -2.0 - math.log(1 - math.exp(-3.0)), -0.5]
    assert got.tolist() == pytest.approx(want)
    assert torch.equal(Lenient(1.0).drawn_behaviour(lp, None), lp)
    assert torch.equal(Exact().drawn_behaviour(lp, excluded), lp)  # exact: the position is a sample of p


def _outcomes(rule, lp, lq):
    """Every outcome of one position: (probability, token, behaviour log-prob) for a draft d ~ q verified by
    ``rule`` and a draw at a rejection, behaviour from the rule's own methods."""
    p, q = lp.exp(), lq.exp()
    out = []
    for d in range(V):
        one = torch.tensor([[lp[d]]]), torch.tensor([[lq[d]]])
        if rule.samples_policy:  # exact: keep with p(d), else p without d; residual: min(1, p/q), else max(0, p - q)
            keep = p[d] if isinstance(rule, Exact) else min(1.0, (p[d] / q[d]).item())
            draw = p.clone() if isinstance(rule, Exact) else residual_logprobs(lp, lq).exp()
            if isinstance(rule, Exact):
                draw[d] = 0
        else:
            keep = rule.log_keep(*one, torch.tensor([1])).exp().item()
            draw = p.clone()
            if rule.excludes_rejected:
                draw[d] = 0
        kept = rule.kept_behaviour(*one, one[1], torch.tensor([1])).item()  # a fresh draft: drafted with q(d)
        out.append((q[d].item() * keep, d, kept))
        draw = draw / draw.sum() if draw.sum() > 0 else draw
        excluded = lp[d : d + 1] if rule.excludes_rejected else None
        for z in range(V):
            if draw[z] > 0:
                b = rule.drawn_behaviour(lp[z : z + 1], excluded).item()
                out.append((q[d].item() * (1 - keep) * draw[z].item(), z, b))
    return out


def _expectation(outcomes, lp, g, correction=None):
    """E[w g(y)] and E[w] over the outcomes, w = pi / pi_behaviour corrected as ``correction`` does."""
    log_w = torch.tensor([lp[y].item() - b for _, y, b in outcomes], dtype=torch.float64)
    w = log_w.exp()
    if correction is not None:
        w = correction.weights(log_w, torch.ones_like(log_w, dtype=torch.bool))[0].double()
    prob = torch.tensor([pr for pr, _, _ in outcomes], dtype=torch.float64)
    ys = torch.tensor([y for _, y, _ in outcomes])
    return float((prob * w * g[ys]).sum()), float((prob * w).sum())


@pytest.mark.parametrize("seed", range(3))
def test_what_the_corrected_estimator_estimates_under_each_rule(seed):
    lp, lq = _pair(seed)
    p, q = lp.exp(), lq.exp()
    g = torch.randn(V, generator=torch.Generator().manual_seed(100 + seed), dtype=torch.float64)
    target = float((p * g).sum())  # E_p[g]: what an on-policy sample estimates
    truncated = 0
    for rule in (Exact(), Lenient(1.0, "residual")):  # samples of the policy: weights 1, no correction needed
        outcomes = _outcomes(rule, lp, lq)
        assert sum(pr for pr, _, _ in outcomes) == pytest.approx(1.0)
        assert _expectation(outcomes, lp, g) == pytest.approx((target, 1.0))
    for lenience in (0.5, 1.0, math.exp(0.5), math.inf):
        rule = Lenient(lenience)  # the paper's draw: the kept path has probability min(q, l p), the draw p
        outcomes = _outcomes(rule, lp, lq)
        kept = torch.minimum(q, lenience * p) if lenience < math.inf else q
        r = 1 - float(kept.sum())  # the rejection probability
        est, mass = _expectation(outcomes, lp, g)
        # each position's token law is right, its weight (1 + r) is not: self-normalised, the estimate is unbiased
        assert est == pytest.approx((1 + r) * target) and mass == pytest.approx(1 + r)
        assert est / mass == pytest.approx(target)
        if lenience == math.inf:
            assert r == pytest.approx(0.0)  # every draft kept: plain importance sampling from q, unbiased
        # truncation at C: the kept tokens whose weight passes C lose the excess, a bias of sum m(y)(min(w, C) - w)g
        w = p / kept
        for correction in (RolloutCorrection("tis", 1.5), RolloutCorrection("mis", 1.5)):
            est_c, _ = _expectation(outcomes, lp, g, correction)
            cut = w.clamp(max=1.5) if correction.kind == "tis" else torch.where(w <= 1.5, w, torch.zeros_like(w))
            assert est_c - est == pytest.approx(float((kept * (cut - w) * g).sum()), abs=1e-6)  # float32 weights
            assert (abs(est_c - est) > 1e-5) == bool((w > 1.5).any())
            truncated += bool((w > 1.5).any())
    assert truncated  # the pair puts some weight past the threshold
    rule = Lenient(1.0, "without-draft")  # a draw renormalised without d weighs 1 - p(d): that token's share is lost
    est, _ = _expectation(_outcomes(rule, lp, lq), lp, g)
    rejected = q * (1 - torch.minimum(torch.ones(()), p / q))
    assert est == pytest.approx(target + float((rejected * (target - p * g)).sum()))
