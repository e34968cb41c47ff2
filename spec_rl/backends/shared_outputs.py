"""Checks ``DraftScores.same_as[b, r] = b' * R + r'``, the first position scored by the same output as token r of draft
b (a wrong one would silently score tokens with another prefix). Rules: in column r, inside its draft, same prompt,
names itself; drafts b, b' share their first r tokens (same token and representative at r - 1); padding names itself."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..sampling.groups import int64_tensor, rows_by_prompt
from .checks import BackendContractError

__all__ = ["check_shared_outputs"]


def check_shared_outputs(same, prompts: Sequence[Sequence[int]], drafts: Sequence[Sequence[int]], source: str) -> None:
    """BackendContractError naming ``source`` and the first wrong entry of ``same`` ([B, R] int64 or None)."""
    if same is None:
        return
    bsz, width = len(drafts), max([len(d) for d in drafts] + [1])
    if not (isinstance(same, torch.Tensor) and tuple(same.shape) == (bsz, width) and same.dtype == torch.int64):
        what = f"{tuple(same.shape)} {same.dtype}" if isinstance(same, torch.Tensor) else type(same).__name__
        raise BackendContractError(
            f"{source} returned same_as {what}; expected None or int64 [{bsz}, {width}] of flat indices in "
            f"[0, {bsz * width})"
        )
    t = same.cpu()
    if t.numel() and (int(t.min()) < 0 or int(t.max()) >= bsz * width):
        raise BackendContractError(
            f"{source} returned same_as with indices outside [0, {bsz * width}) (the flat [B, R] range)"
        )
    ok = _matches(t, prompts, drafts)
    if not bool(ok.all()):
        b, r = (int(v) for v in torch.nonzero(~ok)[0])
        raise BackendContractError(
            f"{source} returned same_as[{b}, {r}] = {int(t[b, r])}, which does not name a position scored by the same "
            "output (same prompt, same draft prefix, same column; padding names itself); return same_as=None if "
            "the backend does not share outputs"
        )


def _matches(t: torch.Tensor, prompts, drafts) -> torch.Tensor:
    """[B, R] bool: entry (b, r) of ``t`` satisfies every rule of the module docstring."""
    bsz, width = t.shape
    lengths = int64_tensor([len(d) for d in drafts])
    cols = torch.arange(width).expand(bsz, width)
    own = torch.arange(bsz).unsqueeze(1) * width + cols
    valid = cols < lengths.unsqueeze(1)
    ids = torch.zeros((bsz, width), dtype=torch.long)
    ids[valid] = int64_tensor([x for d in drafts for x in d])
    group = torch.zeros(bsz, dtype=torch.long)
    for g, rows in enumerate(rows_by_prompt(prompts).values()):
        group[rows] = g
    tb, tr = t // width, t % width
    ok = (tr == cols) & (cols < lengths[tb]) & (group[tb] == group.unsqueeze(1))
    ok &= t.view(-1)[t.view(-1)].view(bsz, width) == t  # the representative names itself
    prev = torch.ones((bsz, width), dtype=torch.bool)
    if width > 1:  # same token at r - 1 and the same representative there
        back = (cols - 1).clamp(min=0)[:, 1:]
        prev[:, 1:] = (ids[tb[:, 1:], back] == ids[:, :-1]) & (t[tb[:, 1:], back] == t[:, :-1])
    return torch.where(valid, ok & prev, t == own)
