"""The token at a lenient rejection: drawn from pi_t (the paper) or from pi_t without the rejected draft token.

Every sample's draft is one token y drawn from an old policy q and stored with log q(y), as a cached
response is. The first response token is then counted over 24,000 keyed samples and compared by a
chi-square test with its float64 law:

    P(z) = sum_y q(y) [ a(y) 1[z = y] + (1 - a(y)) r_y(z) ],   a(y) = min(1, l p(y) / q(y)),

with r_y = p for the paper's draw and r_y = p without y, renormalised, for "without-draft". With two
tokens and l = 1 the second is exact speculative sampling (P = p): the residual max(0, p - q) then sits
on the one token that is not y.
"""

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
from spec_rl.sampling.distribution import SamplingSettings

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
        FixedPolicy(p), cache, settings, eos_ids=[len(p) - 1], max_model_len=8, seed=seed, mode=mode
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

    for bad in ("residual", None, 1, b"policy", ["policy"], np.array(["policy"])):  # an array compares element-wise
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
