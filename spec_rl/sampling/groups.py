"""Tree-packed scoring (docs/design.md "Scoring the group once"): a group's prompt once, then the trie of its drafts in
preorder, in one row whose 4-D mask lets each token see exactly its ancestors (the subtree of node j is
``[j, j + size[j])``) at positions equal to its depth. Draft token i is scored at the node of token i - 1, token 0 at
the last prompt token."""

from __future__ import annotations

import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from ..util.model_config import model_may_slide

#: attention implementations whose masks we know how to build (bool for sdpa, additive for eager)
TREE_ATTENTION_IMPLEMENTATIONS = ("sdpa", "eager")


def int64_tensor(values: Iterable[int]) -> torch.Tensor:
    """A CPU int64 tensor of Python ints, built through ``array.array`` (faster than ``torch.tensor`` on a list)."""
    buf = array.array("q", values)
    return torch.frombuffer(buf, dtype=torch.int64) if len(buf) else torch.zeros(0, dtype=torch.int64)


def rows_by_prompt(prompts: Sequence[Sequence[int]]) -> dict[tuple[int, ...], list[int]]:
    """Row indices grouped by prompt (identical token ids), groups in order of first appearance."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, p in enumerate(prompts):
        groups.setdefault(tuple(p) if isinstance(p, list) else tuple(int(t) for t in p), []).append(i)
    return groups


def as_id_lists(seqs: Sequence[Sequence[int]]) -> list[list[int]]:
    """Each sequence as a list of ints (lists are taken as they are: the rollout passes int lists)."""
    return [s if isinstance(s, list) else [int(t) for t in s] for s in seqs]


@dataclass
class PackedGroup:
    """One packed row in preorder: per position its token, ``depth`` (position id) and subtree ``size``; the caller's
    indices of the drafts packed here (``members``) and, per member, the positions of its tokens (``node_pos``) and
    of the outputs that score them (``score_pos``)."""

    tokens: list[int]
    depth: list[int]
    size: list[int]
    members: list[int] = field(default_factory=list)
    score_pos: list[list[int]] = field(default_factory=list)
    node_pos: list[list[int]] = field(default_factory=list)
    prompt_len: int = 0

    def path(self, member: int, n: int) -> list[int]:
        """Positions of [prompt, the member's first n tokens]: its KV context after a cut at n."""
        return list(range(self.prompt_len)) + self.node_pos[member][:n]


def _pack_group(prompt: Sequence[int], drafts: Sequence[Sequence[int]], members: list[int]) -> PackedGroup:
    """The trie in preorder: in lexicographic order each draft adds its tokens after the longest common prefix (LCP)
    with the previous one; the subtree of draft j's node at depth e ends where the next draft with LCP <= e begins."""
    plen = len(prompt)
    order = sorted(range(len(drafts)), key=lambda k: drafts[k])
    tokens, depth = list(prompt), list(range(plen))
    node_pos: list[list[int]] = [[] for _ in drafts]
    laid = []  # per sorted draft: (first new position, LCP, length)
    prev: list[int] = []
    for k in order:
        d = drafts[k]
        lcp, most = 0, min(len(prev), len(d))
        while lcp < most and prev[lcp] == d[lcp]:
            lcp += 1
        base = len(tokens)
        tokens += d[lcp:]
        depth += range(plen + lcp, plen + len(d))
        node_pos[k] = (node_pos[order[len(laid) - 1]][:lcp] if laid else []) + list(range(base, base + len(d) - lcp))
        laid.append((base, lcp, len(d)))
        prev = d
    total = len(tokens)
    end = [total] * total  # the prompt chain and the last branches reach the end of the row
    for j, (base, lcp, length) in enumerate(laid):
        reach = length  # depths below `reach` still look for a later draft that leaves their subtree
        for later_base, later_lcp, _ in laid[j + 1 :]:
            if later_lcp < reach:
                lo = max(later_lcp, lcp)
                end[base + lo - lcp : base + reach - lcp] = [later_base] * (reach - lo)
                reach = later_lcp
            if reach <= lcp:
                break
    sizes = [e - i for i, e in enumerate(end)]
    score_pos = [([plen - 1] + pos[:-1]) if pos else [] for pos in node_pos]
    return PackedGroup(tokens, depth, sizes, members=members, score_pos=score_pos, node_pos=node_pos, prompt_len=plen)


def pack_groups(prompts: Sequence[Sequence[int]], drafts: Sequence[Sequence[int]]) -> list[PackedGroup]:
    """Group rows by prompt (identical token ids) and pack each group; every prompt must be non-empty."""
    as_ints = as_id_lists(drafts)
    return [_pack_group(list(key), [as_ints[i] for i in rows], rows) for key, rows in rows_by_prompt(prompts).items()]


def tree_inputs(
    groups: Sequence[PackedGroup], pad_id: int, device: torch.device, additive_dtype: torch.dtype | None = None
):
    """input_ids [B, T], position_ids [B, T] and a 4-D mask [B, 1, T, T] for packed rows: bool (True = attend) for
    SDPA, additive (0 / dtype min) given ``additive_dtype`` (eager). Padding attends to itself, so no row is empty."""
    bsz, width = len(groups), max(len(g.tokens) for g in groups)
    ids = torch.full((bsz, width), int(pad_id), dtype=torch.long)
    pos = torch.zeros((bsz, width), dtype=torch.long)
    start = torch.arange(width).unsqueeze(0).repeat(bsz, 1)  # pads: subtree = themselves
    end = start + 1
    # one host tensor per field for the whole chunk: row-major order of `filled` is the concatenation order
    filled = start < int64_tensor([len(g.tokens) for g in groups]).unsqueeze(1)
    ids[filled] = int64_tensor([t for g in groups for t in g.tokens])
    pos[filled] = int64_tensor([d for g in groups for d in g.depth])
    end[filled] = start[filled] + int64_tensor([z for g in groups for z in g.size])
    i = torch.arange(width).view(1, width, 1)
    j = torch.arange(width).view(1, 1, width)
    # query i sees key j iff j is an ancestor of i (or i itself): j <= i < j + size[j]
    mask = ((j <= i) & (i < end.unsqueeze(1))).unsqueeze(1).to(device)
    if additive_dtype is not None:
        blocked = torch.finfo(additive_dtype).min
        mask = torch.zeros(mask.shape, dtype=additive_dtype, device=device).masked_fill(~mask, blocked)
    return ids.to(device), pos.to(device), mask


def gather_scores(
    states: torch.Tensor, groups: Sequence[PackedGroup], out: torch.Tensor, same_as: torch.Tensor
) -> None:
    """Copy each member's scoring outputs from ``states`` [B, T, W] (row b = groups[b]) into ``out`` [N, R, W], and
    into ``same_as`` [N, R] the flat index of the first entry copied from the same output (``DraftScores.same_as``)."""
    row_of, member_of, lengths, cols = [], [], [], []
    for b, g in enumerate(groups):
        for member, positions in zip(g.members, g.score_pos):
            row_of.append(b)
            member_of.append(member)
            lengths.append(len(positions))
            cols += positions
    if not cols:
        return
    dev, width = states.device, states.shape[-1]
    lens = int64_tensor(lengths)
    starts = torch.cumsum(lens, 0) - lens
    dst_col = torch.arange(len(cols)) - torch.repeat_interleave(starts, lens)
    src = torch.repeat_interleave(int64_tensor(row_of), lens) * states.shape[1] + int64_tensor(cols)
    dst = torch.repeat_interleave(int64_tensor(member_of), lens) * out.shape[1] + dst_col
    picked = states.reshape(-1, width).index_select(0, src.to(dev)).to(out.dtype)
    out.view(-1, width).index_copy_(0, dst.to(dev), picked)
    key_index = torch.unique(src, return_inverse=True)[1]
    first = torch.full((int(key_index.max()) + 1,), out.shape[0] * out.shape[1], dtype=torch.long)
    first = first.scatter_reduce(0, key_index, dst, "amin")  # per distinct output: its first entry
    same_as.view(-1)[dst.to(same_as.device)] = first[key_index].to(same_as.device)


def supports_tree_attention(model) -> bool:
    """True when the model's attention takes our custom 4-D masks (SDPA or eager, no sliding window)."""
    cfg = getattr(model, "config", None)
    implementation = getattr(cfg, "_attn_implementation", None)
    return cfg is not None and not model_may_slide(model) and implementation in TREE_ATTENTION_IMPLEMENTATIONS


def chunk_rows(counts: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Row indices sorted by count, cut so each chunk's padded size (rows x largest count) fits ``max_tokens``."""
    chunks: list[list[int]] = []
    for i in sorted(range(len(counts)), key=lambda i: counts[i]):
        if chunks and counts[i] * (len(chunks[-1]) + 1) <= max_tokens:
            chunks[-1].append(i)
        else:
            chunks.append([i])
    return chunks


@dataclass
class TreeKV:
    """K/V of a tree-packed scoring forward, kept so a continuation needs no second prefill: ``chunks[c]`` holds one
    forward's groups and per-layer K/V [rows, kv_heads, T, head_dim]; ``where[i]`` is draft i's (chunk, row, member)."""

    chunks: list[tuple[list[PackedGroup], list[tuple[torch.Tensor, torch.Tensor]]]] = field(default_factory=list)
    where: dict[int, tuple[int, int, int]] = field(default_factory=dict)

    def add(self, groups: list[PackedGroup], layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        c = len(self.chunks)
        self.chunks.append((groups, layers))
        for row, g in enumerate(groups):
            for m, draft in enumerate(g.members):
                self.where[draft] = (c, row, m)

    def prompt_len(self, draft: int) -> int:
        c, row, _ = self.where[draft]
        return self.chunks[c][0][row].prompt_len

    def context(self, draft: int, n: int) -> RowContext:
        """The K/V of [prompt, the draft's first n tokens], gathered per layer when read."""
        c, row, m = self.where[draft]
        groups, layers = self.chunks[c]
        return RowContext(layers, row, torch.tensor(groups[row].path(m, n), device=layers[0][0].device))


class RowContext(Sequence):
    """One row's K/V context read out of a scoring pass's cache: ``self[layer]`` = (keys, values) [H, len(columns), D],
    gathered when read. Holding one costs no copy (a continuation holds every cut row's until its decode batch is
    built: gathering them all at once held each shared prompt once per draft); it keeps the pass's tensors alive
    while it lives. ``layers``: per-layer (keys, values) [rows, H, T, D]; ``columns``: int64 positions in T."""

    def __init__(self, layers: Sequence[tuple[torch.Tensor, torch.Tensor]], row: int, columns: torch.Tensor):
        self.layers, self.row, self.columns = list(layers), int(row), columns

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.layers[layer]
        return k[self.row].index_select(1, self.columns), v[self.row].index_select(1, self.columns)

    @property
    def length(self) -> int:
        """Positions in the context (its keys' dim 1)."""
        return int(self.columns.numel())
