"""PagedEngine: generation over a paged KV cache (docs/design.md "Paged KV cache"; SPEC-RL Alg. 1)."""

from __future__ import annotations

import torch

from ...sampling.distribution import SamplingSettings, check_settings
from ...util.validation import check_int, check_type
from ..base import Backend, Continuation, Scored, eos_and_pad
from ..scoring import ScoringHead
from .blocks import BlockManager
from .model_runner import CacheLayout, EngineStats, ModelRunner
from .sampler import KeyedSampler
from .scheduler import Scheduler
from .sequence import ScoredSequences, group_by_context
from .static_decode import DecodeConfig, StaticDecoder


class PagedEngine(Backend):
    """A backend over a paged KV cache for Llama/Qwen2/Qwen3-family models (docs/api.md "Backends"): the scored
    [prompt, draft] K/V stay in the cache, so a continuation cuts each row to prompt + n and decodes on without a
    second prefill.

    ``num_blocks`` defaults to what ``kv_cache_bytes`` holds (1 GiB on CPU, 40% of free CUDA memory);
    ``max_tokens_per_forward`` bounds a prefill or scoring forward (4096 on CPU, 32768 on GPU); ``pad_id`` is unused
    (packed input); ``decode``: how steps without proposals run (:class:`DecodeConfig`: the static-shape step,
    CUDA-graph captured, on CUDA; the packed step on a CPU). A failed call frees every block it took. TypeError for
    non-integer sizes or a ``decode`` not a DecodeConfig; ValueError for ``block_size`` < 1, a cache without a block,
    no EOS id or a sliding-window model.
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
        decode: DecodeConfig | None = None,
    ):
        self.model = model
        self.eos_ids, self.pad_id = eos_and_pad(eos_ids, pad_id)
        self.max_batch_size = check_int("max_batch_size", max_batch_size, low=1)
        self.progress = progress
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
        decode = check_type("decode", DecodeConfig() if decode is None else decode, DecodeConfig)
        self.static = (
            StaticDecoder(self.runner, self.max_batch_size, decode) if decode.uses_static(self.device) else None
        )
        self.epoch = 0  # bumped by every call: a Scored is valid until the next one

    @property
    def stats(self) -> EngineStats:
        return self.runner.stats

    def generate(self, jobs, settings: SamplingSettings, seed: int) -> list[Continuation]:
        """See :meth:`Backend.generate`; a job's proposer hears every token sampled. TypeError or ValueError for bad
        input, OutOfBlocks when one row cannot fit an empty cache."""
        check_settings(settings)
        return self._run(self.checked_jobs(jobs), [], [], settings, seed)

    @torch.no_grad()
    def score(self, prompts, drafts, logprobs=None) -> Scored:
        """As :meth:`~spec_rl.backends.scoring.PolicyScorer.score`, keeping the K/V in the cache; the result goes to
        :meth:`continue_from` once, before any other call (``logprobs`` are not used: everything is scored)."""
        prompts, drafts = self.checked_rows(prompts, drafts)
        self.runner.allocate_cache()
        self.epoch += 1
        dtype = self.runner.layout.dtype if self.head.uses_hidden_states else torch.float32
        max_r = max([len(d) for d in drafts] + [1])
        out = torch.zeros((len(prompts), max_r, self.head.width), dtype=dtype, device=self.device)
        state = ScoredSequences([None] * len(prompts), self.epoch)
        scored = Scored(self.head.draft_scores(out), prompts, drafts, state=state)
        lengths = [len(p) + len(d) for p, d in zip(prompts, drafts)]
        try:
            for rows in self.scheduler.scoring_waves(lengths, scored.state.seq_ids):
                for r, v in zip(rows, self.runner.score(rows, prompts, drafts, scored.state.seq_ids)):
                    out[r, : v.shape[0]] = v.to(out.dtype)
        except BaseException:
            self.release(scored)
            raise
        return scored

    def release(self, scored: Scored) -> None:
        """Free the blocks of scored rows that will not be continued (idempotent)."""
        scored.used = True
        state = scored.state
        if isinstance(state, ScoredSequences):
            for seq_id in state.seq_ids:
                if seq_id is not None and self.blocks.has(seq_id):
                    self.blocks.free(seq_id)
            state.seq_ids = [None] * len(state.seq_ids)

    def continue_from(self, scored: Scored, jobs, settings, seed) -> list[Continuation]:
        """See :meth:`Backend.continue_from`: a job resumes on its cut row's scored sequence cut to prompt + n (a
        copy-on-write fork when another job resumes on it too); its proposer must already know that prefix and the
        token. ``scored`` is freed afterwards, also on an error. TypeError for a foreign ``scored`` or bad
        ``settings``; ValueError for a stale or used one or bad jobs."""
        if not isinstance(scored, Scored) or not isinstance(scored.state, ScoredSequences):
            raise TypeError(f"scored must come from this engine's score, got {type(scored).__name__}")
        try:
            if scored.state.epoch != self.epoch:
                raise ValueError("scored is stale: call continue_from once, right after the score that made it")
            check_settings(settings)
            jobs = self.checked_jobs(jobs, scored)
            resumed, reprefill = self.scheduler.resume_scored_rows(scored, jobs, self.runner.fork_sequence)
        finally:
            self.release(scored)  # frees the rows not resumed
        return self._run(jobs, resumed, reprefill, settings, seed)

    @torch.no_grad()
    def _run(self, jobs, resumed, reprefill, settings, seed) -> list[Continuation]:
        """Prefill the re-prefills and the fresh jobs' contexts, then decode until every sequence finished; on an error
        frees every sequence of the call."""
        from tqdm.auto import tqdm

        self.epoch += 1
        results = [Continuation([], [], "length") if j.budget == 0 else None for j in jobs]
        sampler = KeyedSampler(settings, seed, jobs, self.eos_ids)
        sched, runner = self.scheduler, self.runner
        sched.waiting.extend(reprefill + group_by_context(jobs))
        sched.resumed.extend(resumed)
        try:
            runner.allocate_cache()
            with tqdm(desc="decode", leave=False, unit="tok", disable=not self.progress) as bar:
                while sched.waiting or sched.resumed or sched.running:
                    for wave in sched.prefill_waves(sched.schedule()):
                        sched.running.extend(runner.prefill(wave, sampler))
                    step = [s for s in sched.running if not s.finished]
                    if (
                        step
                        and self.static is not None
                        and all(sampler.proposers[s.result_index] is None for s in step)
                    ):
                        bar.update(self.static.decode(step, sampler))
                    elif step:
                        runner.decode(step, sampler)
                        bar.update(len(step))
                    sched.retire(results)
        except BaseException:
            sched.abort()
            raise
        return results
