"""The contract between the speculative rollout and whatever generates tokens (docs/api.md "Generation backends")."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from ..acceptance.scores import DraftScores
from ..sampling.distribution import SamplingSettings


@dataclass
class Continuation:
    """New tokens and their sampling log-probs; "eos" iff the last token is an EOS id, else "length"."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str


@dataclass
class BackendStats:
    """Counters since the backend was built (``decode_steps``: sequential forwards, scoring excluded)."""

    prefill_tokens: int = 0
    reprefill_tokens: int = 0
    decode_steps: int = 0
    proposed_tokens: int = 0
    accepted_tokens: int = 0
    decode_rows: int = 0
    decode_positions: int = 0

    def copy(self) -> BackendStats:
        return dataclasses.replace(self)


@runtime_checkable
class GenerationBackend(Protocol):
    """What the speculative rollout needs from an inference engine (SPEC-RL Alg. 1; docs/api.md "Generation backends").
    Subclass it for the optional members' defaults; log-probs are those of the sampling distribution."""

    stats: BackendStats
    vocab_size: int | None = None
    max_positions: int | None = None
    max_k: int = 0

    @property
    def device(self) -> torch.device: ...

    def generate(
        self,
        contexts: Sequence[Sequence[int]],
        budgets: Sequence[int],
        settings: SamplingSettings,
        seed: int,
        *,
        uids: Sequence[int] | None = None,
        proposers: Sequence[Any] | None = None,
    ) -> list[Continuation]:
        """Up to ``budgets[i]`` tokens after ``contexts[i]``; ``uids[i]`` (default i) keys its uniforms."""
        ...

    def score_drafts(
        self, prompts: Sequence[Sequence[int]], drafts: Sequence[Sequence[int]]
    ) -> tuple[DraftScores, Any]: ...

    def score_drafts_progressive(
        self,
        prompts: Sequence[Sequence[int]],
        drafts: Sequence[Sequence[int]],
        draft_logprobs: Sequence[Sequence[float]],
    ) -> tuple[DraftScores, Any, Any] | None:
        """Exact acceptance: score where walks may read, more on demand; None if unsupported."""
        return None

    def continue_from(
        self,
        handle: Any,
        accepted_lens: Sequence[int],
        first_tokens: Sequence[int | None],
        budgets: Sequence[int],
        settings: SamplingSettings,
        seed: int,
        extra_contexts: Sequence[Sequence[int]] = (),
        extra_budgets: Sequence[int] = (),
        *,
        uids: Sequence[int] | None = None,
        proposers: Sequence[Any] | None = None,
        sources: Sequence[int] | None = None,
    ) -> list[Continuation]:
        """Continue row i from [prompt, drafts[sources[i]][:accepted_lens[i]], first_tokens[i]] (None: release it), then
        generate ``extra_contexts``; ``uids``/``proposers`` cover rows, then extras."""
        ...

    def release(self, handle: Any) -> None: ...

    def sync_weights(self) -> None:
        """Called after every policy update; an engine with its own copy of the weights reloads them."""


def split_zero_budgets(contexts, budgets) -> tuple[list[Continuation | None], list[int]]:
    """(results, rows to generate): a zero budget gets an empty "length" result; ValueError for bad input."""
    if len(contexts) != len(budgets):
        raise ValueError(f"contexts ({len(contexts)}) and budgets ({len(budgets)}) must have the same length")
    results: list[Continuation | None] = [None] * len(contexts)
    todo = []
    for i, (ctx, budget) in enumerate(zip(contexts, budgets)):
        if budget < 0:
            raise ValueError(f"budgets[{i}] = {budget} is negative")
        if len(ctx) == 0:
            raise ValueError(f"contexts[{i}] is empty; a context needs at least one token (the prompt)")
        if budget == 0:
            results[i] = Continuation([], [], "length")
        else:
            todo.append(i)
    return results, todo


def backend_arguments(eos_ids, pad_id: int, max_batch_size: int) -> tuple[list[int], int, int]:
    """Validated (sorted EOS ids, pad id, max batch size); ValueError without EOS ids or batch size < 1."""
    if not eos_ids:
        raise ValueError(
            "eos_ids must contain at least one end-of-sequence id (see spec_rl.backends.protocol.eos_token_ids)"
        )
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    return sorted({int(x) for x in eos_ids}), int(pad_id), int(max_batch_size)


def eos_token_ids(model, tokenizer=None) -> set[int]:
    """The full EOS set: generation_config, config and tokenizer may each list several ids."""
    ids: set[int] = set()
    for src in (getattr(model, "generation_config", None), getattr(model, "config", None), tokenizer):
        value = getattr(src, "eos_token_id", None) if src is not None else None
        if value is None:
            continue
        if isinstance(value, int):
            ids.add(value)
        else:
            ids.update(int(v) for v in value)
    return ids
