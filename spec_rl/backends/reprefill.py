"""Backends that generate only from contexts: a continuation re-prefills [prompt, y_<n, token], as SPEC-RL does."""

from __future__ import annotations

from dataclasses import dataclass

from ..acceptance.scores import DraftScores
from .checks import check_continue_rows, check_same_length
from .progressive import ProgressiveTreeScores
from .protocol import BackendStats, Continuation, GenerationBackend
from .scoring import PolicyScorer


@dataclass
class ScoredDrafts:
    """Handle of :class:`ReprefillBackend`: the rows scored by ``score_drafts`` (and the progressive scores, whose
    kept K/V are dropped when the handle is continued or released)."""

    prompts: list[list[int]]
    drafts: list[list[int]]
    used: bool = False
    progressive: ProgressiveTreeScores | None = None

    def finish(self) -> None:
        self.used = True
        if self.progressive is not None:
            self.progressive.release()


class ReprefillBackend(GenerationBackend):
    """The speculative methods over ``generate``; subclasses set ``scorer`` and ``stats`` and implement ``generate``."""

    scorer: PolicyScorer
    stats: BackendStats

    def generate(self, contexts, budgets, settings, seed, *, uids=None, proposers=None) -> list[Continuation]:
        raise NotImplementedError  # pragma: no cover - abstract

    def score_drafts(self, prompts, drafts) -> tuple[DraftScores, ScoredDrafts]:
        rows = ScoredDrafts([list(map(int, p)) for p in prompts], [list(map(int, d)) for d in drafts])
        return self.scorer.score(rows.prompts, rows.drafts), rows

    def score_drafts_progressive(
        self, prompts, drafts, draft_logprobs=None
    ) -> tuple[DraftScores, ScoredDrafts, ProgressiveTreeScores] | None:
        """Score where exact walks may read (:class:`ProgressiveTreeScores`): a draft the walks leave early is never
        scored past that point; None without the tree layout (or without a :class:`PolicyScorer`)."""
        if not (isinstance(self.scorer, PolicyScorer) and self.scorer.tree):
            return None
        rows = ScoredDrafts([list(map(int, p)) for p in prompts], [list(map(int, d)) for d in drafts])
        rows.progressive = ProgressiveTreeScores(self.scorer, rows.prompts, rows.drafts, draft_logprobs)
        return rows.progressive.scores, rows, rows.progressive

    def continue_from(
        self,
        handle: ScoredDrafts,
        accepted_lens,
        first_tokens,
        budgets,
        settings,
        seed,
        extra_contexts=(),
        extra_budgets=(),
        *,
        uids=None,
        proposers=None,
        sources=None,
    ) -> list[Continuation]:
        if not isinstance(handle, ScoredDrafts) or handle.used:
            raise ValueError("handle must come from this backend's score_drafts and be continued once")
        handle.finish()
        rows = len(handle.prompts)
        sources = range(rows) if sources is None else sources
        check_same_length(
            rows,
            "the handle's rows",
            accepted_lens=accepted_lens,
            first_tokens=first_tokens,
            budgets=budgets,
            sources=sources,
        )
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
        conts = self.generate(
            contexts, todo_budgets, settings, seed, uids=[uids[i] for i in todo], proposers=[proposers[i] for i in todo]
        )
        for i, c in zip(todo, conts):
            results[i] = c
        return results  # type: ignore[return-value]

    def release(self, handle: ScoredDrafts) -> None:
        handle.finish()
