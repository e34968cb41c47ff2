"""PagedEngine: generation over a paged KV cache (docs/design.md "Paged KV cache"). Scored [prompt, draft] K/V stay in
the cache, so a continuation cuts each row to prompt + n and decodes on without a second prefill (SPEC-RL Alg. 1)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..acceptance.scores import DraftScores
from ..backends.checks import ModelLimits, check_same_length
from ..backends.protocol import Continuation, GenerationBackend, backend_arguments
from ..backends.scoring import ScoringHead
from ..sampling.distribution import SamplingSettings, check_settings
from ..util.validation import check_int
from .blocks import BlockManager
from .model_runner import CacheLayout, EngineStats, ModelRunner
from .sampler import KeyedSampler
from .scheduler import Scheduler
from .sequence import SpliceHandle, group_by_context


class PagedEngine(ModelLimits, GenerationBackend):
    """Generation backend over a paged KV cache for Llama/Qwen2/Qwen3-family models (docs/api.md "Generation backends").

    ``num_blocks`` defaults to what ``kv_cache_bytes`` holds (1 GiB on CPU, 40% of free CUDA memory);
    ``max_tokens_per_forward`` bounds a prefill or scoring forward (4096 on CPU, 32768 on GPU); ``pad_id`` is unused
    (packed input). A failed call frees every block it took. TypeError for non-integer sizes; ValueError for
    ``block_size`` < 1, a cache without a block, ``max_k`` < 0, no EOS id or a sliding-window model.
    """

    def __init__(
        self,
        model,
        eos_ids,
        pad_id: int,
        block_size: int = 16,
        num_blocks: int | None = None,
        kv_cache_bytes: int | None = None,
        max_batch_size: int = 256,
        max_tokens_per_forward: int | None = None,
        progress: bool = False,
        max_k: int = 8,
    ):
        self.model = model
        self.eos_ids, self.pad_id, self.max_batch_size = backend_arguments(eos_ids, pad_id, max_batch_size)
        self.progress = progress
        self.max_k = check_int("max_k", max_k, low=0, hint=" (0 turns speculation off)")
        if max_tokens_per_forward is None:
            max_tokens_per_forward = 32768 if self.device.type == "cuda" else 4096
        self.max_tokens_per_forward = check_int("max_tokens_per_forward", max_tokens_per_forward, low=1)
        layout = CacheLayout.from_model(model)
        block_size = check_int("block_size", block_size, low=1)
        if num_blocks is None:
            num_blocks = layout.num_blocks_for(block_size, self.device, kv_cache_bytes)
        self.blocks = BlockManager(num_blocks, block_size)
        self.block_size = self.blocks.block_size
        self.head = ScoringHead(model)
        self.runner = ModelRunner(model, self.head, self.blocks, layout)
        self.scheduler = Scheduler(self.blocks, self.max_batch_size, self.max_tokens_per_forward)
        self.epoch = 0  # bumped by every call: a SpliceHandle is valid until the next one

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def stats(self) -> EngineStats:
        return self.runner.stats

    def reset_stats(self) -> None:
        self.runner.stats = EngineStats()

    def generate(
        self,
        contexts: Sequence[Sequence[int]],
        budgets: Sequence[int],
        settings: SamplingSettings,
        seed: int,
        *,
        uids: Sequence[int] | None = None,
        proposers: Sequence[object | None] | None = None,
    ) -> list[Continuation]:
        """See :meth:`GenerationBackend.generate`; ``proposers`` (built for an empty response) hear every token sampled.
        TypeError or ValueError for bad input, OutOfBlocks when one row cannot fit an empty cache."""
        check_same_length(len(contexts), "contexts", budgets=budgets)
        contexts = self.checked_contexts(contexts, budgets)
        sampler = self._sampler(settings, seed, len(contexts), uids, proposers, "contexts")
        results: list[Continuation | None] = [None] * len(contexts)
        groups = group_by_context(contexts, budgets, results)
        return self._run(groups, [], results, sampler)

    def _sampler(self, settings, seed: int, rows: int, uids, proposers, what: str) -> KeyedSampler:
        check_settings(settings)
        uids = list(range(rows)) if uids is None else [int(u) for u in uids]
        proposers = [None] * rows if proposers is None else list(proposers)
        check_same_length(rows, what, uids=uids, proposers=proposers)
        return KeyedSampler(settings, seed, uids, proposers, self.max_k, self.eos_ids)

    @torch.no_grad()
    def score_drafts(
        self, prompts: Sequence[Sequence[int]], drafts: Sequence[Sequence[int]]
    ) -> tuple[DraftScores, SpliceHandle]:
        """As :meth:`~spec_rl.backends.scoring.PolicyScorer.score`, keeping the K/V; the handle goes to
        :meth:`continue_from` once, before any other call."""
        check_same_length(len(prompts), "prompts", drafts=drafts)
        prompts, drafts = self.checked_rows(prompts, drafts)
        self.runner.allocate_cache()
        self.epoch += 1
        dtype = self.runner.layout.dtype if self.head.uses_hidden_states else torch.float32
        max_r = max([len(d) for d in drafts] + [1])
        out = torch.zeros((len(prompts), max_r, self.head.width), dtype=dtype, device=self.device)
        handle = SpliceHandle(prompts, drafts, [None] * len(prompts), self.epoch)
        lengths = [len(p) + len(d) for p, d in zip(prompts, drafts)]
        try:
            for rows in self.scheduler.scoring_waves(lengths, handle.seq_ids):
                for r, v in zip(rows, self.runner.score(rows, prompts, drafts, handle.seq_ids)):
                    out[r, : v.shape[0]] = v.to(out.dtype)
        except BaseException:
            self.release(handle)
            raise
        return self.head.draft_scores(out), handle

    def release(self, handle: SpliceHandle) -> None:
        """Free the blocks of a handle that will not be continued (idempotent)."""
        for seq_id in handle.seq_ids:
            if seq_id is not None and self.blocks.has(seq_id):
                self.blocks.free(seq_id)
        handle.seq_ids = [None] * len(handle.seq_ids)
        handle.used = True

    def continue_from(
        self,
        handle: SpliceHandle,
        accepted_lens: Sequence[int],
        first_tokens: Sequence[int | None],
        budgets: Sequence[int],
        settings: SamplingSettings,
        seed: int,
        extra_contexts: Sequence[Sequence[int]] = (),
        extra_budgets: Sequence[int] = (),
        *,
        uids: Sequence[int] | None = None,
        proposers: Sequence[object | None] | None = None,
        sources: Sequence[int] | None = None,
    ) -> list[Continuation]:
        """See :meth:`GenerationBackend.continue_from`: row i resumes on row ``sources[i]``'s scored sequence cut to
        prompt + n (a copy-on-write fork when it is another row's); its proposer must already know that prefix and the
        first token. The handle is freed afterwards, also on an error. TypeError for a foreign handle or bad
        ``settings``; ValueError for a stale or used handle or bad rows."""
        if not isinstance(handle, SpliceHandle):
            raise TypeError(f"handle must come from score_drafts, got {type(handle).__name__}")
        if handle.used or handle.epoch != self.epoch:
            self.release(handle)
            raise ValueError("handle is stale: call continue_from once, right after the score_drafts that made it")
        rows = len(handle.seq_ids)
        results: list[Continuation | None] = [None] * (rows + len(extra_contexts))
        try:
            sources = self.check_continue(handle, accepted_lens, first_tokens, budgets, sources)
            check_same_length(len(extra_contexts), "extra_contexts", extra_budgets=extra_budgets)
            sampler = self._sampler(
                settings, seed, rows + len(extra_contexts), uids, proposers, "the handle's rows + extra_contexts"
            )
            names = ("extra_contexts", "extra_budgets")
            extra_contexts = self.checked_contexts(extra_contexts, extra_budgets, names)
            extra = group_by_context(extra_contexts, extra_budgets, results, names, rows)
            resumed, groups = self.scheduler.resume_scored_rows(
                handle, accepted_lens, first_tokens, budgets, results, sources, self.runner.fork_sequence
            )
        finally:
            self.release(handle)  # frees the rows not resumed
        return self._run(groups + extra, resumed, results, sampler)

    @torch.no_grad()
    def _run(self, groups, resumed, results: list[Continuation | None], sampler: KeyedSampler):
        """Schedule, prefill and decode until every sequence finished; on an error frees every sequence of the call."""
        self.epoch += 1
        sched, runner = self.scheduler, self.runner
        sched.add(groups, resumed)
        bar = None
        try:
            self.runner.allocate_cache()
            if self.progress:
                from tqdm.auto import tqdm

                bar = tqdm(desc="decode", leave=False, unit="tok")
            while sched.has_work:
                for wave in sched.prefill_waves(sched.schedule()):
                    sched.running.extend(runner.prefill(wave, sampler))
                step = [s for s in sched.running if not s.finished]
                if step:
                    runner.decode(step, sampler)
                    if bar is not None:
                        bar.update(len(step))
                sched.retire(results)
        except BaseException:
            sched.abort()
            raise
        finally:
            if bar is not None:
                bar.close()
        return results
