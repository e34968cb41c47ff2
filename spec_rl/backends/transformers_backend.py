"""TransformersBackend: tree-packed scoring whose K/V the continuation reuses (no second prefill), and keyed decoding
that verifies history-drafted tokens per step (docs/design.md "Tail speculation")."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..acceptance.scores import DraftScores
from ..sampling.distribution import SamplingSettings
from ..sampling.groups import TreeKV
from ..util.model_config import model_sliding_window
from ..util.validation import check_int
from .checks import ModelLimits, check_same_length
from .hf_decode import DecodeRow, KVRows, SpeculativeDecoder, TailGate, prefill
from .progressive import ProgressiveTreeScores
from .protocol import BackendStats, Continuation, backend_arguments, split_zero_budgets
from .reprefill import ReprefillBackend, ScoredDrafts
from .scoring import PolicyScorer


class SplicedDrafts(ScoredDrafts):
    """Handle whose scoring K/V were kept: a :class:`TreeKV`, or progressive scores."""

    def __init__(self, prompts, drafts, kv: TreeKV | ProgressiveTreeScores):
        super().__init__(prompts, drafts)
        self.kv = kv


class TransformersBackend(ModelLimits, ReprefillBackend):
    """Batched generation with a transformers causal LM (docs/api.md "Generation backends"); ``max_k``: most
    history-drafted tokens verified per step (0: off); ``adaptive_tail``: feed them only while they pay, by measured
    step times (:class:`~spec_rl.backends.hf_decode.TailGate`; False: every step); ``splice``: keep the scoring K/V
    for the continuation. ValueError for no EOS id, ``max_batch_size`` < 1, ``max_k`` < 0 or a sliding-window model."""

    def __init__(
        self,
        model,
        eos_ids: set[int] | Sequence[int],
        pad_id: int,
        max_batch_size: int = 256,
        progress: bool = False,
        max_tokens_per_forward: int | None = None,
        max_k: int = 8,
        splice: bool = True,
        adaptive_tail: bool = True,
    ):
        self.model = model
        window = model_sliding_window(model)
        if window is not None:
            # Left padding and rolled-back columns would make a window in cache columns differ from one in tokens.
            raise ValueError(
                f"model has sliding-window attention (window {window} tokens), which TransformersBackend's padded "
                "decode batches cannot honour; serve it with VLLMBackend, or set the config's sliding_window to None "
                "if the window never binds at your lengths"
            )
        self.eos_ids, self.pad_id, self.max_batch_size = backend_arguments(eos_ids, pad_id, max_batch_size)
        self.max_k = check_int("max_k", max_k, low=0, hint=" (0 disables speculation)")
        self.progress = progress
        self.splice = bool(splice)
        self.tail_gate = TailGate() if adaptive_tail else None  # kept across calls: the hardware does not change
        self.scorer = PolicyScorer(model, self.pad_id, max_tokens_per_forward)
        self.stats = BackendStats()

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @torch.no_grad()
    def generate(
        self, contexts, budgets, settings: SamplingSettings, seed: int, *, uids=None, proposers=None
    ) -> list[Continuation]:
        """See :meth:`GenerationBackend.generate`; TypeError or ValueError for bad ids, budgets or lengths."""
        results, todo = split_zero_budgets(contexts, budgets)
        contexts = self.checked_contexts(contexts, budgets)
        uids = list(range(len(contexts))) if uids is None else [int(u) for u in uids]
        proposers = [None] * len(contexts) if proposers is None else list(proposers)
        todo.sort(key=lambda i: len(contexts[i]))  # less left padding per batch
        for start in range(0, len(todo), self.max_batch_size):
            chunk = todo[start : start + self.max_batch_size]
            kv, rows = self._prefill_rows(
                [list(contexts[i]) for i in chunk],
                [int(budgets[i]) for i in chunk],
                [uids[i] for i in chunk],
                [proposers[i] for i in chunk],
                chunk,
                settings,
                seed,
            )
            self._decode(kv, rows, settings, seed, results)
        return results  # type: ignore[return-value]

    @torch.no_grad()
    def score_drafts(self, prompts, drafts) -> tuple[DraftScores, ScoredDrafts]:
        """Score the drafts, keeping the K/V when :attr:`splice` is on and the tree layout ran."""
        prompts, drafts = self.checked_rows(prompts, drafts)
        scores, kv = self.scorer.score_with_kv(prompts, drafts, keep_kv=self.splice)
        handle = SplicedDrafts(prompts, drafts, kv) if kv is not None else ScoredDrafts(prompts, drafts)
        return scores, handle

    @torch.no_grad()
    def score_drafts_progressive(
        self, prompts, drafts, draft_logprobs=None
    ) -> tuple[DraftScores, SplicedDrafts, ProgressiveTreeScores] | None:
        """Score where exact walks may read (:class:`ProgressiveTreeScores`), keeping the K/V for the continuation
        when :attr:`splice` is on; None without the tree layout."""
        if not self.splice:
            return super().score_drafts_progressive(prompts, drafts, draft_logprobs)
        if not self.scorer.tree:
            return None
        prompts, drafts = self.checked_rows(prompts, drafts)
        lazy = ProgressiveTreeScores(self.scorer, prompts, drafts, draft_logprobs)
        return lazy.scores, SplicedDrafts(prompts, drafts, lazy), lazy

    @torch.no_grad()
    def continue_from(
        self,
        handle,
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
        """See :meth:`GenerationBackend.continue_from`; ValueError for a foreign or used handle or bad rows."""
        if not isinstance(handle, SplicedDrafts):
            return super().continue_from(
                handle,
                accepted_lens,
                first_tokens,
                budgets,
                settings,
                seed,
                extra_contexts,
                extra_budgets,
                uids=uids,
                proposers=proposers,
                sources=sources,
            )
        live, extra_contexts, sources = self._check_spliced(
            handle, accepted_lens, first_tokens, budgets, extra_contexts, extra_budgets, sources
        )
        n_rows = len(handle.prompts)
        total = n_rows + len(extra_contexts)
        uids = list(range(total)) if uids is None else [int(u) for u in uids]
        proposers = [None] * total if proposers is None else list(proposers)
        results: list[Continuation | None] = [None] * total
        for i in set(range(n_rows)) - set(live):
            results[i] = Continuation([], [], "length")
        src = sources
        rows = [
            DecodeRow(
                out=i,
                uid=uids[i],
                last=int(first_tokens[i]),
                position=handle.kv.prompt_len(i) + int(accepted_lens[i]),
                budget=int(budgets[i]),
                proposer=proposers[i],
            )
            for i in live
        ]
        try:
            contexts = [handle.kv.context(src[i], int(accepted_lens[i])) for i in live]
        finally:
            self._drop_kv(handle)  # gathered, or failed
        extras = [k for k in range(len(extra_contexts)) if int(extra_budgets[k]) > 0]
        for k in set(range(len(extra_contexts))) - set(extras):
            results[n_rows + k] = Continuation([], [], "length")
        for start in range(0, len(rows) + len(extras), self.max_batch_size):
            end = start + self.max_batch_size
            part, ex = rows[start:end], extras[max(0, start - len(rows)) : max(0, end - len(rows))]
            kv = KVRows.from_rows(contexts[start:end]) if part else None
            if ex:
                kv_e, rows_e = self._prefill_rows(
                    [list(extra_contexts[k]) for k in ex],
                    [int(extra_budgets[k]) for k in ex],
                    [uids[n_rows + k] for k in ex],
                    [proposers[n_rows + k] for k in ex],
                    [n_rows + k for k in ex],
                    settings,
                    seed,
                )
                kv, part = (kv_e, rows_e) if kv is None else (kv.concat(kv_e), part + rows_e)
            self._decode(kv, part, settings, seed, results)
        return results  # type: ignore[return-value]

    def release(self, handle: ScoredDrafts) -> None:
        handle.finish()
        if isinstance(handle, SplicedDrafts):
            self._drop_kv(handle)

    @staticmethod
    def _drop_kv(handle: SplicedDrafts) -> None:
        if isinstance(handle.kv, ProgressiveTreeScores):
            handle.kv.release()
        handle.kv = None

    def _check_spliced(self, handle, accepted_lens, first_tokens, budgets, extra_contexts, extra_budgets, sources):
        """Checked (live rows, extras, sources); the handle is released on an error."""
        if handle.used:
            raise ValueError("handle must come from this backend's score_drafts and be continued once")
        try:
            sources = self.check_continue(handle, accepted_lens, first_tokens, budgets, sources)
            live = [i for i in range(len(handle.prompts)) if first_tokens[i] is not None and int(budgets[i]) > 0]
            check_same_length(len(extra_contexts), "extra_contexts", extra_budgets=extra_budgets)
            extra = self.checked_contexts(extra_contexts, extra_budgets, ("extra_contexts", "extra_budgets"))
        except BaseException:
            self.release(handle)
            raise
        handle.used = True
        return live, extra, sources

    def _prefill_rows(self, contexts, budgets, uids, proposers, outs, settings, seed) -> tuple[KVRows, list[DecodeRow]]:
        """Prefill the contexts and sample each first token (keyed at position len(context))."""
        kv, logits = prefill(self.model, contexts, self.pad_id)
        self.stats.prefill_tokens += sum(len(c) for c in contexts)
        self.stats.decode_steps += 1
        dec = self._decoder(settings, seed)
        toks, lps = dec.sample(logits.float(), uids, [len(c) for c in contexts])
        rows = []
        for ctx, budget, uid, prop, out, t, lp in zip(contexts, budgets, uids, proposers, outs, toks, lps):
            row = DecodeRow(out=out, uid=uid, last=t, position=len(ctx), budget=budget, proposer=prop)
            row.tokens, row.logprobs, row.budget = [t], [lp], budget - 1
            row.finish = "eos" if t in dec.eos else ("length" if row.budget <= 0 else None)
            if prop is not None:
                prop.update([], [t])
            rows.append(row)
        return kv, rows

    def _decoder(self, settings, seed) -> SpeculativeDecoder:
        return SpeculativeDecoder(
            self.model, settings, seed, self.eos_ids, self.max_k, self.pad_id, gate=self.tail_gate
        )

    def _decode(self, kv: KVRows, rows: list[DecodeRow], settings, seed, results) -> None:
        dec = self._decoder(settings, seed)
        bar = None
        if self.progress:
            from tqdm.auto import tqdm

            bar = tqdm(desc="decode", leave=False, unit="step")
            dec.on_step = lambda live: bar.update(1)
        try:
            dec.run(kv, rows)
        finally:
            if bar is not None:
                bar.close()
        self.stats.decode_steps += dec.counters.steps
        self.stats.proposed_tokens += dec.counters.proposed
        self.stats.accepted_tokens += dec.counters.accepted
        self.stats.decode_rows += dec.counters.rows
        self.stats.decode_positions += dec.counters.positions
        for r in rows:
            results[r.out] = Continuation(r.tokens, r.logprobs, r.finish or "length")
