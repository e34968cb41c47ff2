"""Keyed sampling (exponential race): exact marginals (chi-square), batch independence, residual draws, robustness."""

import math

import pytest
import torch
from _stats import assert_fits

from spec_rl.sampling.distribution import SamplingSettings, keyed_sample, philox_gumbel_argmax, sampling_log_softmax
from spec_rl.sampling.philox import STREAM_SAMPLE, philox_keys


@pytest.mark.parametrize(
    "settings", [SamplingSettings(), SamplingSettings(temperature=0.7, top_k=5), SamplingSettings(top_p=0.8)]
)
def test_marginal_matches_the_sampling_distribution(settings):
    n, vocab = 40000, 8
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(3)) * 1.5
    ids, lps = keyed_sample(
        logits.expand(n, vocab), settings, seed=11, uids=torch.arange(n), positions=torch.full((n,), 7)
    )
    p = sampling_log_softmax(logits, settings.temperature, settings.top_k, settings.top_p)[0].double().exp()
    assert_fits(torch.bincount(ids, minlength=vocab), p)
    assert torch.allclose(lps, torch.log(p.float())[ids])


def test_same_key_same_token_whatever_the_batch():
    logits = torch.randn(50, 30, generator=torch.Generator().manual_seed(0))
    uids = torch.randint(0, 2**62, (50,), generator=torch.Generator().manual_seed(1))
    pos = torch.randint(0, 500, (50,), generator=torch.Generator().manual_seed(2))
    a, _ = keyed_sample(logits, SamplingSettings(), 5, uids, pos)
    perm = torch.randperm(50, generator=torch.Generator().manual_seed(4))
    b, _ = keyed_sample(logits[perm], SamplingSettings(), 5, uids[perm], pos[perm])
    assert torch.equal(a[perm], b)
    c, _ = keyed_sample(logits[:7], SamplingSettings(), 5, uids[:7], pos[:7])  # a smaller batch
    assert torch.equal(a[:7], c)
    d, _ = keyed_sample(logits, SamplingSettings(), 6, uids, pos)  # another seed: other draws
    assert not torch.equal(a, d)


def test_residual_removes_the_excluded_token_and_renormalises():
    n, vocab = 40000, 6
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(5))
    p = torch.softmax(logits[0].double(), -1)
    exclude = torch.full((n,), 2)
    ids, lps = keyed_sample(
        logits.expand(n, vocab), SamplingSettings(), 3, torch.arange(n), torch.zeros(n, dtype=torch.long), exclude
    )
    q = p.clone()
    q[2] = 0
    q /= q.sum()
    assert_fits(torch.bincount(ids, minlength=vocab), q)  # token 2 never drawn, the rest in proportion
    assert torch.allclose(lps, torch.log(p.float())[ids])  # log-probs stay the policy's own


def test_residual_of_a_point_mass_falls_back_to_the_distribution():
    logits = torch.tensor([[0.0, -math.inf, -math.inf]])
    ids, lps = keyed_sample(logits, SamplingSettings(), 0, torch.tensor([1]), torch.tensor([0]), torch.tensor([0]))
    assert ids.tolist() == [0] and lps.tolist() == [0.0]


def test_rounding_of_the_logits_moves_no_token_of_a_large_vocabulary():
    # A running sum of probabilities moves every boundary when any logit rounds differently; the race does not.
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(64, 49152, generator=gen) * 4
    noisy = logits * (1 + 1e-6 * torch.randn(logits.shape, generator=gen))
    uids, pos = torch.arange(64) * 7 + 1, torch.full((64,), 30)
    a, _ = keyed_sample(logits, SamplingSettings(), 3, uids, pos)
    b, _ = keyed_sample(noisy, SamplingSettings(), 3, uids, pos)
    assert int((a != b).sum()) == 0


def test_rows_are_drawn_in_chunks_without_changing_a_token(monkeypatch):
    import spec_rl.sampling.distribution as dist

    logits = torch.randn(40, 300, generator=torch.Generator().manual_seed(2))
    uids, pos = torch.arange(40), torch.arange(40)
    whole, _ = keyed_sample(logits, SamplingSettings(), 9, uids, pos)
    monkeypatch.setattr(dist, "_NOISE_ELEMENTS", 600)  # two rows per chunk
    chunked, _ = keyed_sample(logits, SamplingSettings(), 9, uids, pos)
    assert torch.equal(whole, chunked)


@pytest.mark.parametrize("settings", [SamplingSettings(), SamplingSettings(temperature=0.7, top_k=5, top_p=0.9)])
def test_the_device_rule_draws_the_sampling_distribution(settings):
    # CUDA's rule (Philox noise per token under the row's key, no generator): exact marginals too.
    n, vocab = 40000, 8
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(5)) * 1.5
    logp = sampling_log_softmax(logits, settings.temperature, settings.top_k, settings.top_p)
    keys = philox_keys(9, torch.arange(n), torch.full((n,), 3), STREAM_SAMPLE)
    ids = philox_gumbel_argmax(logp.expand(n, vocab), keys)
    assert_fits(torch.bincount(ids, minlength=vocab), logp[0].double().exp())


def test_the_device_rule_is_keyed_and_never_draws_outside_the_support():
    race = torch.randn(64, 50, generator=torch.Generator().manual_seed(6))
    race[:, ::3] = float("-inf")
    keys = torch.randint(0, 2**63 - 1, (64,), generator=torch.Generator().manual_seed(7))
    ids = philox_gumbel_argmax(race, keys)
    assert torch.equal(ids % 3 != 0, torch.ones(64, dtype=torch.bool))
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(8))
    assert torch.equal(philox_gumbel_argmax(race[perm], keys[perm]), ids[perm])
    assert not torch.equal(philox_gumbel_argmax(race, keys + 1), ids)


# Keys whose uniform of token 1 is 0: the CPU generator seeded with CPU_KEY draws u = 0 at index 1 of a row of 4,
# the first Philox word of counter (1, 0, 0, 0) under DEVICE_KEY is 247 (>> 8: 0). Found by search; checked below.
CPU_KEY, DEVICE_KEY = 18179793, 6786339


@pytest.mark.parametrize("rule", ["cpu", "device"])
def test_a_one_token_distribution_returns_its_token_even_where_the_uniform_is_zero(rule):
    from spec_rl.sampling.distribution import gumbel_noise, gumbel_race
    from spec_rl.sampling.philox import philox4x32

    race = torch.full((1, 4), float("-inf"))
    race[0, 1] = 0.0  # all the mass on token 1
    if rule == "cpu":
        u = torch.empty(4).uniform_(generator=torch.Generator().manual_seed(CPU_KEY))
        assert u[1] == 0.0
        got = gumbel_race(race, torch.tensor([CPU_KEY]))
    else:
        one, zero = torch.ones((), dtype=torch.int64), torch.zeros((), dtype=torch.int64)
        assert int(philox4x32((one, zero, zero, zero), (torch.tensor(DEVICE_KEY), zero))[0]) >> 8 == 0
        got = philox_gumbel_argmax(race, torch.tensor([DEVICE_KEY]))
    assert got.tolist() == [1]  # -log(-log 0) would make every score -inf and argmax return token 0
    assert torch.isfinite(gumbel_noise(torch.zeros(3))).all()
