"""The proposers of a rollout's decoding rows: the prompt's history and the group's siblings in flight."""

from __future__ import annotations

from collections.abc import Sequence

from ..drafts.history import HistoryIndex
from ..drafts.siblings import DraftSources, SiblingTokens


def row_proposers(
    requests: Sequence[int | None], group_keys: Sequence[bytes], prompts: Sequence[list[int]],
    responses: Sequence[list[int]], drafts: dict[int, list[int]], history: HistoryIndex | None, sibling_drafts: bool,
    backend,
) -> list[DraftSources | None]:
    """One :class:`~spec_rl.drafts.siblings.DraftSources` per request (None where the entry is None, or where
    there is nothing to draft from: no history for the prompt and no sibling drafts).

    Args:
        requests: request indices of the rows to decode, in the backend's row order (None: no decoding).
        group_keys: per request, its group's key (the slot-0 draft key: prompt ids + dataset id).
        prompts: per request, its prompt ids (a read-only sibling text: responses often restate it).
        responses: per request, the response so far (verified prefix and the token at n).
        drafts: per drafted request, its stored draft (the group's drafts are read-only sibling texts).
        history: the history index (proposals from earlier epochs), or None.
        sibling_drafts: also propose from the group's other rows as they decode.
        backend: the generation backend (its ``max_k`` caps a proposal; its ``vocab_size`` bounds ids).
    """
    max_k = int(getattr(backend, "max_k", 8))
    vocab = getattr(backend, "vocab_size", None)
    groups: dict[bytes, SiblingTokens] = {}
    out: list[DraftSources | None] = []
    for i in requests:
        if i is None:
            out.append(None)
            continue
        key = group_keys[i]
        proposer = None if history is None else history.proposer(key, responses[i], max_k, vocab)
        siblings = None
        if sibling_drafts:
            if key not in groups:
                groups[key] = SiblingTokens([prompts[i]] + [d for j, d in drafts.items() if group_keys[j] == key])
            siblings = groups[key]
            siblings.extend(i, responses[i])
        # nothing to draft from: no proposer, so the row decodes exactly like plain decoding (no per-step work)
        out.append(DraftSources(proposer, siblings, i, vocab) if proposer is not None or siblings is not None else None)
    return out
