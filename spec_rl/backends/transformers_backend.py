"""TransformersBackend: tree-packed scoring whose K/V the continuation reuses (no second prefill), and keyed decoding
that verifies history-drafted tokens per step (docs/design.md "Tail speculation")."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..sampling.distribution import SamplingSettings
from ..util.memory import memory_budget
from ..util.validation import check_int, check_type
from .base import BackendStats, Continuation, Scored, eos_and_pad
from .hf_decode import DecodeRow, KVRows, SpeculativeDecoder, TailGate, prefill
from .kv_buffer import left_padded_cache
from .paged.model_runner import CacheLayout
from .reprefill import ReprefillBackend
from .scoring import PolicyScorer


class TransformersBackend(ReprefillBackend):
    """Batched generation with a transformers causal LM (docs/api.md "Backends"); ``adaptive_tail``: feed history
    proposals only while they pay, by measured step times (:class:`~spec_rl.backends.hf_decode.TailGate`; False: every
    step); ``splice``: keep the scoring K/V for the continuation. ``kv_cache_bytes``: the most the K/V of a decode batch
    or of a kept scoring pass may take (default: a sixteenth of the memory available when built, 40% of free CUDA
    memory): a decode batch holds at most the rows whose K/V at their longest fit it, its buffers (padding, spare and
    rolled-back columns included) within it, and a scoring pass whose K/V would not fit is continued by a prefill
    instead (a kept pass lives until its last cut row's batch is built: a continuation holds at most twice the
    bound). A sliding window is honoured in token positions (left padding
    and rolled-back columns included). ValueError for no EOS id, ``max_batch_size`` < 1 or a ``kv_cache_bytes`` that
    holds no row."""

    def __init__(
        self,
        model,
        eos_ids: set[int] | Sequence[int],
        pad_id: int,
        max_batch_size: int = 256,
        progress: bool = False,
        max_tokens_per_forward: int | None = None,
        splice: bool = True,
        adaptive_tail: bool = True,
        kv_cache_bytes: int | None = None,
    ):
        check_type("model", model, torch.nn.Module, "a transformers causal LM (a torch.nn.Module)")
        self.model = model
        self.eos_ids, self.pad_id = eos_and_pad(eos_ids, pad_id)
        self.max_batch_size = check_int("max_batch_size", max_batch_size, low=1)
        self.kv_cache_bytes = memory_budget(self.device, kv_cache_bytes)
        self.kv_token_bytes = CacheLayout.of(model).bytes_per_block(1)  # K and V of one position, all layers
        if self.kv_cache_bytes < self.kv_token_bytes:
            raise ValueError(
                f"kv_cache_bytes={self.kv_cache_bytes} holds no token's K/V ({self.kv_token_bytes} bytes a position "
                "for this model); raise kv_cache_bytes or leave it unset"
            )
        self.progress = progress
        self.splice = bool(splice)
        self.tail_gate = TailGate() if adaptive_tail else None  # kept across calls: the hardware does not change
        kv_tokens = self.kv_cache_bytes // self.kv_token_bytes
        self.scorer = PolicyScorer(model, self.pad_id, max_tokens_per_forward, max_kv_tokens=kv_tokens)
        self.stats = BackendStats()

    @torch.no_grad()
    def generate(self, jobs, settings: SamplingSettings, seed: int) -> list[Continuation]:
        """See :meth:`Backend.generate`; TypeError or ValueError for bad jobs."""
        return self._decode_jobs(self.checked_jobs(jobs), settings, seed)

    @torch.no_grad()
    def continue_from(self, scored: Scored, jobs, settings, seed) -> list[Continuation]:
        """See :meth:`Backend.continue_from`; ValueError for a foreign or used ``scored`` or bad jobs."""
        if not isinstance(scored, Scored) or scored.state is None:
            return super().continue_from(scored, jobs, settings, seed)
        kv = scored.state
        try:
            jobs = self.checked_jobs(jobs, scored)
            cuts = [i for i, j in enumerate(jobs) if j.cut is not None and j.budget > 0]
            spliced = {i: (kv.prompt_len(jobs[i].cut.row), kv.context(jobs[i].cut.row, jobs[i].cut.n)) for i in cuts}
        finally:
            self.release(scored)  # read, or failed
        del kv  # the contexts hold what they read: the pass goes with the last cut batch's
        return self._decode_jobs(jobs, settings, seed, spliced)

    def _decode_jobs(self, jobs, settings, seed, spliced: dict | None = None) -> list[Continuation]:
        """Decode ``jobs`` in batches whose K/V fit :attr:`kv_cache_bytes` (each row at its longest: context, budget
        and a step's proposal width; at most :attr:`max_batch_size` rows): the cut ones on their gathered K/V
        (``spliced``: job -> (prompt length, its K/V context), emptied: a batch's contexts are read into its buffers
        when it starts, then dropped),
        then the fresh ones after one prefill of their distinct contexts (sorted by length when alone: less left
        padding per batch)."""
        results = [Continuation([], [], "length") if j.budget == 0 else None for j in jobs]
        cut = list((spliced or {}).items())
        if spliced:
            spliced.clear()
        rows = [
            DecodeRow(
                budget=int(jobs[i].budget),
                last=int(jobs[i].cut.token),
                out=i,
                uid=int(jobs[i].uid),
                position=plen + int(jobs[i].cut.n),
                proposer=jobs[i].proposer,
            )
            for i, (plen, _) in cut
        ]
        contexts = [kv for _, (_, kv) in cut]
        del cut
        fresh = [i for i, j in enumerate(jobs) if j.context is not None and j.budget > 0]
        if spliced is None:
            fresh.sort(key=lambda i: len(jobs[i].context))
        # a step feeds every row the batch's widest proposal: up to max_k columns past a row's own budget
        reach = max((int(j.proposer.max_k) for j in jobs if j.proposer is not None), default=0)
        longest = reach + max(
            [r.position + r.budget for r in rows] + [len(jobs[i].context) + jobs[i].budget for i in fresh] + [1]
        )
        kv_tokens = self.kv_cache_bytes // self.kv_token_bytes
        per_batch = min(self.max_batch_size, max(1, kv_tokens // longest))
        for start in range(0, len(rows) + len(fresh), per_batch):
            end = start + per_batch
            part, ex = rows[start:end], fresh[max(0, start - len(rows)) : max(0, end - len(rows))]
            columns = max(longest, kv_tokens // (len(part) + len(ex)))  # the batch's buffers within the bound
            kv = None
            if part:
                kv = KVRows(*left_padded_cache(contexts[start:end], columns), columns)
                contexts[start:end] = [None] * len(part)
            if ex:
                kv_e, rows_e = self._prefill_rows([jobs[i] for i in ex], ex, settings, seed, columns)
                kv, part = (kv_e, rows_e) if kv is None else (kv.concat(kv_e), part + rows_e)
                del kv_e
            self._decode(kv, part, settings, seed, results)
            del kv  # one batch's cache at a time
        return results  # type: ignore[return-value]

    def _prefill_rows(self, jobs, outs, settings, seed, max_columns=None) -> tuple[KVRows, list[DecodeRow]]:
        """Prefill the jobs' contexts and sample each first token (keyed at position len(context))."""
        contexts = [list(j.context) for j in jobs]
        kv, logits = prefill(self.model, contexts, self.pad_id, max_columns)
        self.stats.prefill_tokens += sum(len(c) for c in contexts)
        self.stats.decode_steps += 1
        dec = self._decoder(settings, seed)
        toks, lps = dec.sample(logits.float(), [int(j.uid) for j in jobs], [len(c) for c in contexts])
        rows = []
        for ctx, job, out, t, lp in zip(contexts, jobs, outs, toks, lps):
            row = DecodeRow(budget=int(job.budget), out=out, uid=int(job.uid), position=len(ctx), proposer=job.proposer)
            row.emit([t], [lp], dec.eos)
            if job.proposer is not None:
                job.proposer.update([], [t])
            rows.append(row)
        return kv, rows

    def _decoder(self, settings, seed) -> SpeculativeDecoder:
        return SpeculativeDecoder(
            self.model, settings, seed, self.eos_ids, self.pad_id, gate=self.tail_gate, stats=self.stats
        )

    def _decode(self, kv: KVRows, rows: list[DecodeRow], settings, seed, results) -> None:
        from tqdm.auto import tqdm

        dec = self._decoder(settings, seed)
        with tqdm(desc="decode", leave=False, unit="step", disable=not self.progress) as bar:
            dec.on_step = lambda live: bar.update(1)
            dec.run(kv, rows)
        for r in rows:
            results[r.out] = r.continuation()

    def keeps_kv(self, positions: int) -> bool:
        """Whether a scoring pass's K/V of ``positions`` token positions (padding included) fit ``kv_cache_bytes``:
        kept for the continuation, else the continuation prefills again."""
        return positions * self.kv_token_bytes <= self.kv_cache_bytes
