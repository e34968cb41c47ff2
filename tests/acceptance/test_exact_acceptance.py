"""Exact acceptance is lossless: responses are distributed as fresh samples of the current policy.

A table policy over a 4-token vocabulary (0 and 1 are content, 2 is EOS, 3 is the prompt token)
whose next-token distribution depends on the last token only. Every one of 24,000 samples has the
same cached draft [0, 0] recorded with log-prob 0 (a point mass), so the draft is maximally off-policy.
The joint distribution of the first two response tokens is checked with a chi-square test:

* exact acceptance: p(a | prompt) * p(b | a), the current policy itself;
* the paper's lenient rule at l = 1 (kept as it is): token 0 is accepted with probability
  p_new / p_old, and after a rejection the token is drawn from p_t itself, which biases the
  response towards the draft (first-token marginal [0.75, 0.25] instead of [0.5, 0.5]).
"""

import pytest
import torch
from _stats import assert_fits

from spec_rl.acceptance.mode import MODES, RolloutMode
from spec_rl.acceptance.rules import Exact, Lenient
from spec_rl.acceptance.scores import DraftScores
from spec_rl.backends.base import BackendStats, Continuation, Scored
from spec_rl.backends.reprefill import ReprefillBackend
from spec_rl.drafts.cache import CacheKey, RolloutCache
from spec_rl.rollout.speculative import RolloutRequest, SpeculativeRollout
from spec_rl.sampling.distribution import SamplingSettings, keyed_sample

EOS, PROMPT = 2, 3
TABLE = torch.tensor(
    [
        [0.2, 0.6, 0.2, 0.0],  # after token 0
        [0.7, 0.1, 0.2, 0.0],  # after token 1
        [0.0, 0.0, 1.0, 0.0],  # after EOS (never used)
        [0.5, 0.5, 0.0, 0.0],  # after the prompt
    ],
    dtype=torch.float64,
)
N = 24000


class TablePolicy(ReprefillBackend):
    """A policy whose distribution is TABLE[last token]; keyed sampling like the real backends."""

    def __init__(self):
        self.stats = BackendStats()

    @property
    def device(self):
        return torch.device("cpu")

    @staticmethod
    def logits(last: torch.Tensor) -> torch.Tensor:
        return torch.log(TABLE[last]).float()

    def score(self, prompts, drafts, logprobs=None):
        width = max(len(d) for d in drafts)
        rows = [[p[-1]] + list(d[:-1]) + [PROMPT] * (width - len(d)) for p, d in zip(prompts, drafts)]
        return Scored(DraftScores(logits=self.logits(torch.tensor(rows))), prompts, drafts)

    def generate(self, jobs, settings, seed):
        uids = torch.tensor([j.uid for j in jobs])
        budgets = [j.budget for j in jobs]
        seqs = [list(j.context) for j in jobs]
        contexts = seqs
        out = [Continuation([], [], "length") for _ in contexts]
        for _step in range(max(budgets, default=0)):
            live = [i for i, c in enumerate(out) if c.finish_reason != "eos" and len(c.token_ids) < budgets[i]]
            if not live:
                break
            last = torch.tensor([seqs[i][-1] for i in live])
            pos = torch.tensor([len(seqs[i]) for i in live])
            ids, lps = keyed_sample(self.logits(last), settings, seed, uids[live], pos)
            for i, t, lp in zip(live, ids.tolist(), lps.tolist()):
                seqs[i].append(t)
                out[i].token_ids.append(t)
                out[i].logprobs.append(lp)
                if t == EOS:
                    out[i].finish_reason = "eos"
        return out


def _first_two_tokens(rule) -> torch.Tensor:
    settings = SamplingSettings(max_tokens=2)
    cache = RolloutCache()
    requests = [RolloutRequest([PROMPT], slot=s) for s in range(N)]
    for r in requests:
        cache.store(CacheKey.make(r.prompt_ids, r.slot), [0, 0], [0.0, 0.0], "length", 0, settings)
    rollout = SpeculativeRollout(
        TablePolicy(), cache, settings, eos_ids=[EOS], max_model_len=16, seed=3, mode=RolloutMode(rule, tail=0)
    )
    result = rollout.run(requests, step=1)
    counts = torch.zeros(2, 3)
    for resp in result.response_ids:
        assert 1 <= len(resp) <= 2 and resp[0] in (0, 1)
        counts[resp[0], resp[1] if len(resp) > 1 else EOS] += 1
    return counts


def test_exact_acceptance_gives_the_current_policy():
    joint = TABLE[PROMPT, :2].unsqueeze(1) * TABLE[:2, :3]
    counts = _first_two_tokens(Exact())
    assert_fits(counts, joint)
    assert abs(float(counts[0].sum()) / N - 0.5) < 0.015  # first-token marginal [0.5, 0.5]


def test_lenient_rule_at_l1_stays_the_papers():
    p0 = TABLE[0, :3]
    accept_second = torch.tensor([1.0, 0.0, 0.0])
    joint = torch.stack(
        [
            0.5 * (0.2 * accept_second + 0.8 * p0) + 0.25 * p0,  # first token 0: draft kept, or resampled to 0
            0.25 * TABLE[1, :3],  # first token 1: only after a rejection
        ]
    )
    counts = _first_two_tokens(Lenient(1.0))
    assert_fits(counts, joint)
    assert abs(float(counts[0].sum()) / N - 0.75) < 0.015  # first-token marginal [0.75, 0.25]


def test_a_mode_by_name_is_taken_and_an_unknown_one_refused():
    with pytest.raises(ValueError, match="mode must be one of"):
        SpeculativeRollout(TablePolicy(), RolloutCache(), SamplingSettings(), [EOS], 16, mode="fast")
    rollout = SpeculativeRollout(TablePolicy(), RolloutCache(), SamplingSettings(), [EOS], 16, mode="exact")
    assert rollout.mode == MODES["exact"]


def test_exact_mode_reproduces_vanilla_decoding_token_for_token():
    """Keyed sampling makes the exact walk + continuation the same function as fresh decoding."""
    from tiny_models import tiny_model

    from spec_rl.backends.transformers_backend import TransformersBackend
    from spec_rl.drafts.history import HistoryIndex

    model = tiny_model(seed=21, bias_eos=-0.5).double()
    settings = SamplingSettings(temperature=1.0, max_tokens=24)
    prompts = [[3, 11, 12, 13], [3, 15, 16], [3, 17, 18, 19, 20]]
    requests = [RolloutRequest(p, s, dataset_id=f"q{i}") for i, p in enumerate(prompts) for s in range(3)]

    def rollout(mode, cache, history=None):
        backend = TransformersBackend(model, {1}, pad_id=0)
        # seed 5: a draw in which the moved policy still samples a few draft tokens (the walk accepts them)
        return SpeculativeRollout(backend, cache, settings, [1], 64, mode=mode, seed=5, history=history)

    cache = RolloutCache()
    rollout(MODES["vanilla"], cache).run(requests, step=0)  # last epoch's responses become the drafts
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # the policy moved since
    exact = rollout(MODES["exact"], cache, HistoryIndex()).run(requests, step=1)
    fresh = rollout(MODES["vanilla"], RolloutCache()).run(requests, step=1)
    assert exact.response_ids == fresh.response_ids
    for a, b in zip(exact.logprobs, fresh.logprobs):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5)
    assert exact.stats.accepted_tokens > 0 and exact.stats.tokens_generated < fresh.stats.tokens_generated


def test_exact_acceptance_reads_no_old_logprobs():
    from spec_rl.acceptance.dispatch import VerifyOptions, verify_logprobs

    ids, lp_new = torch.zeros(64, 3, dtype=torch.long), torch.full((64, 3), -0.4)
    exact = VerifyOptions(mode="exact", return_accept_mask=True)
    a = verify_logprobs(ids, None, lp_new, seed=4, options=exact)
    b = verify_logprobs(ids, torch.full((64, 3), -3.0), lp_new, seed=4, options=exact)
    # the exact test is the lenient one with lp_old = 0 and l = 1
    c = verify_logprobs(
        ids, torch.zeros(64, 3), lp_new, seed=4, options=VerifyOptions(Lenient(1.0), return_accept_mask=True)
    )
    assert torch.equal(a.accept_mask, b.accept_mask) and torch.equal(a.accept_mask, c.accept_mask)
    assert 0 < int(a.accepted_len.sum()) < 64 * 3
