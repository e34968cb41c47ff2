"""Adaptive lenience and the reference implementation's random-reuse variant."""

import math

import pytest
import torch
from _stats import assert_fits

from spec_rl.acceptance.adaptive import AUTO_GRID, accepted_drift, choose_log_lenience
from spec_rl.acceptance.dispatch import verify
from spec_rl.acceptance.reference import random_reuse_index


def _case(seed: int, bsz: int = 64, length: int = 20, drift: float = 0.3):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(bsz, length, generator=g) * 3
    new = (old + torch.randn(bsz, length, generator=g) * drift).clamp(max=0)
    return new, old, torch.full((bsz,), length), torch.arange(bsz) * 7 + 1


def test_no_drift_allows_the_most_lenient_choice_and_a_tiny_bound_the_least():
    new, old, lengths, uids = _case(0)
    assert choose_log_lenience(old, old, lengths, uids, seed=3, target_drift=0.01) == AUTO_GRID[-1]
    assert choose_log_lenience(new, old, lengths, uids, seed=3, target_drift=1e-6) == AUTO_GRID[0]


@pytest.mark.parametrize("target", [0.05, 0.1, 0.2])
def test_the_choice_is_the_largest_l_within_the_bound(target):
    new, old, lengths, uids = _case(1)
    log_l = choose_log_lenience(new, old, lengths, uids, seed=5, target_drift=target)

    def drift_at(x):
        res = verify(torch.zeros(new.shape, dtype=torch.long), old, new_logprobs=new, lengths=lengths,
                     log_lenience=x, seed=5, uids=uids)  # fmt: skip
        return accepted_drift(new, old, lengths, res.accepted_len)

    assert drift_at(log_l) <= target or log_l == AUTO_GRID[0]
    nxt = [x for x in AUTO_GRID if x > log_l]
    if nxt:
        assert drift_at(nxt[0]) > target  # one grid step more lenient breaks the bound


def test_rollout_with_auto_lenience_records_its_choice():
    from tiny_models import tiny_model

    from spec_rl.backends.transformers_backend import TransformersBackend
    from spec_rl.drafts.cache import RolloutCache
    from spec_rl.rollout.speculative import RolloutRequest, SpeculativeRollout
    from spec_rl.sampling.distribution import SamplingSettings

    model = tiny_model(seed=2)
    rollout = SpeculativeRollout(TransformersBackend(model, {1}, pad_id=0), RolloutCache(), SamplingSettings(max_tokens=12),
                                 [1], 64, lenience="auto", target_drift=0.05)  # fmt: skip
    reqs = [RolloutRequest([3, 11, 12], s) for s in range(8)]
    rollout.run(reqs, step=0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    stats = rollout.run(reqs, step=1).stats
    assert stats.log_lenience in AUTO_GRID
    assert stats.reused_drift <= 0.05 or stats.log_lenience == 0.0


def test_random_ref_never_reuses_a_draft_whole_and_is_uniform_below_the_length():
    n_samples, length = 30000, 9
    uids = torch.arange(n_samples)
    n = random_reuse_index(4, uids, torch.full((n_samples,), length), "random-ref")
    assert int(n.max()) == length - 1 and int(n.min()) == 0
    assert_fits(torch.bincount(n, minlength=length), torch.full((length,), 1.0 / length))
    ours = random_reuse_index(4, uids, torch.full((n_samples,), length), "random")
    assert_fits(torch.bincount(ours, minlength=length + 1), torch.full((length + 1,), 1.0 / (length + 1)))
    assert random_reuse_index(4, torch.arange(3), torch.zeros(3, dtype=torch.long), "random-ref").tolist() == [0, 0, 0]
    res = verify(torch.zeros((4, 5), dtype=torch.long), torch.full((4, 5), -1.0), new_logprobs=torch.full((4, 5), -1.0),
                 strategy="random-ref", seed=1)  # fmt: skip
    assert bool((res.accepted_len < 5).all()) and not bool(res.full_reuse.any())


def test_adaptive_arguments_are_checked():
    new, old, lengths, uids = _case(2)
    with pytest.raises(ValueError, match="target_drift"):
        choose_log_lenience(new, old, lengths, uids, seed=0, target_drift=math.nan)
    with pytest.raises(ValueError, match="grid"):
        choose_log_lenience(new, old, lengths, uids, seed=0, grid=())
