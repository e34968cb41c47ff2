"""Sibling drafts (spec_rl.drafts.siblings): what a row is offered, and that it changes no token."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_model

from spec_rl.backends.transformers_backend import TransformersBackend
from spec_rl.drafts.cache import RolloutCache
from spec_rl.drafts.siblings import DraftSources, SiblingTokens
from spec_rl.rollout.speculative import RolloutRequest, SpeculativeRollout
from spec_rl.sampling.distribution import SamplingSettings


def test_a_member_is_offered_what_followed_its_last_tokens_in_a_sibling():
    group = SiblingTokens(texts=[[5, 6, 7, 8, 9]])
    group.extend("a", [1, 2, 3, 4, 10, 11])
    group.extend("b", [1, 2, 3])
    assert group.continuation("b", 3) == ([4, 10, 11], 3)  # longest n-gram (1,2,3) -> what followed in "a"
    group.extend("b", [7])
    assert group.continuation("b", 5) == ([], 0)  # (3, 7) occurs nowhere; (7,) alone is below the shortest order
    group.extend("c", [6, 7])
    assert group.continuation("c", 2) == ([8, 9], 2)  # from the read-only text
    group.extend("d", [2, 3, 4, 2, 3])
    assert group.continuation("d", 2) == ([4, 2], 2)  # the most recent occurrence (its own earlier one) wins
    import numpy as np

    for bad in (2.5, True, "2", None, torch.tensor(2.5), np.array([3]), np.True_):
        with pytest.raises(TypeError, match="k must be an integer count of tokens"):
            group.continuation("d", bad)
    assert group.continuation("d", np.int64(2)) == group.continuation("d", np.uint8(2)) == ([4, 2], 2)  # any integer
    assert group.continuation("d", torch.tensor(2)) == ([4, 2], 2)
    assert group.continuation("d", np.uint8(250)) == ([4, 2, 3], 2)  # read as 250, not wrapped around


def _brute_continuation(appends, seqs, member, k):
    """The definition, by brute force: for n = 4, 3, 2, the newest occurrence (in append order) of the
    member's last n tokens that is not its own end and has a continuation."""
    seq = seqs.get(member, [])
    for n in (4, 3, 2):
        if len(seq) < n:
            continue
        for other, end in reversed(appends):
            text = seqs[other]
            if end + 1 < n or text[end - n + 1 : end + 1] != seq[-n:] or (other == member and end >= len(seq) - 1):
                continue
            if text[end + 1 : end + 1 + k]:
                return text[end + 1 : end + 1 + k], n
    return [], 0


@pytest.mark.parametrize("seed", range(4))
def test_continuations_equal_the_brute_force_definition_on_random_groups(seed):
    import random

    rng = random.Random(seed)
    vocab = rng.choice([3, 6, 20])  # small vocabularies: many repeated n-grams of every order
    texts = [[rng.randrange(vocab) for _ in range(rng.randrange(0, 12))] for _ in range(rng.randrange(0, 3))]
    group = SiblingTokens(texts)
    seqs = {("text", i): list(t) for i, t in enumerate(texts)}
    appends = [(("text", i), e) for i, t in enumerate(texts) for e in range(len(t))]
    for _ in range(300):
        member = rng.randrange(4)
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(0, 4))]
        group.extend(member, tokens)
        for t in tokens:
            seqs.setdefault(member, []).append(t)
            appends.append((member, len(seqs[member]) - 1))
        k = rng.randrange(0, 6)
        asked = rng.randrange(5)
        assert group.continuation(asked, k) == _brute_continuation(appends, seqs, asked, k)


class _History:
    def __init__(self, offer):
        self.offer, self.updates = offer, []

    def propose(self, limit, fill=0):
        return self.offer[:limit]

    def update(self, proposal, emitted):
        self.updates.append((list(proposal), list(emitted)))


def test_draft_sources_keep_the_longer_proposal_and_learn_the_acceptance():
    group = SiblingTokens()
    group.extend("a", [1, 2, 3, 4, 5, 6])
    history = _History([9, 9])
    row = DraftSources(history, group, "b", vocab_size=6)
    group.extend("b", [1, 2])
    assert row.propose(8) == [3, 4, 5]  # the siblings' (longer) offer, stopped before id 6 (outside the vocabulary)
    assert row.acceptance() == pytest.approx(0.5)
    row.update([3, 4, 5], [3, 4, 0])  # two kept, the third missed
    assert (row.accepted, row.tested) == (2, 3) and row.acceptance() == pytest.approx(3 / 5)
    assert history.updates == [([], [3, 4, 0])]  # the history proposer did not propose this step
    assert group.seqs["b"] == [1, 2, 3, 4, 0]
    assert DraftSources(_History([7, 7, 7]), None, "x").propose(2) == [7, 7]


def test_sibling_drafts_give_plain_keyed_decoding_token_for_token_in_fewer_steps():
    model = tiny_model(seed=2, bias_eos=-4.0).double()  # long responses: room for siblings to repeat
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)  # peaked: the samples of one prompt mostly agree, as a trained policy's do
    settings = SamplingSettings(temperature=1.0, max_tokens=24)
    requests = [RolloutRequest([3, 4, 5], slot=s) for s in range(16)]

    def run(siblings: bool):
        # two decode batches of 8: the second batch's rows can follow the first batch's finished siblings
        backend = TransformersBackend(model, eos_ids=[1], pad_id=0, max_k=4, max_batch_size=8)
        rollout = SpeculativeRollout(backend, RolloutCache(), settings, [1], 64, strategy="off", seed=5,
                                     sibling_drafts=siblings)  # fmt: skip
        return rollout.run(requests, step=1)

    plain, fast = run(False), run(True)
    assert fast.response_ids == plain.response_ids
    assert all(a == pytest.approx(b, abs=1e-9) for a, b in zip(fast.logprobs, plain.logprobs))
    assert fast.stats.tail_proposed > 0 and fast.stats.tail_accepted > 0
    assert fast.stats.decode_steps < plain.stats.decode_steps
    assert torch.tensor([len(r) for r in plain.response_ids]).float().mean() > 8
