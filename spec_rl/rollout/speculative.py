"""Speculative rollout: reuse last epoch's responses as drafts (SPEC-RL, paper Sec. 3, Alg. 1).

:meth:`SpeculativeRollout.run` is a short sequence of phases over a batch of (prompt, slot) requests:
**lookup** each request's draft ("no draft" is explicit: generated from scratch); **score** the
drafts under the current policy (``backend.score_drafts``, one batched forward; under exact acceptance
``score_drafts_progressive`` where the backend has it: only where walks may read); **verify** them:
rejection index n per sample; **token at n**: n == R reuses the draft whole, otherwise the token at
position n is sampled from the scoring pass's own output there (no extra forward); **continue**: the
backend decodes on from [prompt, y_<n, token] with the remaining budget (``backend.continue_from``;
both built-in backends keep the scoring pass's K/V, a backend that cannot prefills that context again
and counts it in ``stats.reprefill_tokens``); **assemble** [y_<n, new] with the scoring pass's
log-probs for the prefix and the sampling log-probs for the new part; **store** the responses as next
epoch's drafts. Budget per sample: min(max_response_len, max_model_len - prompt_len) - n.

Acceptance (docs/design.md "The rule", "Exact acceptance"): ``"lenient"`` is the paper's rule; the
token at a rejection is drawn from pi_t, not from the residual max(0, pi_t - pi_old), so even l = 1 is
not exactly on-policy. ``"exact"`` accepts a draft token iff the policy's keyed sample there equals it,
walking the trie of the group's drafts (:mod:`spec_rl.acceptance.exact_walk`): every response is then a fresh
sample of pi_t. With a :class:`~spec_rl.drafts.history.HistoryIndex`, every decode step of the continuation
also verifies up to k tokens drafted from the prompt's earlier responses (docs/design.md "Speculation
past the first rejection"); sampling is keyed by (seed, uid, position), so that changes no token.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..acceptance.adaptive import DEFAULT_TARGET_DRIFT
from ..acceptance.exact_walk import WalkResult, walk_tries
from ..acceptance.lenient import check_rejection_draw, lenient_prefixes
from ..acceptance.reference import ACCEPTANCE_RULES, lenience_to_log
from ..backends.checks import (
    BackendContractError, backend_name, check_backend, check_continuations, check_model_len, check_scored,
    scores_vocab_size, token_ids,
)  # fmt: skip
from ..backends.protocol import BackendStats, Continuation, GenerationBackend
from ..backends.shared_outputs import check_shared_outputs
from ..drafts.cache import CacheKey, Draft, DraftStore
from ..drafts.history import HistoryIndex
from ..drafts.validity import draft_views
from ..sampling.distribution import SamplingSettings, check_settings
from ..sampling.philox import SEED_SALT_CONTINUATION, mix_seed
from ..util.validation import check_int
from .proposers import row_proposers
from .types import (
    RolloutRequest, RolloutResult, RolloutStats, check_draft_ids, check_store, check_unique_samples, request_prompts,
)  # fmt: skip

STRATEGIES = ("spec", "random", "random-ref", "off")

__all__ = ["STRATEGIES", "BackendContractError", "RolloutRequest", "RolloutResult", "RolloutStats", "SpeculativeRollout"]


@dataclass
class _Batch:
    """State of one :meth:`SpeculativeRollout.run` call, indexed by request."""

    prompts: list[list[int]]
    budgets: list[int]
    keys: list[CacheKey]
    step: int
    seed: int  # this step's seed (acceptance uniforms)
    store: DraftStore
    strategy: str
    stats: RolloutStats
    vocab_size: int | None = None  # the backend's, or the scoring pass's V when the backend does not say
    drafts: list[Draft | None] = field(default_factory=list)
    drafted: list[int] = field(default_factory=list)  # requests with a non-empty draft
    responses: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)
    finish: list[str | None] = field(default_factory=list)
    prefix_len: list[int] = field(default_factory=list)
    kv_len: list[int] = field(default_factory=list)  # draft tokens whose K/V the continuation keeps (before the fed token)
    group_keys: list[bytes] = field(default_factory=list)  # history key per request (its slot-0 draft key)
    sources: list[int] = field(default_factory=list)  # per request: the scored row whose draft holds its prefix

    @property
    def sample_seed(self) -> int:
        """Seed of the sampled tokens: the token at n and the whole continuation."""
        return self.seed ^ SEED_SALT_CONTINUATION

    def __post_init__(self) -> None:
        bsz = len(self.prompts)
        self.drafts = [None] * bsz
        self.responses = [[] for _ in range(bsz)]
        self.logprobs = [[] for _ in range(bsz)]
        self.finish = [None] * bsz
        self.prefix_len = [0] * bsz
        self.kv_len = [0] * bsz
        self.sources = [0] * bsz


def _check_strategy(strategy: str, acceptance: str) -> None:
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if strategy.startswith("random") and acceptance == "exact":
        raise ValueError(f"strategy={strategy!r} (the random-reuse ablation) ignores the scores; acceptance='exact' does not apply")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class SpeculativeRollout:
    """Speculative rollouts over a generation backend.

    Args:
        backend: a :class:`~spec_rl.backends.protocol.GenerationBackend` (scores the
            drafts and continues from the verified prefix).
        cache: the draft store (shared across steps/epochs).
        settings: sampling settings (drafts are reused only under equal settings).
        eos_ids: the model's complete EOS set.
        max_model_len: context limit of the model (prompt + response tokens).
        lenience: l >= 0 (paper default e^0.5 for GRPO), or "auto": chosen every step so that the
            accepted tokens drift by at most ``target_drift`` nats on average (:mod:`spec_rl.acceptance.adaptive`); or
        log_lenience: log(l).
        target_drift: the bound of ``lenience="auto"`` (mean |lp_new - lp_old| of accepted tokens, nats).
        strategy: "spec" (lenient verification), "random" / "random-ref" (random-reuse
            ablation, paper Table 2: n uniform over 0..R, or over 0..R-1 as in the reference
            implementation) or "off" (vanilla rollout: drafts are neither looked up nor scored,
            but responses are still cached).
        seed: run seed; per-step seeds are derived with :func:`spec_rl.sampling.philox.mix_seed`.
        verify_backend: passed to :func:`spec_rl.acceptance.dispatch.verify`.
        acceptance: "lenient" (the paper's rule, default) or "exact" (lossless; lenience unused).
        rejection_draw: the token at a lenient rejection index: "policy" (default, the paper: from pi_t) or
            "without-draft" (from pi_t without the rejected draft token; :mod:`spec_rl.acceptance.lenient`).
        history: per-prompt index of earlier responses; when given, continuations verify
            history-drafted tokens at every decode step (tail speculation) and every stored
            response is indexed.
        sibling_drafts: also draft from the tokens the other samples of the same prompt emit in the same
            call (and from their stored drafts), so the first epoch and new prompts speculate too
            (:mod:`spec_rl.drafts.siblings`; lossless like every proposal).

    Everything the backend returns is checked (:mod:`spec_rl.backends.checks`; a violation raises
    :class:`~spec_rl.backends.checks.BackendContractError` naming the backend), against its
    ``vocab_size`` and ``max_positions`` where it has them.

    Raises:
        TypeError: a backend, cache or settings of the wrong kind; non-integer ``max_model_len``,
            ``seed`` or EOS ids.
        ValueError: unknown strategy or acceptance, empty ``eos_ids`` or ids outside the vocabulary,
            ``max_model_len`` < 2 or past the model's ``max_position_embeddings``, bad lenience.
    """

    def __init__(
        self,
        backend: GenerationBackend,
        cache: DraftStore,
        settings: SamplingSettings,
        eos_ids: Sequence[int],
        max_model_len: int,
        lenience: float | None = math.exp(0.5),
        log_lenience: float | None = None,
        strategy: str = "spec",
        seed: int = 0,
        verify_backend: str = "auto",
        acceptance: str = "lenient",
        history: HistoryIndex | None = None,
        sibling_drafts: bool = False,
        target_drift: float = DEFAULT_TARGET_DRIFT,
        rejection_draw: str = "policy",
    ):
        check_backend(backend)
        check_settings(settings)
        if acceptance not in ACCEPTANCE_RULES:
            raise ValueError(f"acceptance must be one of {ACCEPTANCE_RULES}, got {acceptance!r}")
        _check_strategy(strategy, acceptance)
        if not eos_ids:
            raise ValueError("eos_ids must list at least one end-of-sequence id")
        vocab = getattr(backend, "vocab_size", None)
        self.eos_ids = set(token_ids("eos_ids", list(eos_ids), vocab, backend_name(backend)))
        self.max_model_len = check_model_len(max_model_len, backend)
        if log_lenience is not None:
            lenience = None
        auto = isinstance(lenience, str) and lenience == "auto"
        self.log_lenience = None if auto else lenience_to_log(lenience, log_lenience)  # None: adaptive
        check_rejection_draw(rejection_draw, strategy, acceptance, self.log_lenience)
        self.target_drift = float(target_drift)
        self.backend = backend
        self.cache = check_store("cache", cache)
        self.settings = settings
        self.strategy = strategy
        self.seed = check_int("seed", seed)
        self.verify_backend = verify_backend
        self.acceptance = acceptance
        self.rejection_draw = rejection_draw
        self.history = history
        self.sibling_drafts = bool(sibling_drafts)

    @property
    def vocab_size(self) -> int | None:
        """The backend's ``vocab_size`` (None: unknown until a scoring pass gives V)."""
        return getattr(self.backend, "vocab_size", None)

    def budget(self, prompt_len: int) -> int:
        """Response budget before reuse: min(max_tokens, max_model_len - prompt_len)."""
        return self.settings.budget(prompt_len, self.max_model_len)

    def run(
        self,
        requests: Sequence[RolloutRequest],
        step: int,
        *,
        seed: int | None = None,
        cache: DraftStore | None = None,
        strategy: str | None = None,
    ) -> RolloutResult:
        """Produce one response per request; stores them with version ``step``.

        The call never builds an autograd graph, whatever the caller's grad mode: it runs under
        ``torch.no_grad()`` (the scores hold the LM head as a Parameter, and verifying them with
        grad on would keep every chunk of logits alive for a backward that never comes). Not
        ``inference_mode``: the drafts it stores must stay ordinary tensors.

        Args:
            requests: the samples to produce (prompt ids, slot, dataset id).
            step: training step (derives this step's seed; the stored drafts' version).
            seed, cache, strategy: per-call overrides of the constructor's values.

        Raises:
            TypeError: a request that is not a :class:`RolloutRequest`, non-integer ids, step or seed.
            ValueError: an empty prompt, a prompt that leaves no room for a response under
                ``max_model_len``, an id outside the vocabulary in a prompt or a stored draft
                (naming the request), two requests for the same sample, or an unknown strategy.
            BackendContractError: the backend returned something its contract rules out.
        """
        with torch.no_grad():
            return self._run(requests, step, seed, cache, strategy)

    def _run(self, requests, step, seed, cache, strategy) -> RolloutResult:
        t0 = time.perf_counter()
        counters0 = self.backend.stats.copy()
        batch = self._plan(requests, step, seed, cache, strategy)
        self._lookup(batch)
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
        drafted = set(batch.drafted)
        return RolloutResult(
            prompt_ids=batch.prompts,
            response_ids=batch.responses,
            logprobs=batch.logprobs,
            finish_reasons=[f or "length" for f in batch.finish],
            verified_prefix_len=batch.prefix_len,
            draft_found=[i in drafted for i in range(len(batch.prompts))],
            stats=stats,
        )

    # ------------------------------------------------------------------ phases
    def _plan(self, requests, step, seed, cache, strategy) -> _Batch:
        """Validate the requests; budgets, cache keys and this step's seed."""
        strategy = self.strategy if strategy is None else strategy
        _check_strategy(strategy, self.acceptance)
        step = check_int("step", step)
        seed = self.seed if seed is None else check_int("seed", seed)
        store = self.cache if cache is None else check_store("cache", cache)
        prompts = request_prompts(requests, self.vocab_size, backend_name(self.backend))
        budgets = []
        for i, p in enumerate(prompts):
            b = self.budget(len(p))
            if b < 1:
                raise ValueError(
                    f"requests[{i}]: prompt has {len(p)} tokens, max_model_len={self.max_model_len} leaves no room "
                    "for a response; shorten the prompt or raise max_model_len"
                )
            budgets.append(b)
        keys = [CacheKey.make(p, r.slot, r.dataset_id) for p, r in zip(prompts, requests)]
        check_unique_samples(keys)
        stats = RolloutStats(num_samples=len(prompts))
        batch = _Batch(prompts, budgets, keys, step, mix_seed(seed, step), store, strategy, stats, self.vocab_size)
        if self.history is not None or self.sibling_drafts:
            batch.group_keys = [CacheKey.make(p, 0, r.dataset_id).digest for p, r in zip(prompts, requests)]
        return batch

    def _lookup(self, batch: _Batch) -> None:
        """Drafts from the store (none when the strategy is "off"); an empty draft counts as none."""
        if batch.strategy != "off":
            batch.drafts = [batch.store.lookup(k, self.settings) for k in batch.keys]
        batch.drafted = [i for i, d in enumerate(batch.drafts) if d is not None and len(d) > 0]
        batch.stats.drafts_found = len(batch.drafted)
        check_draft_ids(batch.drafts, batch.drafted, batch.vocab_size, backend_name(self.backend))

    def _score_and_verify(self, batch: _Batch) -> Any:
        """Score the drafts, verify them, and take the token at each rejection point. Returns the backend handle."""
        # Only the part of a draft that is valid under today's budget and EOS set is scored and tested.
        views = draft_views([batch.drafts[i].token_ids for i in batch.drafted], [batch.budgets[i] for i in batch.drafted], self.eos_ids)
        draft_ids = [batch.drafts[i].token_ids[: v.length].tolist() for i, v in zip(batch.drafted, views)]
        prompts = [batch.prompts[i] for i in batch.drafted]
        # An exact walk reads only the nodes it walks through: a backend that scores where walks may go does so.
        method = getattr(self.backend, "score_drafts_progressive", None) if self.acceptance == "exact" else None
        out = method(prompts, draft_ids, [batch.drafts[i].logprobs[: len(d)].tolist() for i, d in zip(batch.drafted, draft_ids)]) if method else None
        out, lazy = (out[:2], out[2]) if out is not None else (self.backend.score_drafts(prompts, draft_ids), None)
        handle = out[1] if isinstance(out, tuple) and len(out) == 2 else None
        try:
            scores, _ = check_scored(out, len(draft_ids), max(len(d) for d in draft_ids), self._source("score_drafts"))
            if lazy is None:  # (progressive scores fill same_as as the walk goes; tests/backends/test_progressive.py)
                check_shared_outputs(scores.same_as, prompts, draft_ids, self._source("score_drafts"))
            batch.vocab_size = batch.vocab_size or scores_vocab_size(scores)
            walk = self._walk(batch, prompts, draft_ids, scores, lazy)
            batch.stats.draft_tokens = sum(len(d) for d in draft_ids)
            batch.stats.accepted_tokens = sum(walk.n)
            for row, i in enumerate(batch.drafted):
                self._accept_prefix(batch, i, walk, row, views[walk.source[row]].finish_reason)
            _sync(self.backend.device)
        except BaseException:
            if handle is not None:
                self.backend.release(handle)
            raise
        return handle

    def _source(self, method: str) -> str:  # "PagedEngine.generate": names the backend in errors
        return f"{backend_name(self.backend)}.{method}"

    def _walk(self, batch: _Batch, prompts, draft_ids: list[list[int]], scores, lazy) -> WalkResult:
        """Exact: each sample follows the policy's keyed samples down its group's trie of drafts (``lazy``: the
        progressive scores it extends). Lenient: the paper's rule (or random reuse) at this step's l."""
        if self.acceptance == "exact":
            return walk_tries(prompts, draft_ids, scores, self.settings, batch.sample_seed,
                              self._uids(batch, batch.drafted), progressive=lazy)  # fmt: skip
        out = lenient_prefixes(
            draft_ids, [batch.drafts[i].logprobs for i in batch.drafted], [len(batch.prompts[i]) for i in batch.drafted],
            self._uids(batch, batch.drafted), scores, self.settings, log_lenience=self.log_lenience,
            target_drift=self.target_drift, seed=batch.seed, sample_seed=batch.sample_seed, strategy=batch.strategy,
            verify_backend=self.verify_backend, device=self.backend.device, rejection_draw=self.rejection_draw,
        )  # fmt: skip
        batch.stats.log_lenience, batch.stats.reused_drift = out.log_lenience, out.drift
        return out.walk

    def _accept_prefix(self, batch: _Batch, i: int, walk: WalkResult, row: int, end_reason: str | None) -> None:
        """Request i keeps its verified prefix (+ the token at n).

        A walk that ended on a draft's end is a full reuse when that draft is a whole response today
        (``end_reason``); a draft that is only a prefix (None) is continued from its end: its last
        token is fed again as the continuation's first token, with the K/V of the tokens before it kept.
        """
        batch.responses[i] = list(walk.tokens[row])
        batch.logprobs[i] = list(walk.logprobs[row])
        batch.prefix_len[i] = batch.kv_len[i] = walk.n[row]
        batch.sources[i] = walk.source[row]
        token = walk.next_token[row]
        if token is None:
            if end_reason is not None:
                batch.stats.full_reuse_count += 1
                batch.finish[i] = end_reason
            else:
                batch.kv_len[i] -= 1  # the continuation feeds the draft's last token itself
            return
        batch.responses[i].append(token)
        batch.logprobs[i].append(walk.next_logprob[row])
        batch.stats.tokens_generated += 1
        if token in self.eos_ids:
            batch.finish[i] = "eos"
        elif len(batch.responses[i]) >= batch.budgets[i]:
            batch.finish[i] = "length"

    def _continue(self, batch: _Batch, handle: Any) -> None:
        """Decode the unfinished requests: drafted ones from their verified prefix, the others from the prompt."""
        todo = [i for i, f in enumerate(batch.finish) if f is None]
        drafted = set(batch.drafted)
        extra = [i for i in todo if i not in drafted]
        contexts = [batch.prompts[i] + batch.responses[i] for i in extra]
        budgets = [batch.budgets[i] - len(batch.responses[i]) for i in extra]
        seed = batch.sample_seed
        if handle is None:
            if not extra:
                return
            order, asked, method = extra, budgets, "generate"
            conts = self.backend.generate(contexts, budgets, self.settings, seed, uids=self._uids(batch, order),
                                          proposers=self._proposers(batch, order))  # fmt: skip
        else:
            live = [batch.finish[i] is None for i in batch.drafted]
            rows = [batch.budgets[i] - len(batch.responses[i]) if ok else 0 for i, ok in zip(batch.drafted, live)]
            order, asked, method = list(batch.drafted) + extra, rows + budgets, "continue_from"
            try:
                conts = self.backend.continue_from(
                    handle,
                    [batch.kv_len[i] for i in batch.drafted],
                    [batch.responses[i][-1] if ok else None for i, ok in zip(batch.drafted, live)],
                    rows, self.settings, seed, extra_contexts=contexts, extra_budgets=budgets,
                    uids=self._uids(batch, batch.drafted + extra),
                    proposers=self._proposers(batch, [i if ok else None for i, ok in zip(batch.drafted, live)] + extra),
                    **self._sources(batch),
                )  # fmt: skip
            except BaseException:
                self.backend.release(handle)
                raise
        check_continuations(conts, asked, source=self._source(method), vocab_size=batch.vocab_size, eos_ids=self.eos_ids)
        for i, c in zip(order, conts):
            if batch.finish[i] is None:
                self._append(batch, i, c)
        _sync(self.backend.device)

    @staticmethod
    def _append(batch: _Batch, i: int, c: Continuation) -> None:
        batch.responses[i] = batch.responses[i] + list(c.token_ids)
        batch.logprobs[i] = batch.logprobs[i] + list(c.logprobs)
        batch.finish[i] = c.finish_reason
        batch.stats.tokens_generated += len(c.token_ids)

    @staticmethod
    def _sources(batch: _Batch) -> dict:
        """``sources=`` for continue_from, only when a row continues another row's draft (exact acceptance)."""
        src = [batch.sources[i] for i in batch.drafted]
        return {"sources": src} if any(s != row for row, s in enumerate(src)) else {}

    @staticmethod
    def _uids(batch: _Batch, requests: Sequence[int]) -> list[int]:
        return [batch.keys[i].uid for i in requests]

    def _proposers(self, batch: _Batch, requests: Sequence[int | None]) -> list | None:
        """Drafters for the requests (None entries: rows that will not decode): see :func:`row_proposers`."""
        if self.history is None and not self.sibling_drafts:
            return None
        # the group's drafts are sibling texts: listed only when siblings draft (not on every call)
        drafts = {i: batch.drafts[i].token_ids.tolist() for i in batch.drafted} if self.sibling_drafts else {}
        return row_proposers(requests, batch.group_keys, batch.prompts, batch.responses, drafts, self.history,
                             self.sibling_drafts, self.backend)  # fmt: skip

    def _store(self, batch: _Batch) -> None:
        """Every response becomes next epoch's draft of its request (and enters the prompt's history)."""
        for i, key in enumerate(batch.keys):
            batch.store.store(key, batch.responses[i], batch.logprobs[i], batch.finish[i], batch.step, self.settings)
            if self.history is not None:
                self.history.add(batch.group_keys[i], batch.responses[i])
        batch.stats.vanilla_tokens = sum(len(r) for r in batch.responses)

    def _count_backend(self, batch: _Batch, before: BackendStats) -> None:
        """Backend work of this call: re-prefilled tokens, decode steps, history-drafted tokens."""
        now = self.backend.stats
        for ours, theirs in (("reprefill_tokens", "reprefill_tokens"), ("decode_steps", "decode_steps"),
                             ("tail_proposed", "proposed_tokens"), ("tail_accepted", "accepted_tokens"),
                             ("decode_rows", "decode_rows"), ("decode_positions", "decode_positions")):  # fmt: skip
            setattr(batch.stats, ours, getattr(now, theirs) - getattr(before, theirs))
        s = batch.stats
        generated = [len(r) - p for r, p in zip(batch.responses, batch.prefix_len)]
        s.longest_continuation = max(generated, default=0)
