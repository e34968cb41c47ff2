"""Tree-packed scoring of a group's drafts equals scoring each [prompt, draft] on its own."""

import pytest
import torch
from tiny_models import tiny_model

from spec_rl.backends.scoring import response_states
from spec_rl.sampling.groups import gather_scores, pack_groups, tree_inputs


def _ancestors(group):
    """Brute-force ancestor sets from depth/size, to check the preorder layout."""
    n = len(group.tokens)
    return [[j for j in range(n) if j <= i < j + group.size[j]] for i in range(n)]


def test_pack_group_layout():
    prompts = [[3, 4, 5]] * 3 + [[7]]
    drafts = [[10, 11, 12], [10, 11, 13, 14], [15], [10, 10]]
    groups = pack_groups(prompts, drafts)
    assert [g.members for g in groups] == [[0, 1, 2], [3]]
    g = groups[0]
    assert len(g.tokens) == 3 + 6  # prompt + trie nodes {10, 11, 12, 13, 14, 15}
    for m, d in zip(g.members, (drafts[0], drafts[1], drafts[2])):
        pos = g.node_pos[g.members.index(m)]
        assert [g.tokens[p] for p in pos] == d
        assert [g.depth[p] for p in pos] == list(range(3, 3 + len(d)))
        # The ancestors of a draft's last node are exactly its path.
        assert _ancestors(g)[pos[-1]] == sorted(g.path(g.members.index(m), len(d)))
        assert g.score_pos[g.members.index(m)] == [2] + pos[:-1]


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_tree_scores_equal_separate_scores(impl):
    model = tiny_model(seed=4)
    model.config._attn_implementation = impl
    gen = torch.Generator().manual_seed(0)
    prompts, drafts = [], []
    for _g in range(4):
        prompt = torch.randint(3, 30, (int(torch.randint(1, 9, (1,), generator=gen)),), generator=gen).tolist()
        base = torch.randint(3, 30, (12,), generator=gen).tolist()
        for _s in range(3):
            cut = int(torch.randint(0, 12, (1,), generator=gen))
            tail = torch.randint(3, 30, (int(torch.randint(0, 6, (1,), generator=gen)),), generator=gen).tolist()
            prompts.append(prompt)
            drafts.append(base[:cut] + tail)
    groups = pack_groups(prompts, drafts)
    additive = torch.float32 if impl == "eager" else None
    ids, pos, mask = tree_inputs(groups, pad_id=0, device=torch.device("cpu"), additive_dtype=additive)
    with torch.no_grad():
        states = model(input_ids=ids, position_ids=pos, attention_mask=mask).logits
        want = response_states(model, prompts, drafts, pad_id=0)
    out = torch.zeros_like(want)
    width = out.shape[1]
    same_as = torch.arange(len(drafts) * width).view(len(drafts), width)
    gather_scores(states, groups, out, same_as)
    for i, d in enumerate(drafts):
        assert torch.allclose(out[i, : len(d)], want[i, : len(d)], atol=2e-5), i
    # same_as: the first (lowest flat index) entry with the same prompt and draft prefix; padding: itself
    for i, d in enumerate(drafts):
        for r in range(width):
            twins = [
                j
                for j in range(len(drafts))
                if prompts[j] == prompts[i] and len(drafts[j]) > r and drafts[j][:r] == d[:r]
            ]
            want_index = min(twins) * width + r if r < len(d) else i * width + r
            assert int(same_as[i, r]) == want_index, (i, r)
