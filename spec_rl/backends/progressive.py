"""Scoring a group's draft trie only where exact walks may read it (docs/design.md "Exact acceptance"): first the nodes
reached with estimated probability >= :data:`MIN_REACH`, then below waiting walks on demand. Ancestors are scored first
and their K/V kept, so every score equals the one-forward score up to summation order. Walks go one chunk of groups at
a time, and a chunk's K/V, bounded by the scorer's ``max_kv_tokens``, go when its walks end unless a continuation
splices them. A chunk's cache is padded (every forward adds the widest row's columns to every row), so the bound is
rows x the nodes of its tries."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..acceptance.scores import DraftScores
from ..sampling.groups import PackedGroup, RowContext, chunk_rows, int64_tensor, pack_groups
from ..util.validation import check_int
from .hf_decode import cache_argument, model_mask, returned_cache

#: Draft tokens below a stop that one :meth:`ProgressiveTreeScores.extend` scores first; it doubles per call.
FIRST_WINDOW = 16
#: First pass: nodes some sample reaches with at least this probability (from the stored log-probs).
MIN_REACH = 0.05


class _Chunk:
    """One forward batch of groups (one per row), the K/V of its scored nodes, an ``entry_*`` per (draft, token);
    ``first``: the first pass's nodes per row until it is scored; ``window``: what its next extend scores."""

    def __init__(self, groups: list[PackedGroup], first: list[torch.Tensor], window: int):
        self.groups = groups
        self.first: list[torch.Tensor] | None = first
        self.window = window
        self.dropped = False  # its K/V were dropped after its walks (nothing continues from them)
        self.cache = None  # the transformers cache of every scored node, in scoring order
        self.key_node = torch.zeros((len(groups), 0), dtype=torch.long)  # tree index of each cache column (-1: padding)
        self.key_size = torch.zeros((len(groups), 0), dtype=torch.long)  # its subtree size (0: padding)
        self.depth = [int64_tensor(g.depth) for g in groups]
        self.size = [int64_tensor(g.size) for g in groups]
        self.tokens = [int64_tensor(g.tokens) for g in groups]
        self.column = torch.full((len(groups), max(len(g.tokens) for g in groups)), -1, dtype=torch.long)  # per node
        self.drafts = [d for g in groups for d in g.members]
        self.lengths = counts = int64_tensor([len(p) for g in groups for p in g.score_pos])
        self.entry_row = torch.repeat_interleave(
            torch.arange(len(groups)), int64_tensor([sum(len(p) for p in g.score_pos) for g in groups])
        )
        self.entry_node = int64_tensor([t for g in groups for p in g.score_pos for t in p])
        self.entry_local = torch.repeat_interleave(torch.arange(len(self.drafts)), counts)
        self.entry_draft = int64_tensor(self.drafts)[self.entry_local] if self.drafts else self.entry_local
        self.entry_i = torch.arange(len(self.entry_node)) - torch.repeat_interleave(
            torch.cumsum(counts, 0) - counts, counts
        )

    def scored_lengths(self) -> list[int]:
        """Per draft of ``drafts``: how many leading tokens have their scoring node computed."""
        missing = torch.where(
            self.column[self.entry_row, self.entry_node] >= 0,
            self.lengths.max() if len(self.lengths) else 0,
            self.entry_i,
        )
        first = self.lengths.clone().scatter_reduce(0, self.entry_local, missing, "amin")
        return first.tolist()


class ProgressiveTreeScores:
    """Scores of B drafts, computed where walks may need them (valid for token i < ``scored_len[b]`` of draft b).

    The groups are cut into chunks (one forward batch each, whose padded K/V, rows x the nodes of their tries, hold
    at most the scorer's ``max_kv_tokens`` positions, one group at least); a walk opens a chunk (:meth:`open`: its
    first pass), extends it (:meth:`extend`) and closes it (:meth:`close`). ``draft_logprobs`` (stored, per draft)
    pick the first pass (None: the first ``first_window`` tokens); ``first_window`` (>= 1) is what the first
    :meth:`extend` of a chunk scores below a stop, doubling per call; ``min_reach`` (in [0, 1]) 0 scores the whole
    trie; ``keep_kv`` False (or a predicate of :meth:`kv_positions` that says so) drops a chunk's K/V when it is
    closed (no :meth:`context` for it afterwards).
    """

    def __init__(
        self,
        scorer,
        prompts: Sequence[Sequence[int]],
        drafts: Sequence[Sequence[int]],
        draft_logprobs: Sequence[Sequence[float]] | None = None,
        first_window: int = FIRST_WINDOW,
        min_reach: float = MIN_REACH,
        keep_kv=True,
    ):
        if draft_logprobs is not None:  # as float64, cut to the drafts
            draft_logprobs = [
                torch.as_tensor(lp[: len(d)], dtype=torch.float64).reshape(-1) for lp, d in zip(draft_logprobs, drafts)
            ]
        self.scorer = scorer
        self.lengths = [len(d) for d in drafts]
        self.max_r = max(self.lengths + [1])
        width = scorer.head.width
        self._out = torch.zeros(
            (len(drafts), self.max_r, width), dtype=scorer.head.lm_head.weight.dtype, device=scorer.device
        )
        self._same = torch.arange(len(drafts) * self.max_r, device=scorer.device).view(len(drafts), self.max_r)
        self.scores: DraftScores = scorer.head.draft_scores(self._out, self._same)
        self.scored_len = [0] * len(drafts)
        self.scored_nodes = 0
        self.released = False
        first_window = check_int("first_window", first_window, low=1)
        if not 0.0 <= float(min_reach) <= 1.0:
            raise ValueError(f"min_reach must be in [0, 1] (a probability), got {min_reach}")
        window = min(first_window, self.max_r)  # a wider window scores nothing more
        groups = pack_groups(prompts, drafts)
        first = [_first_pass(g, draft_logprobs, float(min_reach), window) for g in groups]
        order = _cap_chunks(
            chunk_rows([len(x) for x in first], scorer.max_tokens_per_forward),
            [len(g.tokens) for g in groups],
            scorer.max_kv_tokens,
        )
        self.chunks = [_Chunk([groups[i] for i in rows], [first[i] for i in rows], window) for rows in order]
        self.where: dict[int, tuple[int, int, int]] = {}  # draft -> (chunk, row, member)
        for c, chunk in enumerate(self.chunks):
            for row, g in enumerate(chunk.groups):
                for m, d in enumerate(g.members):
                    self.where[d] = (c, row, m)
        self.keep_kv = bool(keep_kv(self.kv_positions()) if callable(keep_kv) else keep_kv)

    def kv_positions(self) -> int:
        """The most K/V token positions these scores hold at once when every chunk is kept: rows x the nodes of its
        tries, summed over the chunks (a continuation that splices them keeps them all)."""
        return sum(len(c.groups) * sum(len(g.tokens) for g in c.groups) for c in self.chunks)

    def by_chunk(self, drafts: Sequence[int]) -> list[tuple[int, list[int]]]:
        """``drafts`` as (chunk, its drafts in the given order), in chunk order: walks go one chunk at a time."""
        per: dict[int, list[int]] = {}
        for d in drafts:
            per.setdefault(self.where[d][0], []).append(d)
        return sorted(per.items())

    def open(self, chunk: int) -> None:
        """Score the first pass of ``chunk`` (once)."""
        self._check_live(chunk)
        c = self.chunks[chunk]
        if c.first is not None:
            nodes, c.first = c.first, None
            self._score_nodes(c, nodes)

    def close(self, chunk: int) -> None:
        """The walks of ``chunk`` ended: drop its K/V unless they are kept for a continuation."""
        if not self.keep_kv:
            c = self.chunks[chunk]
            c.cache, c.dropped = None, True

    def extend(self, stops: Sequence[tuple[int, int]]) -> None:
        """Score below each stop (draft, n = ``scored_len[draft]``, inside the draft, its chunk open)."""
        roots: dict[int, dict[int, list[tuple[int, int]]]] = {}  # chunk -> row -> (root node, n)
        for d, n in stops:
            assert n == self.scored_len[d] and 0 < n < self.lengths[d], (d, n, self.scored_len[d])
            c, row, m = self.where[d]
            roots.setdefault(c, {}).setdefault(row, []).append((self.chunks[c].groups[row].node_pos[m][n - 1], n))
        for c, rows in roots.items():
            self._check_live(c)
            chunk = self.chunks[c]
            nodes = [_subtree_nodes(chunk, row, rows.get(row, ()), chunk.window) for row in range(len(chunk.groups))]
            chunk.window = min(2 * chunk.window, self.max_r)
            self._score_nodes(chunk, nodes)

    def prompt_len(self, draft: int) -> int:
        c, row, _ = self.where[draft]
        return self.chunks[c].groups[row].prompt_len

    def context(self, draft: int, n: int) -> RowContext:
        """The K/V of [prompt, the draft's first n tokens] (all of them scored), gathered per layer when read."""
        c, row, m = self.where[draft]
        self.open(c)  # a continuation without a walk reads the first pass
        chunk = self.chunks[c]
        cols = chunk.column[row, int64_tensor(chunk.groups[row].path(m, n))]
        assert bool((cols >= 0).all()), f"context of draft {draft} up to {n} tokens holds unscored nodes"
        layers = [(layer.keys, layer.values) for layer in chunk.cache.layers]
        return RowContext(layers, row, cols.to(layers[0][0].device))

    def release(self) -> None:
        """Drop the kept keys and values."""
        self.released = True
        for chunk in self.chunks:
            chunk.cache = None

    def _check_live(self, chunk: int) -> None:
        if self.released:
            raise RuntimeError(
                "these scores' keys and values were released (continued, released, or a scoring forward failed): "
                "score the drafts again"
            )
        if self.chunks[chunk].dropped:
            raise RuntimeError(
                f"chunk {chunk}'s keys and values were dropped when its walks ended (keep_kv=False): score again"
            )

    @torch.inference_mode()
    def _score_nodes(self, chunk: _Chunk, nodes: list[torch.Tensor]) -> None:
        """Forward the given nodes of ``chunk`` (tree indices per row), then update ``scored_len``. A forward holds at
        most ``max_tokens_per_forward`` query rows x columns (a late window would otherwise build attention of rows x
        its whole subtrees at once): each row's nodes go in consecutive pieces, ancestors first (preorder)."""
        width = max(1, self.scorer.max_tokens_per_forward // len(nodes))
        for start in range(0, max(len(x) for x in nodes), width):
            self._forward(chunk, [x[start : start + width] for x in nodes])
        if any(len(x) for x in nodes):
            for d, n in zip(chunk.drafts, chunk.scored_lengths()):
                self.scored_len[d] = n

    def _forward(self, chunk: _Chunk, nodes: list[torch.Tensor]) -> None:
        scorer = self.scorer
        rows, width = len(nodes), max(1, max(len(x) for x in nodes))
        past = chunk.key_node.shape[1]
        query = torch.full((rows, width), -1, dtype=torch.long)
        ids = torch.full((rows, width), scorer.pad_id, dtype=torch.long)
        pos = torch.zeros((rows, width), dtype=torch.long)
        size = torch.zeros((rows, width), dtype=torch.long)
        for row, x in enumerate(nodes):
            k = len(x)
            query[row, :k] = x
            ids[row, :k] = chunk.tokens[row][x]
            pos[row, :k] = chunk.depth[row][x]
            size[row, :k] = chunk.size[row][x]
        keys = torch.cat([chunk.key_node, query], dim=1)
        key_size = torch.cat([chunk.key_size, size], dim=1)
        dev = scorer.device
        mask = _ancestor_mask(query, keys, key_size, past).unsqueeze(1).to(dev)
        mask = model_mask(scorer.model, mask, scorer.head.lm_head.weight.dtype)
        hidden = scorer.head.uses_hidden_states
        target = scorer.head.decoder if hidden else scorer.model
        extra = {} if chunk.cache is None else {cache_argument(target): chunk.cache}
        try:
            res = target(input_ids=ids.to(dev), position_ids=pos.to(dev), attention_mask=mask, use_cache=True, **extra)
        except BaseException:
            self.release()  # the cache grows layer by layer: not to be trusted after a failure
            raise
        chunk.cache = returned_cache(target, res)
        chunk.key_node, chunk.key_size = keys, key_size
        for row, x in enumerate(nodes):
            chunk.column[row, x] = past + torch.arange(len(x))
        states = res.last_hidden_state if hidden else res.logits
        self.scored_nodes += sum(len(x) for x in nodes)
        self._gather(chunk, states, query)

    def _gather(self, chunk: _Chunk, states: torch.Tensor, query: torch.Tensor) -> None:
        """Copy the forward's outputs to the draft tokens they score; link shared outputs."""
        width = query.shape[1]
        rows, cols = torch.nonzero(query >= 0, as_tuple=True)
        in_query = torch.full(chunk.column.shape, -1, dtype=torch.long)  # per node: its column in this forward
        in_query[rows, query[rows, cols]] = cols
        col = in_query[chunk.entry_row, chunk.entry_node]
        hit = col >= 0
        if not bool(hit.any()):
            return
        src_t = chunk.entry_row[hit] * width + col[hit]
        dst_t = chunk.entry_draft[hit] * self.max_r + chunk.entry_i[hit]
        dev = states.device
        flat = self._out.view(-1, self._out.shape[-1])
        flat.index_copy_(
            0, dst_t.to(dev), states.reshape(-1, states.shape[-1]).index_select(0, src_t.to(dev)).to(flat.dtype)
        )
        distinct, inverse = torch.unique(src_t, return_inverse=True)
        first = torch.full((len(distinct),), flat.shape[0], dtype=torch.long).scatter_reduce(0, inverse, dst_t, "amin")
        self._same.view(-1)[dst_t.to(self._same.device)] = first[inverse].to(self._same.device)


def _cap_chunks(chunks: list[list[int]], tokens: Sequence[int], max_tokens: int | None) -> list[list[int]]:
    """``chunks`` of groups cut further so that rows x the nodes of their tries (what a chunk's padded K/V may reach:
    every forward pads every row to its widest) stay within ``max_tokens`` (one group at least)."""
    if max_tokens is None:
        return chunks
    out: list[list[int]] = []
    for rows in chunks:
        current: list[int] = []
        nodes = 0
        for i in rows:
            if current and (len(current) + 1) * (nodes + tokens[i]) > max_tokens:
                out.append(current)
                current, nodes = [], 0
            current.append(i)
            nodes += tokens[i]
        out.append(current)
    return out


def _first_pass(g: PackedGroup, logprobs, min_reach: float, window: int) -> torch.Tensor:
    """Tree indices of the first pass: the prompt and nodes reached with estimated probability >= ``min_reach`` (or the
    first ``window`` tokens); both keep every ancestor."""
    depth = int64_tensor(g.depth)
    if logprobs is None:
        return torch.nonzero(depth < g.prompt_len + window - 1).flatten()
    keep = torch.zeros(len(g.tokens), dtype=torch.bool)
    keep[: g.prompt_len] = True
    floor = math.log(min_reach / len(g.members)) if min_reach > 0 else -math.inf
    for m, d in enumerate(g.members):
        if g.node_pos[m]:
            # Clamped to <= 0 so the reach only falls along a path and a kept node keeps its ancestors.
            lps = logprobs[d][: len(g.node_pos[m])].clamp(max=0.0)
            reach = torch.cumsum(lps, 0)
            keep[int64_tensor(g.node_pos[m])[reach >= floor]] = True
    return torch.nonzero(keep).flatten()


def _subtree_nodes(chunk: _Chunk, row: int, roots, window: int) -> torch.Tensor:
    """Unscored nodes below each (root, n): the root's subtree down to the draft tokens below n + ``window``."""
    g = chunk.groups[row]
    want = torch.zeros(len(g.tokens), dtype=torch.bool)
    for root, n in roots:
        end = root + int(chunk.size[row][root])
        want[root:end] |= chunk.depth[row][root:end] < g.prompt_len + n + window - 1
    want &= chunk.column[row, : len(g.tokens)] < 0
    return torch.nonzero(want).flatten()


def _ancestor_mask(query: torch.Tensor, keys: torch.Tensor, key_size: torch.Tensor, past: int) -> torch.Tensor:
    """[rows, Tq, Tk] bool: query i sees key j iff j <= i < j + size[j] (preorder ancestors); padding sees itself."""
    q = query.unsqueeze(2)
    k, s = keys.unsqueeze(1), key_size.unsqueeze(1)
    mask = (k >= 0) & (k <= q) & (q < k + s)
    pad_rows, pad_cols = torch.nonzero(query < 0, as_tuple=True)
    mask[pad_rows, pad_cols, past + pad_cols] = True
    return mask
