"""Scoring a group's trie a window at a time (spec_rl/backends/progressive.py) takes the walk's decisions of
scoring it in one forward, computes fewer nodes, and leaves a continuation the same keys and values."""

import pytest
import torch
from backend_jobs import continue_rows, generate
from tiny_models import tiny_model

from spec_rl.acceptance.exact_walk import walk_tries
from spec_rl.backends.paged.model_runner import CacheLayout
from spec_rl.backends.progressive import ProgressiveTreeScores
from spec_rl.backends.scoring import PolicyScorer
from spec_rl.backends.transformers_backend import TransformersBackend
from spec_rl.sampling.distribution import SamplingSettings
from spec_rl.sampling.groups import pack_groups


def _groups(model, seed: int, n_groups: int, group: int, length: int):
    """Prompts, drafts and their log-probs: G samples of the model itself per prompt (another seed), so walks
    go deep and switch between drafts that share prefixes."""
    gen = torch.Generator().manual_seed(seed)
    prompts = []
    for _ in range(n_groups):
        prompt = torch.randint(3, 12, (int(torch.randint(1, 7, (1,), generator=gen)),), generator=gen).tolist()
        prompts += [prompt] * group
    backend = TransformersBackend(model, {1}, 0)
    conts = generate(backend, prompts, [length] * len(prompts), SamplingSettings(max_tokens=length), seed=seed + 100)
    return prompts, [list(c.token_ids) for c in conts], [list(c.logprobs) for c in conts]


def _peaked_model(seed: int):
    """A float64 tiny model whose samples often repeat (walks then go deep and branch)."""
    model = tiny_model(vocab_size=12, seed=seed).double()
    with torch.no_grad():
        model.lm_head.weight.mul_(60.0)
    return model


@pytest.mark.parametrize(
    "seed,first_window,min_reach,impl",
    [
        (0, 1, None, "sdpa"),
        (1, 2, None, "sdpa"),
        (2, 3, 0.5, "eager"),
        (3, 4, 0.05, "sdpa"),
        (4, 2, 0.9, "sdpa"),
        (5, 16, 0.0, "sdpa"),
    ],
)
def test_progressive_walk_takes_the_one_forward_decisions(seed, first_window, min_reach, impl):
    model = _peaked_model(seed)
    prompts, drafts, logprobs = _groups(model, seed, n_groups=5, group=4, length=24)
    model.config._attn_implementation = impl  # after sampling the drafts: eager decoding of left padding is NaN
    drafts[0] = []  # an empty draft walks nowhere
    settings = SamplingSettings(temperature=1.0, max_tokens=32)
    uids = list(range(len(drafts)))
    scorer = PolicyScorer(model, pad_id=0, max_tokens_per_forward=64)  # several chunks
    with torch.no_grad():
        full = scorer.score(prompts, drafts)
        want = walk_tries(prompts, drafts, full, settings, 5, uids)
        lazy = ProgressiveTreeScores(
            scorer, prompts, drafts, None if min_reach is None else logprobs, first_window, min_reach=min_reach or 0.0
        )
        got = walk_tries(prompts, drafts, lazy.scores, settings, 5, uids, progressive=lazy)
    assert got.n == want.n and got.source == want.source and got.tokens == want.tokens
    assert got.next_token == want.next_token
    assert [lp is None for lp in got.next_logprob] == [lp is None for lp in want.next_logprob]
    for a, b in zip(got.logprobs + [got.next_logprob], want.logprobs + [want.next_logprob]):
        a, b = [x for x in a if x is not None], [x for x in b if x is not None]
        assert a == pytest.approx(b, rel=4e-6, abs=1e-6)  # log-probs come back in float32
    assert max(want.n) > 2 * first_window or min_reach is not None, want.n  # walks went past the first windows
    trie = {(tuple(p), tuple(d[: k + 1])) for p, d in zip(prompts, drafts) for k in range(len(d))}
    total = sum(len(p) for p in {tuple(p) for p in prompts}) + len(trie)
    if min_reach == 0.0:
        assert lazy.scored_nodes == total  # reach 0: the whole trie in the first pass
    else:
        assert lazy.scored_nodes < total  # subtrees every walk had left were never computed
    # the continuation's context: the keys and values of a plain forward over [prompt, draft[:n]] (a walk that
    # ended at a draft's end continues, when it continues, by feeding that draft's last token: n - 1 cached)
    for row in range(len(drafts)):
        src, n = got.source[row], got.n[row] - (got.next_token[row] is None and got.n[row] > 0)
        with torch.no_grad():
            plain = model(input_ids=torch.tensor([prompts[src] + drafts[src][:n]]), use_cache=True).past_key_values
        tol = 1e-9 if impl == "sdpa" else 1e-6  # transformers' eager attention takes its softmax in float32
        for (k, v), layer in zip(lazy.context(src, n), plain.layers):
            assert torch.allclose(k, layer.keys[0], atol=tol) and torch.allclose(v, layer.values[0], atol=tol)


def test_extend_scores_the_next_window_and_released_scores_are_refused():
    model = _peaked_model(0)
    prompts, drafts = [[3, 4]] * 2, [[5, 6, 7, 8, 9], [5, 6, 7]]
    with torch.no_grad():
        lazy = ProgressiveTreeScores(PolicyScorer(model, pad_id=0), prompts, drafts, first_window=2)
        assert lazy.scored_len == [0, 0] and lazy.scored_nodes == 0  # nothing before a walk opens the chunk
        lazy.open(0)
        assert lazy.scored_len == [2, 2]
        lazy.extend([(0, 2)])
        assert lazy.scored_len == [4, 3]  # the next window below the stop (the shorter draft shares the nodes)
        lazy.extend([(0, 4)])
        assert lazy.scored_len == [5, 3] and lazy.chunks[0].window == 5  # doubling stops at the longest draft
        lazy.release()
        for call in (lambda: lazy.open(0), lambda: lazy.context(0, 1)):
            with pytest.raises(RuntimeError, match="released"):
                call()
    with torch.no_grad():  # a window past the longest draft scores what the longest draft needs, no more
        huge = ProgressiveTreeScores(PolicyScorer(model, pad_id=0), prompts, drafts, first_window=2**64)
        huge.open(0)
        assert huge.scored_len == [5, 3] and huge.chunks[0].window == 5


def test_the_walk_samples_in_bounded_pieces_with_the_same_decisions(monkeypatch):
    """A late pass samples rows x window positions; the logits of one sampling call stay within LOGITS_BYTES and the
    keyed samples do not depend on where the positions are cut."""
    import spec_rl.acceptance.exact_walk as walk

    model = _peaked_model(6)
    prompts, drafts, _ = _groups(model, 6, n_groups=4, group=4, length=24)
    settings, uids = SamplingSettings(temperature=1.0, max_tokens=32), list(range(len(drafts)))
    monkeypatch.setattr(walk, "_FIRST_WINDOW", 2)  # several doubling passes
    with torch.no_grad():
        scores = PolicyScorer(model, pad_id=0).score(prompts, drafts)
        want = walk_tries(prompts, drafts, scores, settings, 5, uids)
        vocab, calls = scores.lm_head_weight.shape[0], []
        inner = walk.keyed_sample
        monkeypatch.setattr(walk, "LOGITS_BYTES", 3 * 4 * vocab)  # three positions a call
        monkeypatch.setattr(
            walk, "keyed_sample", lambda logits, *a, **k: calls.append(len(logits)) or inner(logits, *a, **k)
        )
        got = walk_tries(prompts, drafts, scores, settings, 5, uids)
    assert (got.n, got.source, got.tokens, got.next_token) == (want.n, want.source, want.tokens, want.next_token)
    assert got.logprobs == want.logprobs and max(want.n) > 2 + 4  # past the first two passes
    assert max(calls) <= 3 and sum(calls) > 3 * 8


def test_every_forward_holds_at_most_max_tokens_per_forward_queries(monkeypatch):
    """A late window covers whole subtrees; it is scored in pieces (ancestors first) with the same decisions."""
    model = _peaked_model(7)
    prompts, drafts, logprobs = _groups(model, 7, n_groups=3, group=4, length=24)
    settings, uids = SamplingSettings(temperature=1.0, max_tokens=32), list(range(len(drafts)))
    scorer = PolicyScorer(model, pad_id=0, max_tokens_per_forward=16)
    sizes, inner = [], ProgressiveTreeScores._forward
    monkeypatch.setattr(
        ProgressiveTreeScores,
        "_forward",
        lambda self, chunk, nodes: sizes.append(len(nodes) * max(len(x) for x in nodes)) or inner(self, chunk, nodes),
    )
    with torch.no_grad():
        want = walk_tries(prompts, drafts, scorer.score(prompts, drafts), settings, 5, uids)
        lazy = ProgressiveTreeScores(scorer, prompts, drafts, logprobs, first_window=2)
        got = walk_tries(prompts, drafts, lazy.scores, settings, 5, uids, progressive=lazy)
    assert (got.n, got.source, got.tokens, got.next_token) == (want.n, want.source, want.tokens, want.next_token)
    assert max(want.n) > 8 and len(sizes) > 6 and max(sizes) <= 16, (want.n, sizes)


def test_walks_hold_the_keys_and_values_of_one_bounded_chunk_at_a_time(monkeypatch):
    """Without a splicing continuation, a chunk's K/V go when its walks end: the walk holds one chunk's K/V at a
    time, a chunk's tries hold at most ``max_kv_tokens`` nodes (or one group), and the decisions do not change."""
    model = _peaked_model(8)
    prompts, drafts, logprobs = _groups(model, 8, n_groups=6, group=4, length=24)
    settings, uids = SamplingSettings(temperature=1.0, max_tokens=32), list(range(len(drafts)))
    token_bytes = CacheLayout.of(model).bytes_per_block(1)
    tries = sorted(len(g.tokens) for g in pack_groups(prompts, drafts))
    bound = 2 * (tries[-1] + tries[-2])  # any two groups share a chunk, no three
    scorer = TransformersBackend(model, {1}, 0, kv_cache_bytes=bound * token_bytes).scorer
    assert scorer.max_kv_tokens == bound
    live, held, inner = [], [], ProgressiveTreeScores._forward

    def counted(self, chunk, nodes):
        inner(self, chunk, nodes)
        live.append(sum(c.cache is not None for c in self.chunks))
        keys = chunk.cache.layers[0].keys  # [rows, heads, columns, dim]: padded to the widest row
        held.append((keys.shape[0] * keys.shape[2], sum(len(g.tokens) for g in chunk.groups)))

    monkeypatch.setattr(ProgressiveTreeScores, "_forward", counted)
    with torch.no_grad():
        want = walk_tries(prompts, drafts, scorer.score(prompts, drafts), settings, 5, uids)
        lazy = ProgressiveTreeScores(scorer, prompts, drafts, logprobs, first_window=2, keep_kv=False)
        got = walk_tries(prompts, drafts, lazy.scores, settings, 5, uids, progressive=lazy)
    assert (got.n, got.source, got.tokens, got.next_token) == (want.n, want.source, want.tokens, want.next_token)
    sizes = [(len(c.groups), sum(len(g.tokens) for g in c.groups)) for c in lazy.chunks]
    assert 1 < len(sizes) < 6 and all(rows * n <= bound or rows == 1 for rows, n in sizes), sizes
    assert max(live) == 1 and all(c.cache is None and c.dropped for c in lazy.chunks), live
    assert all(positions <= max(bound, nodes) for positions, nodes in held), (held, bound)  # padding included
    with pytest.raises(RuntimeError, match="dropped"):
        lazy.context(0, 1)


def test_kept_scoring_kv_fit_kv_cache_bytes_padding_included():
    """A splicing backend keeps the scoring K/V only when their padded size fits ``kv_cache_bytes``: one deep walk
    pads every row of its chunk, which a count of prompt and draft tokens would miss."""
    model = _peaked_model(9)
    prompts, drafts, logprobs = _groups(model, 9, n_groups=4, group=3, length=20)
    settings, uids = SamplingSettings(temperature=1.0, max_tokens=32), list(range(len(drafts)))
    token_bytes = CacheLayout.of(model).bytes_per_block(1)
    tokens = sum(len(p) + len(d) for p, d in zip(prompts, drafts))
    for budget in (tokens, 10 * tokens):
        backend = TransformersBackend(model, {1}, 0, kv_cache_bytes=budget * token_bytes)
        with torch.no_grad():
            scored = backend.score(prompts, drafts, logprobs)
            lazy = scored.progressive
            walk_tries(prompts, drafts, lazy.scores, settings, 5, uids, progressive=lazy)
        held = sum(2 * layer.keys.numel() for c in lazy.chunks if c.cache is not None for layer in c.cache.layers)
        assert held * model.dtype.itemsize <= backend.kv_cache_bytes
        assert (scored.state is lazy) == (budget > tokens) and (held > 0) == (budget > tokens), (budget, held)
        backend.release(scored)


def test_bad_progressive_settings_are_refused():
    model = _peaked_model(0)
    scorer = PolicyScorer(model, pad_id=0)
    for kwargs, match in (
        ({"first_window": 0}, "first_window must be >= 1"),
        ({"min_reach": 2.0}, "min_reach must be in"),
        ({"min_reach": float("nan")}, "min_reach must be in"),
    ):
        with pytest.raises(ValueError, match=match):
            ProgressiveTreeScores(scorer, [[3]], [[5, 6]], **kwargs)
    with pytest.raises(ValueError, match="kv_cache_bytes=1 holds no token's K/V"):
        TransformersBackend(model, {1}, 0, kv_cache_bytes=1)


def test_positive_stored_logprobs_do_not_lift_a_node_above_its_parent():
    """A custom store may hold log-probs > 0: the first pass clamps them, so a kept node keeps its ancestors
    and the walk takes the one forward's decisions (an unclamped +10 below a -5 kept a child without its parent)."""
    model = _peaked_model(11)
    prompts, drafts, logprobs = _groups(model, 11, n_groups=3, group=4, length=16)
    logprobs = [[-5.0, 10.0] + [-0.01] * (len(lp) - 2) for lp in logprobs]
    settings, uids = SamplingSettings(temperature=1.0, max_tokens=32), list(range(len(drafts)))
    scorer = PolicyScorer(model, pad_id=0)
    with torch.no_grad():
        want = walk_tries(prompts, drafts, scorer.score(prompts, drafts), settings, 5, uids)
        lazy = ProgressiveTreeScores(scorer, prompts, drafts, logprobs, first_window=2)
        for chunk in range(len(lazy.chunks)):
            lazy.open(chunk)
        # the prompt scores each first token; reach e^-5 x 4 < 0.05 after it, so nothing below it is scored
        assert lazy.scored_len == [1] * len(drafts)
        got = walk_tries(prompts, drafts, lazy.scores, settings, 5, uids, progressive=lazy)
    assert (got.n, got.source, got.tokens, got.next_token) == (want.n, want.source, want.tokens, want.next_token)


def test_a_failed_forward_releases_the_scores_and_the_backend_releases_them_too(monkeypatch):
    model = _peaked_model(0)
    prompts, drafts = [[3, 4]] * 2, [[5, 6, 7, 8, 9], [5, 6, 7]]
    scorer = PolicyScorer(model, pad_id=0)
    with torch.no_grad():
        lazy = ProgressiveTreeScores(scorer, prompts, drafts, first_window=2)
        lazy.open(0)
        target = scorer.head.decoder if scorer.head.uses_hidden_states else model  # the module each forward calls
        with monkeypatch.context() as patch:
            patch.setattr(target, "forward", lambda **_: (_ for _ in ()).throw(MemoryError("out of memory")))
            with pytest.raises(MemoryError):
                lazy.extend([(0, 2)])
        assert lazy.scored_len == [2, 2] and lazy.released  # nothing half-updated is used again
        with pytest.raises(RuntimeError, match="released"):
            lazy.context(0, 2)
    backend = TransformersBackend(model, {1}, 0)
    lps = [[-0.1] * len(d) for d in drafts]
    for finish in ("release", "continue"):
        scored = backend.score(prompts, drafts, lps)
        lazy = scored.progressive
        if finish == "release":
            backend.release(scored)
        else:
            continue_rows(backend, scored, [1, 1], [6, 6], [2, 2], SamplingSettings(max_tokens=4), seed=0)
        assert lazy.released and all(chunk.cache is None for chunk in lazy.chunks)


def test_backend_offers_progressive_scoring_only_with_tree_layout_and_logprobs():
    model = _peaked_model(0)
    prompts, drafts = [[3, 4]] * 2, [[5, 6], [5, 7]]
    lps = [[-0.1, -0.2], [-0.1, -3.0]]
    spliced = TransformersBackend(model, {1}, 0).score(prompts, drafts, lps)
    assert isinstance(spliced.progressive, ProgressiveTreeScores) and spliced.state is spliced.progressive
    assert TransformersBackend(model, {1}, 0).score(prompts, drafts).progressive is None  # no log-probs: all of it
    plain = TransformersBackend(model, {1}, 0, splice=False)
    scored = plain.score(prompts, drafts, lps)  # scored progressively, continued by re-prefill
    lazy = scored.progressive
    assert scored.state is None and isinstance(lazy, ProgressiveTreeScores)
    plain.release(scored)
    assert lazy.released and all(chunk.cache is None for chunk in lazy.chunks)
    rows = TransformersBackend(model, {1}, 0)
    rows.scorer.tree = False
    assert rows.score(prompts, drafts, lps).progressive is None
    with pytest.raises(ValueError):
        TransformersBackend(model, {1}, 0).score([[3, 99]], [[5]], [[-1.0]])  # id outside the vocabulary


@pytest.mark.parametrize("min_reach, splice", [(0.05, True), (0.9, True), (0.9, False)])
def test_exact_rollout_with_progressive_scores_is_fresh_decoding(monkeypatch, min_reach, splice):
    """The rollout takes the progressive path under exact acceptance (and only there), and its responses are
    token for token those of fresh keyed decoding, also when most walks need :meth:`extend`, and also when the
    continuation re-prefills (the path of every re-prefilling backend, the vLLM backend among them)."""
    from spec_rl.acceptance.mode import MODES, RolloutMode
    from spec_rl.acceptance.rules import Exact, Lenient
    from spec_rl.backends import progressive
    from spec_rl.drafts.cache import RolloutCache
    from spec_rl.rollout.speculative import RolloutRequest, SpeculativeRollout

    # the backend builds ProgressiveTreeScores with the defaults of (draft_logprobs, first_window, min_reach); it
    # passes keep_kv itself
    monkeypatch.setattr(progressive.ProgressiveTreeScores.__init__, "__defaults__", (None, 4, min_reach, True))
    model = _peaked_model(7)
    settings = SamplingSettings(temperature=1.0, max_tokens=20)
    requests = [RolloutRequest([3 + i, 4, 5], s, dataset_id=f"q{i}") for i in range(4) for s in range(3)]
    calls = {"progressive": 0, "extend": 0}
    real_extend = progressive.ProgressiveTreeScores.extend

    def counted_extend(self, stops):
        calls["extend"] += 1
        return real_extend(self, stops)

    monkeypatch.setattr(progressive.ProgressiveTreeScores, "extend", counted_extend)

    def rollout(mode, cache):
        backend = TransformersBackend(model, {1}, pad_id=0, splice=splice)
        real = backend.score

        def counted(prompts, drafts, logprobs=None):
            calls["progressive"] += logprobs is not None
            return real(prompts, drafts, logprobs)

        backend.score = counted
        # seed 6: a draw whose walks outgrow the first window (extend runs at min_reach 0.9)
        return SpeculativeRollout(backend, cache, settings, [1], 64, mode=mode, seed=6)

    vanilla = MODES["vanilla"]
    cache = RolloutCache()
    rollout(vanilla, cache).run(requests, step=0)
    rollout(RolloutMode(Lenient(1.0), tail=0), RolloutCache()).run(requests, step=0)
    assert calls["progressive"] == 0  # never for lenient acceptance
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    exact = rollout(RolloutMode(Exact(), tail=0), cache).run(requests, step=1)
    fresh = rollout(vanilla, RolloutCache()).run(requests, step=1)
    assert calls["progressive"] == 1 and exact.stats.accepted_tokens > 0
    if min_reach == 0.9:
        assert calls["extend"] > 0  # walks went past the first pass
    assert exact.response_ids == fresh.response_ids
    for a, b in zip(exact.logprobs, fresh.logprobs):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5)
