"""TransformersBackend: generation with a transformers causal LM and its own KV cache.

* **Scoring** (``score_drafts``): :class:`~spec_rl.backends.scoring.PolicyScorer`, tree-packed per group
  where the model allows it; the forward's keys and values are kept.
* **Continuation** (``continue_from``): each row's K/V of [prompt, y_<n] is gathered from the
  scoring forward into a fresh cache (no second prefill); where the scorer could not keep K/V
  (rows layout) the context is prefilled again and counted in ``stats.reprefill_tokens``.
* **Decoding**: :class:`~spec_rl.backends.hf_decode.SpeculativeDecoder`: keyed sampling (the token at
  absolute position p of sequence uid is a pure function of seed, uid, p and the logits), with
  up to ``max_k`` history-drafted tokens verified per step when a proposer is given: lossless,
  the tokens are those of one-token-per-step decoding.

Sampling follows the settings exactly (temperature, top-k, top-p; no hidden defaults such as
transformers' ``generate`` top_k=50) and stops at any id of the complete EOS set. Token ids are
checked against the model's vocabulary and every context + budget against its
``max_position_embeddings`` before anything runs; no call builds an autograd graph.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..acceptance.scores import DraftScores
from ..sampling.distribution import SamplingSettings
from ..sampling.groups import TreeKV
from ..util.model_config import model_sliding_window
from .checks import ModelLimits, check_same_length
from .hf_decode import DecodeRow, KVRows, SpeculativeDecoder, prefill
from .progressive import ProgressiveTreeScores
from .protocol import BackendStats, Continuation, backend_arguments, split_zero_budgets
from .reprefill import ReprefillBackend, ScoredDrafts
from .scoring import PolicyScorer


class SplicedDrafts(ScoredDrafts):
    """Handle of :meth:`TransformersBackend.score_drafts` when the scoring forward's K/V were kept (a
    :class:`TreeKV`, or the :class:`ProgressiveTreeScores` of :meth:`TransformersBackend.score_drafts_progressive`)."""

    def __init__(self, prompts, drafts, kv: TreeKV | ProgressiveTreeScores):
        super().__init__(prompts, drafts)
        self.kv = kv


class TransformersBackend(ModelLimits, ReprefillBackend):
    """Batched generation with a transformers causal LM (see the module docstring).

    Args:
        model: a transformers ``PreTrainedModel`` with a causal LM head.
        eos_ids: the complete set of end-of-sequence ids (see :func:`~spec_rl.backends.protocol.eos_token_ids`).
        pad_id: id used for padding (any valid id; it is masked out).
        max_batch_size: sequences per decode batch (memory bound).
        progress: show a tqdm bar over decode steps.
        max_tokens_per_forward: chunk bound of the scoring pass (see :class:`~spec_rl.backends.scoring.PolicyScorer`).
        max_k: most history-drafted tokens verified per decode step (0 disables speculation).
        splice: keep the scoring forward's K/V for the continuation (costs memory until it is used).

    Raises:
        ValueError: no EOS id, ``max_batch_size`` < 1, ``max_k`` < 0, or a model with sliding-window attention
            (:func:`~spec_rl.util.model_config.model_sliding_window`).
    """

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
    ):
        self.model = model
        window = model_sliding_window(model)
        if window is not None:
            # Decode batches are left-padded and keep rolled-back columns, so a window counted in cache columns
            # would not be the model's window in tokens: refused rather than silently wrong.
            raise ValueError(
                f"model has sliding-window attention (window {window} tokens), which TransformersBackend's padded "
                "decode batches cannot honour; serve it with VLLMBackend, or set the config's sliding_window to None "
                "if the window never binds at your lengths"
            )
        self.eos_ids, self.pad_id, self.max_batch_size = backend_arguments(eos_ids, pad_id, max_batch_size)
        if isinstance(max_k, bool) or int(max_k) != max_k or max_k < 0:
            raise ValueError(f"max_k must be an integer >= 0 (0 disables speculation), got {max_k!r}")
        self.max_k = int(max_k)
        self.progress = progress
        self.splice = bool(splice)
        self.scorer = PolicyScorer(model, self.pad_id, max_tokens_per_forward)
        self.stats = BackendStats()

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    # ------------------------------------------------------------------ protocol
    @torch.no_grad()
    def generate(
        self, contexts, budgets, settings: SamplingSettings, seed: int, *, uids=None, proposers=None
    ) -> list[Continuation]:
        """Sample up to ``budgets[i]`` tokens after ``contexts[i]``; ``uids[i]`` keys row i's sampling (default i).

        Raises:
            TypeError: non-integer ids or budgets.
            ValueError: mismatched lengths, an empty context, a negative budget, an id outside the
                vocabulary, or a context + budget past ``max_positions``.
        """
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
        """Score the drafts; keep the forward's K/V when :attr:`splice` is on and the tree layout ran.

        Raises:
            ValueError: mismatched lengths, an id outside the vocabulary, or a prompt + draft past ``max_positions``.
        """
        prompts, drafts = self.checked_rows(prompts, drafts)
        scores, kv = self.scorer.score_with_kv(prompts, drafts, keep_kv=self.splice)
        handle = SplicedDrafts(prompts, drafts, kv) if kv is not None else ScoredDrafts(prompts, drafts)
        return scores, handle

    @torch.no_grad()
    def score_drafts_progressive(
        self, prompts, drafts, draft_logprobs=None
    ) -> tuple[DraftScores, SplicedDrafts, ProgressiveTreeScores] | None:
        """Score the drafts where an exact walk may read them, more on demand (:mod:`spec_rl.backends.progressive`;
        ``draft_logprobs``: the stored log-probs, which estimate where walks go), keeping the scored nodes'
        K/V for the continuation. Returns (scores, handle, the progressive scores the walk extends), or None
        where that does not apply (rows layout, or :attr:`splice` off): then :meth:`score_drafts` scores
        everything at once.

        Raises:
            ValueError: as :meth:`score_drafts`, or log-probs shorter than their draft.
        """
        if not (self.scorer.tree and self.splice):
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
        """Continue scored rows from [prompt, y_<n, first token], then generate the extra contexts.

        ``uids``/``proposers`` cover the handle's rows, then the extras. Rows with ``first_tokens[i]``
        None or budget 0 get an empty "length" continuation.

        Raises:
            ValueError: a handle that is not this backend's or was already used; mismatched lengths;
                an id outside the vocabulary or a sequence past ``max_positions``.
        """
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
            self._drop_kv(handle)  # the scoring K/V are no longer needed once gathered (nor after a failure)
        extras = [k for k in range(len(extra_contexts)) if int(extra_budgets[k]) > 0]
        for k in set(range(len(extra_contexts))) - set(extras):
            results[n_rows + k] = Continuation([], [], "length")
        # Spliced rows and extra contexts decode in the same batches (one decode loop, fewer steps).
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
        """Drop the kept K/V of a handle that will not be continued."""
        handle.used = True
        if isinstance(handle, SplicedDrafts):
            self._drop_kv(handle)

    @staticmethod
    def _drop_kv(handle: SplicedDrafts) -> None:
        """Forget the handle's kept K/V; progressive scores also drop theirs (a walk may still hold them)."""
        if isinstance(handle.kv, ProgressiveTreeScores):
            handle.kv.release()
        handle.kv = None

    # ------------------------------------------------------------------ internals
    def _check_spliced(self, handle, accepted_lens, first_tokens, budgets, extra_contexts, extra_budgets, sources):
        """Check a continue_from of a spliced handle (released on an error); returns (live rows, extras, sources)."""
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
        """Prefill the contexts and sample each row's first token (keyed at position len(context))."""
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
        return SpeculativeDecoder(self.model, settings, seed, self.eos_ids, self.max_k, self.pad_id)

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
