"""Backends that decode only from contexts: a continuation prefills [prompt, y_<n, token] again, as SPEC-RL does; the
scoring pass runs on the trained model (:class:`~spec_rl.backends.scoring.PolicyScorer`)."""

from __future__ import annotations

import dataclasses

from .base import Backend, Continuation, Scored
from .progressive import ProgressiveTreeScores
from .scoring import PolicyScorer


class ReprefillBackend(Backend):
    """:meth:`score` and :meth:`continue_from` over :meth:`generate`; subclasses set ``scorer`` (a PolicyScorer) and
    ``stats`` and implement ``generate``. Asked with the drafts' log-probs, the tree scorer scores only where exact
    walks may read (:class:`ProgressiveTreeScores`). A subclass with ``splice`` on continues on the scoring K/V
    instead: the tree scorer keeps them in ``Scored.state``."""

    scorer: PolicyScorer
    splice = False

    def score(self, prompts, drafts, logprobs=None) -> Scored:
        prompts, drafts = self.checked_rows(prompts, drafts)
        splices = self.splice and self.scorer.tree
        keep = self.keeps_kv if splices else False
        if logprobs is not None and self.scorer.tree:
            lazy = ProgressiveTreeScores(self.scorer, prompts, drafts, logprobs, keep_kv=keep)
            return Scored(lazy.scores, prompts, drafts, state=lazy if lazy.keep_kv else None, progressive=lazy)
        scores, kv = self.scorer.score_with_kv(prompts, drafts, keep_kv=keep)
        return Scored(scores, prompts, drafts, state=kv)

    def keeps_kv(self, positions: int) -> bool:
        """Whether a splicing backend keeps a scoring pass's K/V of ``positions`` token positions (padding included,
        memory permitting); True here."""
        return True

    def continue_from(self, scored: Scored, jobs, settings, seed) -> list[Continuation]:
        try:
            jobs = self.checked_jobs(jobs, scored)
        finally:
            self.release(scored)
        fresh = []
        for job in jobs:
            if job.cut is not None:
                row, n = job.cut.row, job.cut.n
                context = scored.prompts[row] + scored.drafts[row][:n] + [int(job.cut.token)]
                self.stats.reprefill_tokens += len(context) if job.budget > 0 else 0
                job = dataclasses.replace(job, context=context, cut=None)
            fresh.append(job)
        return self.generate(fresh, settings, seed)

    def release(self, scored: Scored) -> None:
        scored.used, scored.state = True, None
        if scored.progressive is not None:
            scored.progressive.release()
