"""Score the G drafts of a group in one row: the prompt once, then the trie of the drafts (tree attention).

The G samples of a GRPO group share their prompt, and their drafts (last epoch's G responses) often
share long prefixes too: on the demo task the trie of a group's 4 drafts holds about half of their
tokens. Packing the prompt and that trie into a single sequence, with an attention mask that lets
every token see exactly its ancestors and positions equal to the depth in the tree, computes every
distinct (prefix, next token) once. The outputs are the same as scoring each [prompt, draft]
separately (same keys, values and positions for every query), up to floating-point summation order.

Layout of one packed row (preorder of the tree, so the subtree of node j is the index range
``[j, j + size[j])`` and "j is an ancestor of i" is ``j <= i < j + size[j]``)::

    prompt tokens 0 .. P-1 (a chain), then the drafts' trie below the last prompt token

Draft token i of a draft is scored at the node of token i - 1, and token 0 at the last prompt token
(paper Sec. 3, docs/design.md "The rule", step 1). The path of a draft (prompt positions, then its
nodes) is what a continuation needs as its KV context.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

#: attention implementations whose masks we know how to build (bool for sdpa, additive for eager)
TREE_ATTENTION_IMPLEMENTATIONS = ("sdpa", "eager")


@dataclass
class PackedGroup:
    """One packed row: the prompt and the trie of its drafts, in preorder.

    Attributes:
        tokens: token id per position.
        depth: position id per position (the distance from the first prompt token).
        size: subtree size per position.
        members: indices (into the caller's draft list) of the drafts packed here.
        score_pos: per member, the positions whose outputs score its tokens.
        node_pos: per member, the position of each of its tokens.
        prompt_len: P.
    """

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
    """Build the trie (children in insertion order), then relabel it in preorder."""
    plen = len(prompt)
    tokens = list(prompt)
    children: list[dict[int, int]] = [{} for _ in range(plen)]
    draft_nodes = []
    for d in drafts:
        node, nodes = plen - 1, []
        for t in d:
            child = children[node].get(t)
            if child is None:
                child = len(tokens)
                tokens.append(int(t))
                children.append({})
                children[node][t] = child
            nodes.append(child)
            node = child
        draft_nodes.append(nodes)
    # Preorder of the trie below the last prompt token (iterative DFS; children in insertion order).
    order, stack = list(range(plen - 1)), [plen - 1]
    while stack:
        node = stack.pop()
        order.append(node)
        stack.extend(reversed(list(children[node].values())))
    new_of = [0] * len(tokens)
    for new, old in enumerate(order):
        new_of[old] = new
    depth = [0] * len(tokens)
    parent = [-1] * len(tokens)
    for old in range(len(tokens)):
        for child in children[old].values():
            parent[new_of[child]] = new_of[old]
    for i in range(1, plen):
        parent[i] = i - 1
    size = [1] * len(tokens)
    for i in range(len(tokens) - 1, 0, -1):
        size[parent[i]] += size[i]
    for i in range(1, len(tokens)):
        depth[i] = depth[parent[i]] + 1
    group = PackedGroup([tokens[o] for o in order], depth, size, members=members, prompt_len=plen)
    for nodes in draft_nodes:
        pos = [new_of[n] for n in nodes]
        group.node_pos.append(pos)
        group.score_pos.append(([plen - 1] + pos[:-1]) if pos else [])
    return group


def pack_groups(prompts: Sequence[Sequence[int]], drafts: Sequence[Sequence[int]]) -> list[PackedGroup]:
    """Group rows by prompt (identical token ids) and pack each group; every prompt must be non-empty."""
    by_prompt: dict[tuple[int, ...], list[int]] = {}
    for i, p in enumerate(prompts):
        by_prompt.setdefault(tuple(int(t) for t in p), []).append(i)
    return [_pack_group(list(key), [drafts[i] for i in rows], rows) for key, rows in by_prompt.items()]


def tree_inputs(groups: Sequence[PackedGroup], pad_id: int, device: torch.device, additive_dtype: torch.dtype | None = None):
    """input_ids [B, T], position_ids [B, T] and a 4-D attention mask [B, 1, T, T] for packed rows.

    The mask is bool (True = attend) for SDPA, or additive (0 / dtype min) when ``additive_dtype``
    is given (eager attention). Padding positions attend to themselves only, so no softmax row is empty.
    """
    width = max(len(g.tokens) for g in groups)
    bsz = len(groups)
    ids = torch.full((bsz, width), int(pad_id), dtype=torch.long)
    pos = torch.zeros((bsz, width), dtype=torch.long)
    start = torch.arange(width).unsqueeze(0).repeat(bsz, 1)  # pads: subtree = themselves
    end = start + 1
    for b, g in enumerate(groups):
        n = len(g.tokens)
        ids[b, :n] = torch.tensor(g.tokens)
        pos[b, :n] = torch.tensor(g.depth)
        end[b, :n] = start[b, :n] + torch.tensor(g.size)
    i = torch.arange(width).view(1, width, 1)
    j = torch.arange(width).view(1, 1, width)
    # query i sees key j iff j is an ancestor of i (or i itself): j <= i < j + size[j]
    mask = (j <= i) & (i < end.unsqueeze(1))
    mask = mask.unsqueeze(1).to(device)
    if additive_dtype is not None:
        mask = torch.zeros(mask.shape, dtype=additive_dtype, device=device).masked_fill(~mask, torch.finfo(additive_dtype).min)
    return ids.to(device), pos.to(device), mask


def gather_scores(states: torch.Tensor, groups: Sequence[PackedGroup], out: torch.Tensor) -> None:
    """Copy each member's scoring outputs from ``states`` [B, T, W] (row b = groups[b]) into ``out`` [N, R, W]."""
    rows, cols, dst_row, dst_col = [], [], [], []
    for b, g in enumerate(groups):
        for member, positions in zip(g.members, g.score_pos):
            rows += [b] * len(positions)
            cols += positions
            dst_row += [member] * len(positions)
            dst_col += range(len(positions))
    if rows:
        dev = states.device
        out[torch.tensor(dst_row, device=dev), torch.tensor(dst_col, device=dev)] = states[
            torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)
        ].to(out.dtype)


def supports_tree_attention(model) -> bool:
    """True when the model's attention takes our custom 4-D masks (SDPA or eager, no sliding window)."""
    cfg = getattr(model, "config", None)
    if cfg is None:
        return False
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    if getattr(text, "use_sliding_window", False) or "sliding_attention" in (getattr(text, "layer_types", None) or []):
        return False
    return getattr(cfg, "_attn_implementation", None) in TREE_ATTENTION_IMPLEMENTATIONS


def chunk_groups(groups: Sequence[PackedGroup], max_tokens: int) -> list[list[PackedGroup]]:
    """Groups sorted by packed length, cut so each chunk's padded size (rows x longest) fits ``max_tokens``."""
    chunks: list[list[PackedGroup]] = []
    for g in sorted(groups, key=lambda g: len(g.tokens)):
        if chunks and len(g.tokens) * (len(chunks[-1]) + 1) <= max_tokens:
            chunks[-1].append(g)
        else:
            chunks.append([g])
    return chunks


@dataclass
class TreeKV:
    """Keys and values of a tree-packed scoring forward, kept so a continuation needs no second prefill.

    ``chunks[c]`` holds one forward's groups and its per-layer K/V [rows, kv_heads, T, head_dim];
    ``where[i]`` locates draft i as (chunk, row in the chunk, member index in the group).
    """

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

    def context(self, draft: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (keys [H, P + n, D], values) of [prompt, the draft's first n tokens]."""
        c, row, m = self.where[draft]
        groups, layers = self.chunks[c]
        idx = torch.tensor(groups[row].path(m, n), device=layers[0][0].device)
        return [(k[row].index_select(1, idx), v[row].index_select(1, idx)) for k, v in layers]
