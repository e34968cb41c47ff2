"""Scores whose ``same_as`` marks shared outputs give the same log-probs, logits, samples and walks.

The tree-packed scorer scores a group's drafts with one output per distinct (prompt, draft prefix)
and says so in ``DraftScores.same_as``; verification then runs the LM head once per distinct output.
Here the scores are built directly: every (prompt, prefix) gets its own random hidden state, so rows
that share a prefix share it exactly, and each result is compared with the same computation without
``same_as`` (float64) and, for the exact walk, with a plain-Python trie walk.
"""

import pytest
import torch

import spec_rl.acceptance.reference as acceptance
from spec_rl.acceptance.exact_walk import walk_tries
from spec_rl.acceptance.reference import draft_logprobs
from spec_rl.acceptance.scores import DraftScores
from spec_rl.sampling.distribution import SamplingSettings, keyed_sample

VOCAB, DIM = 5, 8


def _groups(seed: int, n_groups: int = 4, group_size: int = 4):
    """Prompts and drafts over a 3-token alphabet (so prefixes are shared), including an empty draft."""
    gen = torch.Generator().manual_seed(seed)
    prompts, drafts = [], []
    for g in range(n_groups):
        prompt = [4, g] + torch.randint(
            0, VOCAB, (int(torch.randint(0, 3, (1,), generator=gen)),), generator=gen
        ).tolist()
        base = torch.randint(0, 3, (10,), generator=gen).tolist()
        for s in range(group_size):
            cut = int(torch.randint(0, 11, (1,), generator=gen))
            tail = torch.randint(0, 3, (int(torch.randint(0, 5, (1,), generator=gen)),), generator=gen).tolist()
            prompts.append(prompt)
            drafts.append([] if (g, s) == (0, 1) else base[:cut] + tail)
    return prompts, drafts


def _scores(prompts, drafts, seed: int, dtype=torch.float64):
    """Hidden states [B, R, DIM] that are a function of (prompt, prefix), and the brute-force same_as."""
    gen = torch.Generator().manual_seed(seed)
    width = max([len(d) for d in drafts] + [1])
    hidden = torch.randn(len(drafts), width, DIM, generator=gen, dtype=dtype)  # padding: anything
    same_as = torch.arange(len(drafts) * width).view(len(drafts), width)
    first: dict = {}
    for b, (p, d) in enumerate(zip(prompts, drafts)):
        for r in range(len(d)):
            key = (tuple(p), tuple(d[:r]))
            if key not in first:
                first[key] = b * width + r
                hidden[b, r] = torch.randn(DIM, generator=gen, dtype=dtype)
            else:
                hidden[b, r] = hidden.view(-1, DIM)[first[key]]
            same_as[b, r] = first[key]
    weight = torch.randn(VOCAB, DIM, generator=gen, dtype=dtype)
    bias = torch.randn(VOCAB, generator=gen, dtype=dtype)
    return hidden, weight, bias, same_as


def _padded(drafts):
    width = max([len(d) for d in drafts] + [1])
    ids = torch.tensor([d + [0] * (width - len(d)) for d in drafts])
    return ids, torch.tensor([len(d) for d in drafts])


@pytest.mark.parametrize(
    "settings", [SamplingSettings(), SamplingSettings(temperature=0.7, top_k=3), SamplingSettings(top_p=0.8)]
)
@pytest.mark.parametrize("source", ["hidden_states", "logits"])
def test_draft_logprobs_once_per_output_equal_every_position(settings, source, monkeypatch):
    monkeypatch.setattr(acceptance, "_LOGIT_ROWS_PER_CHUNK", 3)  # several chunks, ranges cut mid-group
    for seed in range(3):
        prompts, drafts = _groups(seed)
        hidden, weight, bias, same_as = _scores(prompts, drafts, seed)
        ids, lengths = _padded(drafts)
        if source == "logits":
            logits = torch.nn.functional.linear(hidden, weight, bias)
            plain, shared = DraftScores(logits=logits), DraftScores(logits=logits, same_as=same_as)
        else:
            plain = DraftScores(hidden_states=hidden, lm_head_weight=weight, lm_head_bias=bias)
            shared = DraftScores(hidden_states=hidden, lm_head_weight=weight, lm_head_bias=bias, same_as=same_as)
        want = draft_logprobs(ids, lengths, plain, settings, torch.float64)
        got = draft_logprobs(ids, lengths, shared, settings, torch.float64)
        assert torch.equal(torch.isinf(want), torch.isinf(got))
        finite = torch.isfinite(want)
        assert torch.allclose(got[finite], want[finite], atol=1e-12, rtol=0)
        assert bool((got[lengths.unsqueeze(1) <= torch.arange(ids.shape[1])] == 0).all())  # padding: 0
        assert float(want[finite].min()) < -0.5  # real log-probs, not zeros


def test_distinct_logits_at_runs_the_head_once_per_output():
    prompts, drafts = _groups(5)
    hidden, weight, bias, same_as = _scores(prompts, drafts, 5)
    plain = DraftScores(hidden_states=hidden, lm_head_weight=weight, lm_head_bias=bias)
    shared = DraftScores(hidden_states=hidden, lm_head_weight=weight, lm_head_bias=bias, same_as=same_as)
    rows = torch.tensor([b for b, d in enumerate(drafts) for _ in d])
    cols = torch.tensor([r for d in drafts for r in range(len(d))])
    distinct, index = shared.distinct_logits_at(rows, cols)
    assert distinct.shape[0] == len({(tuple(p), tuple(d[:r])) for p, d in zip(prompts, drafts) for r in range(len(d))})
    assert distinct.shape[0] < rows.shape[0]  # the groups share prefixes
    assert torch.allclose(distinct[index], plain.logits_at(rows, cols), atol=1e-6)
    assert torch.allclose(shared.logits_at(rows, cols), plain.logits_at(rows, cols), atol=1e-6)


def test_keyed_sample_with_index_equals_sampling_the_indexed_rows():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 11, generator=gen)
    index = torch.randint(0, 6, (300,), generator=gen)
    uids, positions = torch.arange(300), torch.randint(0, 50, (300,), generator=gen)
    for settings in (SamplingSettings(), SamplingSettings(temperature=0.5, top_p=0.9)):
        tok, lp = keyed_sample(logits, settings, 7, uids, positions, index=index)
        want_tok, want_lp = keyed_sample(logits[index], settings, 7, uids, positions)
        assert torch.equal(tok, want_tok) and torch.equal(lp, want_lp)
        assert len(set(tok.tolist())) > 3  # real samples
    empty = torch.zeros(0, dtype=torch.long)
    tok, lp = keyed_sample(logits, SamplingSettings(), 7, empty, empty, index=empty)
    assert tok.shape == (0,) and lp.shape == (0,)
    with pytest.raises(ValueError, match="one of index, exclude and residual_of"):
        keyed_sample(
            logits, SamplingSettings(), 7, uids, positions, exclude=torch.zeros(300, dtype=torch.long), index=index
        )


def _reference_walk(prompts, drafts, logits_of, settings, seed, uids):
    """Per row: follow the policy's keyed samples down a dict trie of the group's drafts."""
    out = []
    for b, p in enumerate(prompts):
        group = [d for q, d in zip(prompts, drafts) if q == p]
        prefix: list[int] = []
        while True:
            children = {d[len(prefix)] for d in group if len(d) > len(prefix) and d[: len(prefix)] == prefix}
            if not children:  # a leaf: every draft through it ends here
                out.append((prefix, None))
                break
            tok, lp = keyed_sample(
                logits_of(p, prefix), settings, seed, torch.tensor([uids[b]]), torch.tensor([len(p) + len(prefix)])
            )
            if int(tok) not in children:
                out.append((prefix, int(tok)))
                break
            prefix = prefix + [int(tok)]
    return out


@pytest.mark.parametrize("shared", [False, True])
def test_exact_walk_equals_a_plain_trie_walk(shared):
    settings = SamplingSettings(temperature=1.3)
    switched = 0  # rows that left the group's longest draft for another branch of the trie
    for seed in range(4):
        prompts, drafts = _groups(seed, n_groups=3, group_size=5)
        hidden, weight, _, same_as = _scores(prompts, drafts, seed, dtype=torch.float32)
        bias = torch.tensor([2.0, 2.0, 2.0, -3.0, -3.0])  # mostly the drafts' alphabet: walks go deep and branch
        scores = DraftScores(
            hidden_states=hidden, lm_head_weight=weight, lm_head_bias=bias, same_as=same_as if shared else None
        )
        table = {
            (tuple(p), tuple(d[:r])): hidden[b, r]
            for b, (p, d) in enumerate(zip(prompts, drafts))
            for r in range(len(d))
        }

        def logits_of(p, prefix, table=table, weight=weight, bias=bias):
            return torch.nn.functional.linear(table[(tuple(p), tuple(prefix))].unsqueeze(0), weight, bias).float()

        uids = [100 + 3 * b for b in range(len(drafts))]
        walk = walk_tries(prompts, drafts, scores, settings, seed, uids)
        want = _reference_walk(prompts, drafts, logits_of, settings, seed, uids)
        assert [(t, nt) for t, nt in zip(walk.tokens, walk.next_token)] == want
        for b in range(len(drafts)):
            assert walk.n[b] == len(walk.tokens[b]) == len(walk.logprobs[b])
            src = walk.source[b]
            assert prompts[src] == prompts[b] and drafts[src][: walk.n[b]] == walk.tokens[b]  # its K/V holds the prefix
        assert sum(walk.n) > 0 and any(t is not None for t in walk.next_token)
        longest = {tuple(p): max(len(d) for q, d in zip(prompts, drafts) if q == p) for p in prompts}
        switched += sum(len(drafts[walk.source[b]]) < longest[tuple(p)] for b, p in enumerate(prompts))
    assert switched > 0


def test_keyed_sample_refuses_bad_index_exclude_and_row_arguments():
    logits, s = torch.randn(3, 10), SamplingSettings()
    n5 = torch.arange(5)
    bad_index = [
        (torch.tensor([0, 1, 3, 0, 0]), ValueError, r"index holds values outside \[0, 3\)"),
        (torch.tensor([0, -1, 0, 0, 0]), ValueError, r"index holds values outside \[0, 3\)"),
        (torch.zeros(5), TypeError, "index must be an integer tensor"),
        (torch.zeros(5, dtype=torch.bool), TypeError, "index must be an integer tensor"),
        (torch.zeros(5, 1, dtype=torch.long), ValueError, r"index must have shape \[N\]"),
        ([0, 1, 2, 0, 1], TypeError, "index must be a 1-D integer torch.Tensor"),
    ]
    for index, err, match in bad_index:
        with pytest.raises(err, match=match):
            keyed_sample(logits, s, 0, n5, n5, index=index)
    with pytest.raises(ValueError, match=r"uids must have shape \[5\]"):
        keyed_sample(logits, s, 0, torch.arange(3), n5, index=torch.zeros(5, dtype=torch.long))
    # int32 is fine and gives the same tokens as int64
    got = keyed_sample(logits, s, 0, n5, n5, index=torch.tensor([0, 1, 2, 0, 1], dtype=torch.int32))
    want = keyed_sample(logits, s, 0, n5, n5, index=torch.tensor([0, 1, 2, 0, 1]))
    assert torch.equal(got[0], want[0])
    n3 = torch.arange(3)
    bad_exclude = [
        (torch.tensor([-1, 0, 0]), ValueError, r"exclude holds values outside \[0, 10\)"),
        (torch.tensor([10, 0, 0]), ValueError, r"exclude holds values outside \[0, 10\)"),
        (torch.tensor([1.0, 0.0, 0.0]), TypeError, "exclude must be an integer tensor"),
        (torch.tensor([1, 0]), ValueError, r"exclude must have shape \[3\]"),
    ]
    for exclude, err, match in bad_exclude:
        with pytest.raises(err, match=match):
            keyed_sample(logits, s, 0, n3, n3, exclude=exclude)
    with pytest.raises(ValueError, match=r"positions must have shape \[3\]"):
        keyed_sample(logits, s, 0, n3, torch.arange(4))
    with pytest.raises(ValueError, match=r"logits must be a \[N, V\] tensor"):
        keyed_sample(logits[0], s, 0, n3, n3)


def test_check_shared_outputs_accepts_the_truth_and_refuses_another_prefix():
    from spec_rl.backends.contract import BackendContractError, check_shared_outputs

    prompts, drafts = _groups(7)
    _, _, _, same_as = _scores(prompts, drafts, 7)
    check_shared_outputs(same_as, prompts, drafts, "B.score_drafts")  # the brute-force truth passes
    check_shared_outputs(None, prompts, drafts, "B.score_drafts")
    width = same_as.shape[1]
    wrong = 0
    for b, d in enumerate(drafts):  # point (b, r) at a representative of the same prompt whose prefix differs
        for c, e in enumerate(drafts):
            for r in range(1, min(len(d), len(e))):
                if prompts[b] == prompts[c] and d[:r] != e[:r] and int(same_as[c, r]) == c * width + r:
                    bad = same_as.clone()
                    bad[b, r] = c * width + r
                    with pytest.raises(BackendContractError, match=rf"same_as\[{b}, {r}\]"):
                        check_shared_outputs(bad, prompts, drafts, "B.score_drafts")
                    wrong += 1
    assert wrong > 0
