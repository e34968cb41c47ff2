"""The keyed Gumbel-max kernel (CUDA's sampling rule): the same token as its torch reference, bit for bit."""

from __future__ import annotations

import pytest
import torch
from _kernel_helpers import DEVICE  # first: skips this module when triton is missing

import spec_rl.kernels as K
from spec_rl.sampling.distribution import philox_gumbel_argmax


@pytest.mark.parametrize(
    ("rows", "vocab", "block", "dtype"),
    [
        (1, 1, None, torch.float32),
        (7, 300, 64, torch.float32),
        (5, 1000, None, torch.bfloat16),
        (3, 129, 128, torch.float16),
    ],
)
def test_kernel_matches_the_reference(rows, vocab, block, dtype):
    gen = torch.Generator().manual_seed(rows * vocab)
    race = (torch.randn(rows, vocab, generator=gen) * 3).to(dtype)
    race[:, 1::5] = float("-inf")  # outside the support
    keys = torch.randint(-(2**63), 2**63 - 1, (rows,), generator=gen)
    got = K.gumbel_argmax(race.to(DEVICE), keys.to(DEVICE), block=block).cpu()
    assert torch.equal(got, philox_gumbel_argmax(race.float(), keys))


def test_kernel_edge_rows():
    race = torch.full((3, 40), float("-inf"))
    race[1, 17] = 0.0  # one token in the support
    race[2] = 0.0
    race[2, 33] = 1e6  # a certain token
    keys = torch.tensor([1, 2, 3])
    got = K.gumbel_argmax(race.to(DEVICE), keys.to(DEVICE), block=16).cpu()
    assert got.tolist() == [0, 17, 33]  # no support: token 0, as torch.argmax
    assert K.gumbel_argmax(race[:0].to(DEVICE), keys[:0].to(DEVICE)).numel() == 0


def test_kernel_returns_the_one_token_of_all_the_mass_where_its_uniform_is_zero():
    # under key 6786339 token 1's uniform is 0 (tests/sampling/test_keyed_sampling.py checks the word)
    race = torch.full((1, 4), float("-inf"), device=DEVICE)
    race[0, 1] = 0.0
    keys = torch.tensor([6786339], device=DEVICE)
    assert K.gumbel_argmax(race, keys).tolist() == [1]
    assert torch.equal(K.gumbel_argmax(race, keys), philox_gumbel_argmax(race, keys))
