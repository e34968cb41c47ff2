"""What part of a stored draft is still a response the current run could produce.

A draft was sampled under the budget and EOS set of its own run. Reusing it as if nothing changed is
wrong whenever those differ today: a draft that runs on past a token that is an EOS today, or one that
stopped at a smaller budget, is not a response today's rollout can return. The rule (docs/design.md
"Draft validity"), applied by every path that reuses drafts (the in-process rollout and its exact
walk, the server adapters' request builder, hence TRL, verl and OpenRLHF):

1. cut the draft at its first token in today's EOS set (that token is kept: it ends the response);
2. cut it to today's per-sample budget ``min(max_tokens, max_model_len - len(prompt))``;
3. what is left is **complete** when it ends with an EOS token or fills the budget; otherwise it is
   a **prefix only**: if all of it is accepted, decoding continues from its end with the remaining
   budget, and it is never returned as finished.

The stored finish reason does not enter: a draft that finished "eos" under an EOS id that is no longer
one is a prefix today, and a draft cut by an old, smaller budget ("length") is a prefix too. The
acceptance test then runs over the valid part only, with the stored log-probs of those tokens.

Cost: one vectorised pass over the drafts of a batch (``torch.isin`` on the concatenated ids), not a
scan per token.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

__all__ = ["DraftView", "draft_view", "draft_views"]


@dataclass(frozen=True)
class DraftView:
    """The valid part of one draft today.

    Attributes:
        length: leading draft tokens that remain a valid response prefix (0 <= length <= budget).
        finish_reason: "eos" (they end with a token of today's EOS set), "length" (they fill today's
            budget) or None (a prefix only: decoding must continue after them).
    """

    length: int
    finish_reason: str | None

    @property
    def complete(self) -> bool:
        """The valid part is a whole response (reused whole, nothing is generated after it)."""
        return self.finish_reason is not None


def draft_view(token_ids: Sequence[int] | torch.Tensor, budget: int, eos_ids: Collection[int]) -> DraftView:
    """The valid part of one draft (see the module docstring).

    Args:
        token_ids: [R] the stored draft's ids (list or 1-D integer tensor).
        budget: today's per-sample budget in tokens (>= 1).
        eos_ids: today's complete EOS set.

    Raises:
        ValueError: ``budget`` < 1 or an empty ``eos_ids``.
    """
    return draft_views([token_ids], [budget], eos_ids)[0]


def draft_views(
    drafts: Sequence[Sequence[int] | torch.Tensor], budgets: Sequence[int], eos_ids: Collection[int]
) -> list[DraftView]:
    """:func:`draft_view` of every draft at once (one ``torch.isin`` over all their ids).

    Args:
        drafts: B stored drafts, each [R_b] ids (lists or 1-D integer tensors).
        budgets: B per-sample budgets, tokens.
        eos_ids: today's complete EOS set.

    Raises:
        ValueError: mismatched lengths, a budget < 1, or an empty ``eos_ids``.
    """
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
    views = []
    for c, b, e in zip(cut, budgets, first_eos.tolist()):
        views.append(DraftView(e + 1, "eos") if e >= 0 else DraftView(c, "length" if c == int(b) else None))
    return views
