"""``DraftScores.same_as``: which draft positions a scoring pass scored with one shared output.

The tree-packed scorer (:mod:`spec_rl.sampling.groups`) computes one output per distinct (prompt, draft
prefix) and says so: ``same_as[b, r] = b' * R + r'`` names the first position scored by the same output
as token r of draft b. Verification then runs the LM head once per distinct output, so a wrong
``same_as`` from a custom backend would silently score tokens with another prefix's distribution.
:func:`check_shared_outputs` therefore checks its meaning, not only its form, in O(B * R) tensor work:

* the named position is in the same column (r' = r), inside that row's draft, with the same prompt;
* it names itself (it is the representative of its output);
* drafts b and b' share their first r tokens, checked by induction: the same token at r - 1 and the
  same representative there (the same first r - 1 tokens);
* padding (r >= len(draft b)) names itself.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..sampling.groups import int64_tensor, rows_by_prompt
from .checks import BackendContractError

__all__ = ["check_shared_outputs"]


def check_shared_outputs(same, prompts: Sequence[Sequence[int]], drafts: Sequence[Sequence[int]], source: str) -> None:
    """Refuse a ``same_as`` that is not None and not what the module docstring says.

    Args:
        same: ``DraftScores.same_as`` of a ``score_drafts`` call ([B, R] int64) or None.
        prompts, drafts: the B rows that were scored (drafts as int lists, cut to their budget).
        source: the backend method, for the message (e.g. "MyBackend.score_drafts").

    Raises:
        BackendContractError: a wrong type, shape or dtype, or the first (sample, token) it gets wrong.
    """
    if same is None:
        return
    bsz, width = len(drafts), max([len(d) for d in drafts] + [1])
    if not (isinstance(same, torch.Tensor) and tuple(same.shape) == (bsz, width) and same.dtype == torch.int64):
        what = f"{tuple(same.shape)} {same.dtype}" if isinstance(same, torch.Tensor) else type(same).__name__
        raise BackendContractError(
            f"{source} returned same_as {what}; expected None or int64 [{bsz}, {width}] of flat indices in [0, {bsz * width})"
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
    ids[valid] = int64_tensor([x for d in drafts for x in d])  # the rollout's id lists (ints)
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
