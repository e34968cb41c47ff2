"""Generation backends: continue sequences from prompt + verified prefix.

A backend receives, per sequence, the context to continue (prompt ids plus
the verified prefix of the draft) and a token budget, and returns the new
tokens with their log-probabilities under the *sampling* distribution
(temperature, top-k, top-p exactly as given; no hidden defaults such as
transformers' ``generate`` top_k=50). Budget bookkeeping lives in the
rollout: budget = min(max_response_len, max_model_len - prompt_len) - n.
"""

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
    """New tokens for one sequence.

    Attributes:
        token_ids: sampled ids (EOS included if one was sampled; nothing after it).
        logprobs: their sampling log-probs (float, same length).
        finish_reason: "eos" if the last token is an EOS id, else "length"
            (the budget ran out; a zero budget gives an empty "length" result).
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str


@dataclass
class BackendStats:
    """Counters of a generation backend since it was built (tokens and forward calls).

    Attributes:
        prefill_tokens: context tokens fed to prefill forwards (scoring excluded).
        reprefill_tokens: tokens of [prompt, verified prefix, token] that were
            prefilled again after the scoring pass (0 for a splicing backend
            whose cache was large enough).
        decode_steps: sequential generation forwards (prefill waves and decode steps, whatever
            the batch size); the scoring pass is not counted.
        proposed_tokens, accepted_tokens: drafted tokens verified in decode steps, and how many of
            them were accepted.
        decode_rows, decode_positions: sequences and query positions computed by decode steps, summed
            over steps (padding included: a padded batch computes every row at the step's width), so
            decode_positions / decode_rows is the mean width of a step.
    """

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
    """What the speculative rollout needs from an inference engine (paper Alg. 1, steps 1 and 4).

    ``score_drafts`` has the contract of :meth:`spec_rl.backends.scoring.PolicyScorer.score` and also returns a
    handle; ``continue_from`` cuts row i to prompt + n_i, feeds ``first_tokens[i]`` (None: just release the row)
    and samples up to ``budgets[i]`` more tokens, then generates ``extra_contexts`` from scratch in the same
    batches; ``release`` frees a handle that will not be continued. The optional capabilities have defaults here
    (subclass this protocol to inherit them): ``vocab_size`` and ``max_positions`` (None: unknown; the rollout then
    checks ids and lengths against what it knows), ``max_k`` (most drafted tokens verified per decode step; 0: no
    tail speculation), ``score_drafts_progressive`` (None: not supported) and ``sync_weights``.
    """

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
        """Sample up to ``budgets[i]`` tokens after ``contexts[i]`` for every i.

        ``uids[i]`` keys row i's sampling uniforms (default i); ``proposers[i]`` (a
        :class:`~spec_rl.drafts.history.SuffixProposer` or None) drafts tokens to verify per step.
        """
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
        """For exact acceptance: score the drafts only where a walk may read them (``draft_logprobs``, the stored
        ones, estimate where), more on demand; returns (scores, handle, progressive scores), or None when the
        backend cannot (the rollout then calls :meth:`score_drafts`)."""
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
        """``uids``/``proposers`` cover the handle's rows, then the extra contexts.

        ``sources[i]`` (default i) is the handle row whose draft holds row i's verified prefix: row i
        continues from [prompt, drafts[sources[i]][:accepted_lens[i]], first_tokens[i]]. Rows of one
        group share a prompt, so under exact acceptance a sample may continue another slot's draft.
        """
        ...

    def release(self, handle: Any) -> None: ...

    def sync_weights(self) -> None:
        """Called after every policy update; an engine with its own copy of the weights (vLLM) reloads them."""


def split_zero_budgets(contexts, budgets) -> tuple[list[Continuation | None], list[int]]:
    """The results slots of a ``generate`` call and the rows to generate.

    Rows with budget 0 get an empty "length" :class:`Continuation` at once; the others are returned
    as indices to generate.

    Raises:
        ValueError: mismatched lengths, a negative budget, an empty context.
    """
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
    """Validated (sorted EOS ids, pad id, max batch size) shared by every generation backend.

    Raises:
        ValueError: no EOS id, or ``max_batch_size`` < 1.
    """
    if not eos_ids:
        raise ValueError(
            "eos_ids must contain at least one end-of-sequence id (see spec_rl.backends.protocol.eos_token_ids)"
        )
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    return sorted({int(x) for x in eos_ids}), int(pad_id), int(max_batch_size)


def eos_token_ids(model, tokenizer=None) -> set[int]:
    """The full EOS set: generation_config and config may each list several ids."""
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
