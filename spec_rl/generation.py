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

from .sampling import SamplingSettings
from .scoring import DraftScores, PolicyScorer


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
        proposed_tokens, accepted_tokens: history-drafted tokens verified in decode steps, and how
            many of them were accepted.
    """

    prefill_tokens: int = 0
    reprefill_tokens: int = 0
    decode_steps: int = 0
    proposed_tokens: int = 0
    accepted_tokens: int = 0

    def copy(self) -> "BackendStats":
        return dataclasses.replace(self)


@runtime_checkable
class GenerationBackend(Protocol):
    """What the speculative rollout needs from an inference engine (paper Alg. 1, steps 1 and 4).

    ``score_drafts`` has the contract of :meth:`spec_rl.scoring.PolicyScorer.score`
    and also returns a handle; ``continue_from`` cuts row i to prompt + n_i,
    feeds ``first_tokens[i]`` (None: just release the row) and samples up to
    ``budgets[i]`` more tokens; ``extra_contexts`` are generated from scratch in
    the same batches. It returns continuations for the handle's rows, then the
    extras. ``release`` frees a handle that will not be continued. ``stats``
    counts prefill/re-prefill tokens and decode steps.

    Optional attributes (not part of the runtime check; absent or None means unknown):
    ``vocab_size`` (token ids it accepts and returns lie in [0, vocab_size)) and
    ``max_positions`` (the model's ``max_position_embeddings``: context + budget never pass it).
    :class:`~spec_rl.rollout.SpeculativeRollout` checks prompts, drafts and every continuation
    against them (:mod:`spec_rl.backend_checks`); without ``vocab_size`` it takes V from the
    scoring pass and, before any scoring, checks only that ids are >= 0.
    """

    stats: BackendStats

    @property
    def device(self) -> torch.device: ...

    def generate(
        self, contexts: Sequence[Sequence[int]], budgets: Sequence[int], settings: SamplingSettings, seed: int, *,
        uids: Sequence[int] | None = None, proposers: Sequence[Any] | None = None,
    ) -> list[Continuation]:  # fmt: skip
        """Sample up to ``budgets[i]`` tokens after ``contexts[i]`` for every i.

        ``uids[i]`` keys row i's sampling uniforms (default i); ``proposers[i]`` (a
        :class:`~spec_rl.history.SuffixProposer` or None) drafts tokens to verify per step.
        """
        ...

    def score_drafts(self, prompts: Sequence[Sequence[int]], drafts: Sequence[Sequence[int]]) -> tuple[DraftScores, Any]: ...

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


@dataclass
class ScoredDrafts:
    """Handle of :class:`ReprefillBackend`: the rows scored by ``score_drafts``."""

    prompts: list[list[int]]
    drafts: list[list[int]]
    used: bool = False


class ReprefillBackend:
    """``score_drafts``/``continue_from``/``release`` for a backend that only generates from contexts.

    Scoring runs :attr:`scorer` (a :class:`~spec_rl.scoring.PolicyScorer`);
    the continuation prefills [prompt, y_<n, token] again, as the SPEC-RL
    reference implementation does, and counts those tokens in
    ``stats.reprefill_tokens``. Subclasses set ``scorer`` and ``stats`` and
    implement ``generate``.
    """

    scorer: PolicyScorer
    stats: BackendStats
    vocab_size: int | None = None  # unknown unless a subclass says (see GenerationBackend)
    max_positions: int | None = None

    def generate(self, contexts, budgets, settings, seed, *, uids=None, proposers=None) -> list[Continuation]:
        raise NotImplementedError  # pragma: no cover - abstract

    def score_drafts(self, prompts, drafts) -> tuple[DraftScores, ScoredDrafts]:
        """Score the drafts (one forward per chunk) and keep the rows for :meth:`continue_from`."""
        rows = ScoredDrafts([list(map(int, p)) for p in prompts], [list(map(int, d)) for d in drafts])
        return self.scorer.score(rows.prompts, rows.drafts), rows

    def continue_from(
        self, handle: ScoredDrafts, accepted_lens, first_tokens, budgets, settings, seed, extra_contexts=(), extra_budgets=(),
        *, uids=None, proposers=None, sources=None,
    ) -> list[Continuation]:  # fmt: skip
        """Generate from [prompt, y_<n, first token] per scored row (re-prefilled), then from each extra context."""
        from .backend_checks import check_continue_rows, check_same_length  # (it imports this module)

        if not isinstance(handle, ScoredDrafts) or handle.used:
            raise ValueError("handle must come from this backend's score_drafts and be continued once")
        handle.used = True
        rows = len(handle.prompts)
        sources = range(rows) if sources is None else sources
        check_same_length(rows, "the handle's rows", accepted_lens=accepted_lens, first_tokens=first_tokens,
                          budgets=budgets, sources=sources)  # fmt: skip
        sources = check_continue_rows(handle.prompts, handle.drafts, accepted_lens, budgets, sources)
        check_same_length(len(extra_contexts), "extra_contexts", extra_budgets=extra_budgets)
        results: list[Continuation | None] = [None] * (rows + len(extra_contexts))
        total = rows + len(extra_contexts)
        uids = list(range(total)) if uids is None else list(uids)
        proposers = [None] * total if proposers is None else list(proposers)
        todo, contexts, todo_budgets = [], [], []
        for i, (n, tok, budget) in enumerate(zip(accepted_lens, first_tokens, budgets)):
            if tok is None or budget == 0:
                results[i] = Continuation([], [], "length")
                continue
            todo.append(i)
            contexts.append(handle.prompts[i] + handle.drafts[sources[i]][: int(n)] + [int(tok)])
            todo_budgets.append(int(budget))
        self.stats.reprefill_tokens += sum(len(c) for c in contexts)
        todo += [rows + k for k in range(len(extra_contexts))]
        contexts += [list(c) for c in extra_contexts]
        todo_budgets += [int(b) for b in extra_budgets]
        conts = self.generate(contexts, todo_budgets, settings, seed, uids=[uids[i] for i in todo], proposers=[proposers[i] for i in todo])
        for i, c in zip(todo, conts):
            results[i] = c
        return results  # type: ignore[return-value]

    def release(self, handle: ScoredDrafts) -> None:
        """Nothing is held between scoring and continuation: just mark the handle used."""
        handle.used = True


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
        raise ValueError("eos_ids must contain at least one end-of-sequence id (see spec_rl.generation.eos_token_ids)")
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


def __getattr__(name: str):
    # TransformersBackend lives in its own module (it imports this one); keep the old import path.
    if name == "TransformersBackend":
        from .transformers_backend import TransformersBackend

        return TransformersBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
