"""PagedEngine: batched generation over a paged KV cache, with draft splicing.

The engine only connects its parts (docs/design.md "Paged KV cache"): the
:class:`~spec_rl.engine.blocks.BlockManager` (refcounted blocks, copy-on-write),
the :class:`~spec_rl.engine.scheduler.Scheduler` (what runs next) and the
:class:`~spec_rl.engine.model_runner.ModelRunner` (packed forwards, sampling).

- :meth:`PagedEngine.generate` prefills, then decodes the active sequences
  together. Identical contexts (the G samples of a group) are prefilled once
  and forked: they share the prompt's blocks.
- Sampling is keyed (docs/design.md "Randomness"): the token at absolute
  position p of the row with uid u depends only on (seed, u, p) and the
  logits, not on the batch. With per-row proposers, a decode step also feeds
  up to ``max_k`` tokens drafted from the prompt's history and keeps those the
  policy samples itself (:mod:`spec_rl.engine.sampler`); the output is the
  same as without them, in fewer decode steps.
- The speculative path (paper Sec. 3, Alg. 1; docs/design.md "The rule"):
  :meth:`PagedEngine.score_drafts` runs one forward over [prompt, draft] per
  row, keeps the K/V in the cache and returns the per-draft-token scores; after
  verification :meth:`PagedEngine.continue_from` cuts each row to prompt + n
  (or forks the row whose draft holds its verified prefix), feeds the token
  sampled at position prompt + n and decodes on. Nothing is
  prefilled twice unless blocks ran out (counted in ``stats.reprefill_tokens``).
"""

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
    """Generation backend over a paged KV cache for transformers causal LMs (Llama, Qwen2, Qwen3 families).

    Args:
        model: a transformers causal LM whose attention modules dispatch through
            ``AttentionInterface`` (all current Llama/Qwen2/Qwen3 code does).
        eos_ids: the complete EOS set (:func:`spec_rl.backends.protocol.eos_token_ids`).
        pad_id: kept for interface parity with TransformersBackend (packed input needs no padding).
        block_size: tokens per KV block (default 16).
        num_blocks: blocks in the cache; default: as many as ``kv_cache_bytes`` allows.
        kv_cache_bytes: KV memory budget in bytes when ``num_blocks`` is None
            (default 1 GiB on CPU, 40% of free memory on CUDA); it must hold at least one block.
        max_batch_size: most sequences decoded together.
        max_tokens_per_forward: most tokens in one prefill/scoring forward
            (default 4096 on CPU, 32768 on GPU).
        progress: tqdm bar over decode steps.
        max_k: most proposed tokens fed per sequence and decode step when the caller passes
            proposers (default 8; 0 turns speculation off).

    Token ids are checked against :attr:`vocab_size` and every context + budget against
    :attr:`max_positions` before a block is taken; a call that fails (bad arguments, or an error
    inside a forward) frees every block it took.

    Raises:
        TypeError: non-integer sizes.
        ValueError: bad sizes (``block_size`` < 1, a ``kv_cache_bytes`` that holds no block), a
            negative ``max_k``, empty ``eos_ids``, or a model with sliding-window layers.
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
        if isinstance(max_k, bool) or int(max_k) != max_k or max_k < 0:
            raise ValueError(f"max_k must be an integer >= 0, got {max_k!r}")
        self.max_k = int(max_k)
        if max_tokens_per_forward is None:
            max_tokens_per_forward = 32768 if self.device.type == "cuda" else 4096
        if max_tokens_per_forward < 1:
            raise ValueError(f"max_tokens_per_forward must be >= 1, got {max_tokens_per_forward}")
        self.max_tokens_per_forward = int(max_tokens_per_forward)
        layout = CacheLayout.from_model(model)  # rejects sliding-window layers and unsupported dtypes
        block_size = check_int("block_size", block_size, low=1)
        if num_blocks is None:
            num_blocks = layout.num_blocks_for(block_size, self.device, kv_cache_bytes)
        self.blocks = BlockManager(num_blocks, block_size)  # validates both
        self.block_size = self.blocks.block_size
        self.head = ScoringHead(model)  # decides hidden-state vs logits scoring
        self.runner = ModelRunner(model, self.head, self.blocks, layout)
        self.scheduler = Scheduler(self.blocks, self.max_batch_size, self.max_tokens_per_forward)
        self.epoch = 0  # bumped by every call: a SpliceHandle is valid only right after its score_drafts

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def stats(self) -> EngineStats:
        """Counters since construction or :meth:`reset_stats` (a :class:`~spec_rl.backends.protocol.BackendStats`)."""
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
        """Sample up to ``budgets[i]`` tokens after ``contexts[i]`` (GenerationBackend protocol).

        Args:
            uids: per context, the uid that keys its sampling uniforms (default: 0..n-1).
                The token at absolute position p (= tokens before it) is keyed by (seed, uid, p).
            proposers: per context, None or a proposer of drafts for its next tokens
                (:class:`~spec_rl.drafts.history.SuffixProposer`, built for an empty response);
                default: no speculation. It is told every token sampled for its row.

        Returns one :class:`~spec_rl.backends.protocol.Continuation` per context, in order.

        Raises:
            TypeError: non-integer ids or budgets.
            ValueError: mismatched lengths, an empty context, a negative budget, an id outside the
                vocabulary, or a context + budget past :attr:`max_positions`.
            OutOfBlocks: one context plus its budget cannot fit even in an empty cache.
        """
        check_same_length(len(contexts), "contexts", budgets=budgets)
        contexts = self.checked_contexts(contexts, budgets)
        sampler = self._sampler(settings, seed, len(contexts), uids, proposers, "contexts")
        results: list[Continuation | None] = [None] * len(contexts)
        groups = group_by_context(contexts, budgets, results)
        return self._run(groups, [], results, sampler)

    def _sampler(self, settings, seed: int, rows: int, uids, proposers, what: str) -> KeyedSampler:
        """The :class:`KeyedSampler` of one call, after checking ``settings``, ``uids`` and ``proposers``."""
        check_settings(settings)
        uids = list(range(rows)) if uids is None else [int(u) for u in uids]
        proposers = [None] * rows if proposers is None else list(proposers)
        check_same_length(rows, what, uids=uids, proposers=proposers)
        return KeyedSampler(settings, seed, uids, proposers, self.max_k, self.eos_ids)

    @torch.no_grad()
    def score_drafts(
        self, prompts: Sequence[Sequence[int]], drafts: Sequence[Sequence[int]]
    ) -> tuple[DraftScores, SpliceHandle]:
        """One forward over [prompt, draft] per row; K/V stay in the paged cache.

        Same output contract as :meth:`spec_rl.backends.scoring.PolicyScorer.score`: row i of the
        returned :class:`~spec_rl.acceptance.scores.DraftScores` scores draft token i (the output at
        position len(prompt) - 1 + i), R = max draft length (at least 1).

        Returns:
            (scores, handle): pass the handle to :meth:`continue_from` exactly once;
            no other engine call may run in between.

        Raises:
            TypeError: non-integer ids.
            ValueError: mismatched lengths, an empty prompt, an id outside the vocabulary, or a
                prompt + draft past :attr:`max_positions`.
            OutOfBlocks: one row cannot fit even in an empty cache.
        """
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
        """Free the cache blocks of a handle that will not be continued (idempotent)."""
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
        """Continue scored rows from their verified prefix, without prefilling it again.

        Row i continues [prompt, drafts[s][:n], first_tokens[i]] with s = ``sources[i]``
        (default i) and n = ``accepted_lens[i]``: it resumes on the scored sequence
        of row s cut to prompt + n tokens (a row continuing another row's draft gets a
        copy-on-write fork of it, so several rows may share one source, and the
        source itself may continue with another n or be released).
        ``first_tokens[i]`` (sampled by the caller from the scoring output at
        position prompt + n - 1) is fed at position prompt + n, and up to
        ``budgets[i]`` more tokens are sampled. A row with ``first_tokens[i]`` None
        or ``budgets[i]`` == 0 is just released (empty "length" continuation).
        ``extra_contexts`` are generated from scratch in the same decode batches
        (as :meth:`generate`). Every sequence of the handle is freed afterwards,
        also when an argument is rejected.

        ``uids`` and ``proposers`` (as in :meth:`generate`) cover the handle's rows
        first, then ``extra_contexts``; uids default to 0..n-1. A row's proposer must
        already know its verified prefix and ``first_tokens[i]``.

        Returns:
            Continuations for the handle's rows (not including ``first_tokens``),
            then for ``extra_contexts``.

        Raises:
            TypeError: ``handle`` does not come from :meth:`score_drafts`, or bad ``settings``.
            ValueError: stale or reused handle, mismatched lengths, a source that is not a
                row of the same prompt, n outside [0, len(draft of the source)].
        """
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
            self.release(handle)  # rows not resumed: their blocks are free from here on
        return self._run(groups + extra, resumed, results, sampler)

    @torch.no_grad()
    def _run(self, groups, resumed, results: list[Continuation | None], sampler: KeyedSampler):
        """Schedule, prefill and decode until every sequence finished; fills ``results``.

        On any error every sequence of the call (``resumed`` included) is freed before it propagates.
        """
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
