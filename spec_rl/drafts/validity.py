"""What part of a stored draft is still a response today's run could produce (docs/design.md "Draft validity"): cut at
its first token in today's EOS set (kept) and at today's budget, the rest is complete when it ends with an EOS or fills
the budget, else a prefix only (continued if accepted whole, never returned as finished)."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DraftView:
    """The valid part of one draft today: ``length`` leading tokens (0 <= length <= budget), and ``finish_reason``
    "eos" (they end with one of today's EOS ids), "length" (they fill the budget) or None (a prefix only)."""

    length: int
    finish_reason: str | None

    @property
    def complete(self) -> bool:
        """The valid part is a whole response (nothing is generated after it)."""
        return self.finish_reason is not None


def draft_view(token_ids: Sequence[int] | torch.Tensor, budget: int, eos_ids: Collection[int]) -> DraftView:
    """The valid part of one draft: ``token_ids`` [R] (list or 1-D integer tensor), ``budget`` today's per-sample
    budget in tokens (>= 1), ``eos_ids`` today's complete EOS set. ValueError: budget < 1 or empty ``eos_ids``."""
    return draft_views([token_ids], [budget], eos_ids)[0]


def draft_views(
    drafts: Sequence[Sequence[int] | torch.Tensor], budgets: Sequence[int], eos_ids: Collection[int]
) -> list[DraftView]:
    """:func:`draft_view` of B drafts (each [R_b] ids) with B per-sample budgets (tokens), in one vectorised pass.
    ValueError: mismatched lengths, a budget < 1, or an empty ``eos_ids``."""
    if len(drafts) != len(budgets):
        raise ValueError(f"drafts ({len(drafts)}) and budgets ({len(budgets)}) must have the same length")
    if not eos_ids:
        raise ValueError("eos_ids must list at least one end-of-sequence id")
    if any(int(b) < 1 for b in budgets):
        raise ValueError(f"every budget must be >= 1 token, got {min(int(b) for b in budgets)}")
    cut = [min(len(d), int(b)) for d, b in zip(drafts, budgets)]
    if not drafts or sum(cut) == 0:
        return [DraftView(0, None) for _ in drafts]
    ids = torch.cat([torch.as_tensor(d[:c], dtype=torch.long).reshape(-1) for d, c in zip(drafts, cut)])
    is_eos = torch.isin(ids, torch.tensor(sorted({int(e) for e in eos_ids}), dtype=torch.long))
    lengths = torch.tensor(cut, dtype=torch.long)
    row = torch.repeat_interleave(torch.arange(len(cut)), lengths)
    col = torch.arange(ids.numel()) - torch.repeat_interleave(torch.cumsum(lengths, 0) - lengths, lengths)
    first_eos = torch.full((len(cut),), -1, dtype=torch.long)
    hits = is_eos.nonzero().squeeze(1)
    # scatter_reduce "amin" over rows: the first EOS column of each row (rows without one stay -1)
    first_eos = first_eos.scatter_reduce(0, row[hits], col[hits], reduce="amin", include_self=False)
    return [
        DraftView(e + 1, "eos") if e >= 0 else DraftView(c, "length" if c == int(b) else None)
        for c, b, e in zip(cut, budgets, first_eos.tolist())
    ]
