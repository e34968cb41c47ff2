"""Speculative rollout: reuse last epoch's responses as drafts (SPEC-RL Sec. 3, Alg. 1; docs/design.md "Data flow of one
step"): look up, score and verify each draft, take the token at the rejection index n from the scoring output, continue
from [prompt, y_<n, token], and store the responses as next epoch's drafts."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..acceptance.dispatch import BACKENDS
from ..acceptance.mode import RolloutMode
from ..acceptance.prefixes import DraftRows, Prefixes, verified_prefixes
from ..backends.base import Backend, BackendStats, Cut, Job, Scored, token_ids
from ..backends.contract import (
    BackendContractError,
    backend_name,
    check_backend,
    check_continuations,
    check_model_len,
    check_scored,
    check_shared_outputs,
)
from ..drafts.cache import CacheKey, DraftStore
from ..drafts.history import HistoryIndex
from ..sampling.distribution import SamplingSettings, check_settings
from ..sampling.philox import SEED_SALT_CONTINUATION, mix_seed
from ..util.validation import check_choice, check_int
from .sample import Sample, look_up
from .types import (
    RolloutRequest,
    RolloutResult,
    RolloutStats,
    check_draft_ids,
    check_store,
    check_unique_samples,
    request_prompts,
)

__all__ = ["BackendContractError", "RolloutRequest", "RolloutResult", "RolloutStats", "SpeculativeRollout"]


@dataclass
class _Batch:
    """State of one :meth:`SpeculativeRollout.run` call: one :class:`~.sample.Sample` per request, the requests with
    a draft (``drafted``, in the order of the scored rows), and what the call shares."""

    samples: list[Sample]
    step: int
    seed: int  # this step's seed (acceptance uniforms)
    store: DraftStore
    stats: RolloutStats
    vocab_size: int | None = None  # the backend's, else the scoring pass's V
    drafted: list[int] = field(default_factory=list)

    @property
    def sample_seed(self) -> int:
        """Seed of the sampled tokens: the token at n and the whole continuation."""
        return self.seed ^ SEED_SALT_CONTINUATION


class ReuseGate:
    """Whether scoring this call's drafts will pay, from what the last scored call measured: reuse pays when the
    accepted tokens' generation time (``accepted x`` seconds per generated token) exceeds the scoring time, or at
    least :attr:`MIN_SHARE` of the draft tokens were accepted. Used by the exact rule only, whose output does not
    depend on the drafts (keyed samples: the same tokens with or without them), so skipping is purely a saving. After
    a call that did not pay, drafts are scored again every :attr:`RETRY_EVERY` calls, to notice when the policy makes
    them pay again."""

    RETRY_EVERY = 4
    #: Drafts accepted at least this share of their tokens are always scored (a timing is noisy; a share is not).
    MIN_SHARE = 0.1

    def __init__(self):
        self.pays: bool | None = None
        self.skipped = 0

    def score(self) -> bool:
        if self.pays is not False or self.skipped + 1 >= self.RETRY_EVERY:
            self.skipped = 0
            return True
        self.skipped += 1
        return False

    def record(self, stats: RolloutStats) -> None:
        per_generated = stats.generation_seconds / max(stats.tokens_generated, 1)
        share = stats.accepted_tokens / max(stats.draft_tokens, 1)
        self.pays = share >= self.MIN_SHARE or stats.accepted_tokens * per_generated > stats.scoring_seconds


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class SpeculativeRollout:
    """Speculative rollouts over a generation backend (docs/api.md "Rollout").

    ``mode`` defaults to SPEC-RL's lenient rule at e^0.5 with tail speculation; each step's seed is ``mix_seed(seed,
    step)``; ``history`` (default: a new index when ``mode.tail``) is what tail speculation drafts from;
    ``old_policies`` (:class:`~spec_rl.rollout.old_policy.PolicyVersions`) holds the weights of the steps whose
    responses are drafts, which a mode drawing from the residual needs (a draft whose step is not kept is not reused).
    TypeError for arguments of the wrong kind; ValueError for no EOS id or one outside the vocabulary,
    ``max_model_len`` < 2 or past the model's positions, a history without tail speculation, or a residual-draw mode
    without ``old_policies``.
    """

    def __init__(
        self,
        backend: Backend,
        cache: DraftStore,
        settings: SamplingSettings,
        eos_ids: Sequence[int],
        max_model_len: int,
        mode: RolloutMode | str = "spec",
        seed: int = 0,
        history: HistoryIndex | None = None,
        verify_backend: str = "auto",
        old_policies=None,
    ):
        check_backend(backend)
        check_settings(settings)
        mode = RolloutMode.parse(mode)
        if not eos_ids:
            raise ValueError("eos_ids must list at least one end-of-sequence id")
        if history is not None and not mode.tail:
            raise ValueError("history is what tail speculation drafts from, and this mode has tail=0; drop it")
        if mode.rule is not None and mode.rule.needs_old_policy and old_policies is None:
            raise ValueError(
                f"mode {mode.rule.describe()} draws from the residual max(0, p - q) and needs q: pass "
                "old_policies=PolicyVersions(model, pad_id) and keep each step's weights before its update"
            )
        vocab = backend.vocab_size
        self.eos_ids = set(token_ids("eos_ids", list(eos_ids), vocab, backend_name(backend)))
        self.max_model_len = check_model_len(max_model_len, backend)
        self.backend = backend
        self.cache = check_store("cache", cache)
        self.settings = settings
        self.mode = mode
        self.seed = check_int("seed", seed)
        self.verify_backend = check_choice("verify_backend", verify_backend, BACKENDS)
        self.history = (HistoryIndex() if history is None else history) if mode.tail else None
        self.reuse_gate = ReuseGate() if mode.rule is not None and mode.rule.keyed_walk else None
        self.old_policies = old_policies if mode.rule is not None and mode.rule.needs_old_policy else None

    @property
    def vocab_size(self) -> int | None:
        """The backend's ``vocab_size`` (None: unknown until a scoring pass gives V)."""
        return self.backend.vocab_size

    def run(
        self, requests: Sequence[RolloutRequest], step: int, *, seed: int | None = None, cache: DraftStore | None = None
    ) -> RolloutResult:
        """One response per request, stored with version ``step``; ``seed``/``cache`` override the constructor's. Runs
        under ``torch.no_grad()`` (not ``inference_mode``: stored drafts stay ordinary tensors). TypeError or ValueError
        for bad requests (docs/api.md "Rollout"), BackendContractError when the backend breaks its contract."""
        with torch.no_grad():
            return self._run(requests, step, seed, cache)

    def _run(self, requests, step, seed, cache) -> RolloutResult:
        t0 = time.perf_counter()
        counters0 = self.backend.stats.copy()
        batch = self._plan(requests, step, seed, cache)
        self._lookup(batch)
        gated = self.reuse_gate is not None and bool(batch.drafted)
        if gated and not self.reuse_gate.score():
            batch.drafted, gated = [], False  # lossless either way: the same tokens are decoded from the prompt
        t1 = time.perf_counter()
        handle = self._score_and_verify(batch) if batch.drafted else None
        t2 = time.perf_counter()
        self._continue(batch, handle)
        t3 = time.perf_counter()
        self._store(batch)
        stats = batch.stats
        self._count_backend(batch, counters0)
        stats.assembly_seconds = (t1 - t0) + (time.perf_counter() - t3)
        stats.scoring_seconds, stats.generation_seconds = t2 - t1, t3 - t2
        if gated:
            self.reuse_gate.record(stats)
        drafted = set(batch.drafted)
        return RolloutResult(
            prompt_ids=[x.prompt_ids for x in batch.samples],
            response_ids=[x.tokens for x in batch.samples],
            logprobs=[x.logprobs for x in batch.samples],
            behaviour_logprobs=[x.behaviour for x in batch.samples],
            finish_reasons=[x.finish or "length" for x in batch.samples],
            verified_prefix_len=[x.n for x in batch.samples],
            draft_found=[i in drafted for i in range(len(batch.samples))],
            stats=stats,
        )

    def _plan(self, requests, step, seed, cache) -> _Batch:
        """Validate the requests; budgets, cache keys and this step's seed."""
        step = check_int("step", step, low=0, hint=" (the training step: the version stored with the drafts)")
        seed = self.seed if seed is None else check_int("seed", seed)
        store = self.cache if cache is None else check_store("cache", cache)
        prompts = request_prompts(requests, self.vocab_size, backend_name(self.backend))
        samples = [
            Sample.make(p, r.slot, r.dataset_id, self.settings.budget(len(p), self.max_model_len, f"requests[{i}]"))
            for i, (p, r) in enumerate(zip(prompts, requests))
        ]
        check_unique_samples([x.key for x in samples])
        if self.mode.reuses_drafts and self.backend.owner is not None:  # DraftOwnerError: another model's drafts
            store.claim(self.backend.owner, f"the cache given to the rollout ({type(store).__name__})")
        if self.history is not None:
            for x, p, r in zip(samples, prompts, requests):
                x.group_key = CacheKey.make(p, 0, r.dataset_id).digest
        stats = RolloutStats(num_samples=len(prompts))
        # coupled keys: every step samples under step 0's keys, the noise its drafts were drawn with
        key_step = 0 if self.mode.rule is not None and self.mode.rule.shared_keys else step
        return _Batch(samples, step, mix_seed(seed, key_step), store, stats, self.vocab_size)

    def _lookup(self, batch: _Batch) -> None:
        """Drafts from the store, cut to what today's budget and EOS set make a response (:func:`~.sample.look_up`;
        none when the mode reuses none); a draft past the mode's age bound or (residual draw) of a step whose weights
        are not kept is dropped: its slot samples fresh."""
        versions = self.old_policies
        usable = (lambda d: d.version in versions) if versions is not None else (lambda d: True)
        look_up(batch.samples, batch.store, self.settings, self.mode, self.eos_ids, usable)
        batch.stats.drafts_dropped = sum(x.dropped for x in batch.samples)
        batch.drafted = [i for i, x in enumerate(batch.samples) if x.draft_ids]
        batch.stats.drafts_found = len(batch.drafted)
        check_draft_ids([x.draft for x in batch.samples], batch.drafted, batch.vocab_size, backend_name(self.backend))

    def _score_and_verify(self, batch: _Batch) -> Scored:
        """Score the valid part of each draft, verify it under the rule (exact: keyed samples walk down the group's
        draft trie) and take the token at n."""
        drafted = [batch.samples[i] for i in batch.drafted]
        prompts, draft_ids = [x.prompt_ids for x in drafted], [x.draft_ids for x in drafted]
        rows = DraftRows(
            prompts,
            draft_ids,
            [torch.tensor(x.old_logprobs) for x in drafted],
            [x.key.uid for x in drafted],
            batch.seed,
            batch.sample_seed,
            self.settings,
            self.verify_backend,
            [x.draft.version for x in drafted],
            self.old_policies,
            [torch.tensor(x.draft_behaviour) for x in drafted],
        )
        stored = [x.old_logprobs for x in drafted] if self.mode.rule.keyed_walk else None  # the walk scores lazily
        scored = self.backend.score(prompts, draft_ids, stored)
        try:
            check_scored(scored, len(draft_ids), max(len(d) for d in draft_ids), self._source("score"))
            scores = scored.scores
            if scored.progressive is None:  # progressive scores fill same_as as the walk goes
                check_shared_outputs(scores.same_as, prompts, draft_ids, self._source("score"))
            batch.vocab_size = batch.vocab_size or scores.vocab_size
            walk = verified_prefixes(self.mode.rule, rows, scores, scored.progressive)
            batch.stats.log_lenience, batch.stats.reused_drift = self.mode.log_lenience, walk.drift
            batch.stats.draft_tokens = sum(len(d) for d in draft_ids)
            batch.stats.accepted_tokens = sum(walk.n)
            for row, x in enumerate(drafted):
                self._accept_prefix(batch, x, walk, row, drafted[walk.source[row]].draft_end)
            _sync(self.backend.device)
        except BaseException:
            if isinstance(scored, Scored):
                self.backend.release(scored)
            raise
        return scored

    def _source(self, method: str) -> str:
        return f"{backend_name(self.backend)}.{method}"

    def _accept_prefix(self, batch: _Batch, x: Sample, walk: Prefixes, row: int, end_reason: str | None) -> None:
        """Keep the verified prefix and token at n; a draft accepted whole that is only a prefix today is continued."""
        behaviour = walk.logprobs[row] if walk.behaviour is None else walk.behaviour[row]
        x.keep(walk.tokens[row], walk.logprobs[row], behaviour, walk.n[row])
        x.kv_len, x.source = walk.n[row], walk.source[row]
        token = walk.next_token[row]
        if token is None:
            if end_reason is not None:
                batch.stats.full_reuse_count += 1
                x.finish = end_reason
            else:
                x.kv_len -= 1  # the continuation feeds the draft's last token itself
            return
        lp = walk.next_logprob[row]
        x.extend([token], [lp], [lp if walk.next_behaviour is None else walk.next_behaviour[row]])
        batch.stats.tokens_generated += 1
        if token in self.eos_ids:
            x.finish = "eos"
        elif len(x.tokens) >= x.budget:
            x.finish = "length"

    def _continue(self, batch: _Batch, scored: Scored | None) -> None:
        """Decode the unfinished requests: drafted ones after their verified prefix, the others from the prompt."""
        drafted = set(batch.drafted)
        order = batch.drafted + [i for i in range(len(batch.samples)) if i not in drafted]
        order = [i for i in order if batch.samples[i].finish is None]
        jobs = []
        for i in order:
            x = batch.samples[i]
            resumes = i in drafted
            jobs.append(
                Job(
                    budget=x.budget - len(x.tokens),
                    uid=x.key.uid,
                    context=None if resumes else x.prompt_ids + x.tokens,
                    cut=Cut(x.source, x.kv_len, x.tokens[-1]) if resumes else None,
                    proposer=self._proposer(x),
                )
            )
        seed, source = batch.sample_seed, self._source("generate" if scored is None else "continue_from")
        if scored is None:
            conts = self.backend.generate(jobs, self.settings, seed) if jobs else []
        else:
            try:
                conts = self.backend.continue_from(scored, jobs, self.settings, seed)
            except BaseException:
                self.backend.release(scored)
                raise
        check_continuations(
            conts, [j.budget for j in jobs], source=source, vocab_size=batch.vocab_size, eos_ids=self.eos_ids
        )
        for i, c in zip(order, conts):
            x = batch.samples[i]
            x.extend(c.token_ids, c.logprobs)
            x.finish = c.finish_reason
            batch.stats.tokens_generated += len(c.token_ids)
        _sync(self.backend.device)

    def _proposer(self, x: Sample):
        """Sample ``x``'s tail-speculation proposer over its prompt's history (None without tail speculation)."""
        if self.history is None:
            return None
        return self.history.proposer(x.group_key, x.tokens, self.mode.tail, self.backend.vocab_size)

    def _store(self, batch: _Batch) -> None:
        """Every response becomes next epoch's draft of its request and enters the prompt's history."""
        for x in batch.samples:
            x.store(batch.store, batch.step, self.settings)
            if self.history is not None:
                self.history.add(x.group_key, x.tokens)
        batch.stats.vanilla_tokens = sum(len(x.tokens) for x in batch.samples)

    def _count_backend(self, batch: _Batch, before: BackendStats) -> None:
        """The backend's counters over this call, and the most tokens one request generated."""
        now, s = self.backend.stats, batch.stats
        s.reprefill_tokens = now.reprefill_tokens - before.reprefill_tokens
        s.decode_steps = now.decode_steps - before.decode_steps
        s.tail_proposed = now.proposed_tokens - before.proposed_tokens
        s.tail_accepted = now.accepted_tokens - before.accepted_tokens
        s.decode_rows = now.decode_rows - before.decode_rows
        s.decode_positions = now.decode_positions - before.decode_positions
        s.longest_continuation = max((len(x.tokens) - x.n for x in batch.samples), default=0)
