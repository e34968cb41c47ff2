"""Entropy and KL to the warm start (spec_rl.trainer.diagnostics) against a float64 brute force."""

import copy

import torch
from tiny_models import tiny_model

from spec_rl.trainer.diagnostics import policy_drift


def _brute_force(model, reference, prompts, responses, temperature):
    """Per-token entropy and KL summed position by position with one plain forward per sequence (float64)."""
    ent, kl, n = 0.0, 0.0, 0
    for p, r in zip(prompts, responses):
        ids = torch.tensor([list(p) + list(r)])
        with torch.no_grad():
            lp = torch.log_softmax(model(input_ids=ids).logits[0].double() / temperature, -1)
            lq = torch.log_softmax(reference(input_ids=ids).logits[0].double() / temperature, -1)
        for i in range(len(r)):
            row = len(p) - 1 + i
            prob = lp[row].exp()
            ent += float(-(prob * lp[row]).sum())
            kl += float((prob * (lp[row] - lq[row])).sum())
            n += 1
    return ent / n, kl / n


def test_entropy_and_kl_match_the_float64_brute_force_and_kl_is_zero_for_the_same_policy():
    torch.manual_seed(0)
    model = tiny_model(seed=1)
    moved = copy.deepcopy(model)
    with torch.no_grad():
        for w in moved.parameters():
            w.add_(0.05 * torch.randn_like(w))
    prompts = [[3, 4, 5], [3, 6], [7, 8, 9, 10]]
    responses = [[11, 12, 1], [], [13, 14, 15, 16, 1]]  # an empty response is skipped
    for temperature in (1.0, 0.7):
        got = policy_drift(moved, model, prompts, responses, pad_id=0, temperature=temperature)
        ent, kl = _brute_force(moved, model, prompts, responses, temperature)
        assert abs(got["heldout_entropy"] - ent) < 1e-4 and abs(got["heldout_kl_to_init"] - kl) < 1e-5
        assert kl > 1e-4  # the perturbed policy moved
    same = policy_drift(model, model, prompts, responses, pad_id=0)
    assert same["heldout_kl_to_init"] < 1e-7
    assert "heldout_kl_to_init" not in policy_drift(model, None, prompts, responses, pad_id=0)
