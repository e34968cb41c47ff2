"""Speculative rollout: reuse last epoch's responses as drafts (SPEC-RL Alg. 1).

For a batch of (prompt, sample slot) requests:

1. look up each request's draft in the :class:`~spec_rl.cache.RolloutCache`
   ("no draft" is explicit: such requests are generated from scratch);
2. score all drafts under the current policy in one batched forward
   (:class:`~spec_rl.scoring.PolicyScorer`);
3. :func:`~spec_rl.verify.verify` them: rejection index n per sample;
4. n == R: the draft is reused whole, nothing is generated. Otherwise the
   token at position n is sampled from the scoring pass's own output at that
   position (no extra forward; DESIGN.md rule step 4) and the backend
   continues from [prompt, y_<n, token] with the remaining budget;
5. assemble [y_<n, new]: log-probs are the scoring pass's for the prefix and
   the sampling log-probs for the new part; store it for the next epoch.

Budget per sample: min(max_response_len, max_model_len - prompt_len) - n.

A backend that also implements :class:`SplicingBackend` (the paged engine,
:class:`spec_rl.engine.PagedEngine`) scores the drafts itself, keeps their K/V
in its cache and continues from the verified prefix: steps 2 and 4 then cost
no second prefill of [prompt, y_<n] (issue 4). Other backends get
[prompt, y_<n, token] as a fresh context (the reference implementation's
re-prefill); ``RolloutStats.reprefill_tokens`` counts those tokens.

Deviation from exact speculative sampling (documented in the paper and
DESIGN.md): at the rejection point the token is drawn from pi_t, not from the
residual max(0, pi_t - pi_old); even l = 1 is therefore not exactly on-policy.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from .cache import CacheKey, Draft, RolloutCache
from .generation import Continuation, GenerationBackend
from .philox import mix_seed
from .reference import lenience_to_log
from .sampling import SamplingSettings, sample_tokens
from .scoring import DraftScores, PolicyScorer
from .verify import verify

STRATEGIES = ("spec", "random", "off")


@runtime_checkable
class SplicingBackend(Protocol):
    """A generation backend that scores drafts into its own KV cache and continues from the verified prefix.

    ``score_drafts`` has the contract of :meth:`spec_rl.scoring.PolicyScorer.score`
    and also returns a handle; ``continue_from`` cuts row i to prompt + n_i,
    feeds ``first_tokens[i]`` (None: just release the row) and samples up to
    ``budgets[i]`` more tokens; ``extra_contexts`` are generated from scratch in
    the same batches. It returns continuations for the handle's rows, then the
    extras. ``release`` frees a handle that will not be continued.
    """

    def score_drafts(self, prompts: Sequence[Sequence[int]], drafts: Sequence[Sequence[int]]) -> tuple[DraftScores, Any]: ...

    def continue_from(
        self,
        handle: Any,
        accepted_lens: Sequence[int],
        first_tokens: Sequence[int | None],
        budgets: Sequence[int],
        settings: SamplingSettings,
        seed: int,
        extra_contexts: Sequence[Sequence[int]] = (),
        extra_budgets: Sequence[int] = (),
    ) -> list[Continuation]: ...

    def release(self, handle: Any) -> None: ...


@dataclass
class RolloutRequest:
    """One sample to produce: a prompt (token ids), its slot in the group, and an optional dataset id."""

    prompt_ids: Sequence[int]
    slot: int = 0
    dataset_id: str | None = None


@dataclass
class RolloutStats:
    """Per-step rollout statistics (tokens, samples, seconds).

    ``reprefill_tokens``: tokens of [prompt, verified prefix, token] contexts that
    the backend had to prefill again after the scoring pass (0 with a splicing backend).
    """

    num_samples: int = 0
    drafts_found: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    full_reuse_count: int = 0
    tokens_generated: int = 0
    vanilla_tokens: int = 0
    scoring_seconds: float = 0.0
    generation_seconds: float = 0.0
    assembly_seconds: float = 0.0
    reprefill_tokens: int = 0

    @property
    def full_reuse_ratio(self) -> float:
        """Fraction of all samples whose response was reused whole (no generation)."""
        return self.full_reuse_count / self.num_samples if self.num_samples else 0.0

    @property
    def mean_verified_prefix(self) -> float:
        """Mean verified-prefix length n (tokens) over samples that had a draft."""
        return self.accepted_tokens / self.drafts_found if self.drafts_found else 0.0

    @property
    def rollout_seconds(self) -> float:
        return self.scoring_seconds + self.generation_seconds + self.assembly_seconds

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(
            full_reuse_ratio=self.full_reuse_ratio,
            mean_verified_prefix=self.mean_verified_prefix,
            rollout_seconds=self.rollout_seconds,
            reused_tokens=self.accepted_tokens,
        )
        return d


@dataclass
class RolloutResult:
    """Responses for B requests, in request order.

    Attributes:
        prompt_ids: B prompt id lists.
        response_ids: B response id lists (EOS included when sampled).
        logprobs: B lists of float log-probs of the response tokens under
            the policy that ran this rollout (the "old" log-probs for PPO).
        finish_reasons: "eos" or "length" (truncated at the budget).
        verified_prefix_len: n per sample (0 when there was no draft).
        draft_found: whether a draft existed for the sample.
        stats: :class:`RolloutStats`.
    """

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    logprobs: list[list[float]]
    finish_reasons: list[str]
    verified_prefix_len: list[int]
    draft_found: list[bool]
    stats: RolloutStats = field(default_factory=RolloutStats)

    @property
    def truncated(self) -> list[bool]:
        return [r == "length" for r in self.finish_reasons]

    def padded(self, pad_id: int, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        """Right-padded tensors: response_ids [B, R] int64, response_mask [B, R] bool, logprobs [B, R] float32."""
        bsz = len(self.response_ids)
        width = max([len(r) for r in self.response_ids] + [1])
        ids = torch.full((bsz, width), pad_id, dtype=torch.long)
        mask = torch.zeros((bsz, width), dtype=torch.bool)
        lps = torch.zeros((bsz, width), dtype=torch.float32)
        for b, (r, lp) in enumerate(zip(self.response_ids, self.logprobs)):
            ids[b, : len(r)] = torch.tensor(r, dtype=torch.long)
            mask[b, : len(r)] = True
            lps[b, : len(r)] = torch.tensor(lp, dtype=torch.float32)
        return {"response_ids": ids.to(device), "response_mask": mask.to(device), "logprobs": lps.to(device)}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class SpeculativeRollout:
    """Speculative rollouts over a generation backend.

    Args:
        scorer: scoring forward of the current policy.
        backend: any :class:`~spec_rl.generation.GenerationBackend`.
        cache: the rollout cache (shared across steps/epochs).
        settings: sampling settings (drafts are reused only under equal settings).
        eos_ids: the model's complete EOS set.
        max_model_len: context limit of the model (prompt + response tokens).
        lenience: l >= 0 (paper default e^0.5 for GRPO); or
        log_lenience: log(l).
        strategy: "spec" (lenient verification), "random" (random-reuse
            ablation, paper Table 2) or "off" (vanilla rollout: drafts are
            neither looked up nor scored, but responses are still cached).
        seed: run seed; per-step seeds are derived with :func:`spec_rl.philox.mix_seed`.
        verify_backend: passed to :func:`spec_rl.verify.verify`.
    """

    def __init__(
        self,
        scorer: PolicyScorer,
        backend: GenerationBackend,
        cache: RolloutCache,
        settings: SamplingSettings,
        eos_ids: Sequence[int],
        max_model_len: int,
        lenience: float | None = math.exp(0.5),
        log_lenience: float | None = None,
        strategy: str = "spec",
        seed: int = 0,
        verify_backend: str = "auto",
    ):
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        if not eos_ids:
            raise ValueError("eos_ids must list at least one end-of-sequence id")
        if max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
        if log_lenience is not None:
            lenience = None
        self.log_lenience = lenience_to_log(lenience, log_lenience)
        self.scorer = scorer
        self.backend = backend
        self.cache = cache
        self.settings = settings
        self.eos_ids = {int(x) for x in eos_ids}
        self.max_model_len = int(max_model_len)
        self.strategy = strategy
        self.seed = int(seed)
        self.verify_backend = verify_backend

    def budget(self, prompt_len: int) -> int:
        """Response budget before reuse: min(max_tokens, max_model_len - prompt_len)."""
        return min(self.settings.max_tokens, self.max_model_len - prompt_len)

    def run(self, requests: Sequence[RolloutRequest], step: int) -> RolloutResult:
        """Produce one response per request; updates the cache with version ``step``.

        Raises:
            ValueError: an empty prompt, or a prompt that leaves no room for a
                response under ``max_model_len``.
        """
        t0 = time.perf_counter()
        device = self.scorer.device
        step_seed = mix_seed(self.seed, step)
        bsz = len(requests)
        stats = RolloutStats(num_samples=bsz)
        prompts = [list(map(int, r.prompt_ids)) for r in requests]
        budgets = []
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"requests[{i}] has an empty prompt")
            b = self.budget(len(p))
            if b < 1:
                raise ValueError(
                    f"requests[{i}]: prompt has {len(p)} tokens, max_model_len={self.max_model_len} leaves no room "
                    "for a response; shorten the prompt or raise max_model_len"
                )
            budgets.append(b)
        keys = [CacheKey.make(p, r.slot, r.dataset_id) for p, r in zip(prompts, requests)]

        drafts: list[Draft | None] = [None] * bsz
        if self.strategy != "off":
            drafts = [self.cache.lookup(k, self.settings) for k in keys]
        # An empty draft carries nothing to reuse: treat it as no draft.
        drafted = [i for i, d in enumerate(drafts) if d is not None and len(d) > 0]
        stats.drafts_found = len(drafted)

        responses: list[list[int]] = [[] for _ in range(bsz)]
        logprobs: list[list[float]] = [[] for _ in range(bsz)]
        finish: list[str | None] = [None] * bsz
        prefix_len = [0] * bsz
        t1 = time.perf_counter()
        stats.assembly_seconds += t1 - t0

        splicing = isinstance(self.backend, SplicingBackend)
        handle = None
        reprefill0 = int(getattr(getattr(self.backend, "stats", None), "reprefill_tokens", 0) or 0)
        if drafted:
            # Drafts longer than today's budget (cannot happen under equal settings, but a
            # max_model_len change could cause it) are cut to the budget.
            draft_ids = [drafts[i].token_ids[: budgets[i]].tolist() for i in drafted]
            draft_lps = [drafts[i].logprobs[: budgets[i]] for i in drafted]
            if splicing:
                scores, handle = self.backend.score_drafts([prompts[i] for i in drafted], draft_ids)
            else:
                scores = self.scorer.score([prompts[i] for i in drafted], draft_ids)
            try:
                max_r = max([len(d) for d in draft_ids] + [1])
                ids_t = torch.zeros((len(drafted), max_r), dtype=torch.long, device=device)
                old_t = torch.zeros((len(drafted), max_r), dtype=torch.float32, device=device)
                for row, (d, lp) in enumerate(zip(draft_ids, draft_lps)):
                    ids_t[row, : len(d)] = torch.tensor(d, dtype=torch.long)
                    old_t[row, : len(d)] = lp.to(device)
                lengths = torch.tensor([len(d) for d in draft_ids], dtype=torch.long, device=device)
                uids = torch.tensor([keys[i].uid for i in drafted], dtype=torch.long, device=device)
                result = verify(
                    ids_t,
                    old_t,
                    new_logprobs=None,
                    logits=scores.logits,
                    hidden_states=scores.hidden_states,
                    lm_head_weight=scores.lm_head_weight,
                    lm_head_bias=scores.lm_head_bias,
                    lengths=lengths,
                    temperature=self.settings.temperature,
                    top_k=self.settings.top_k,
                    top_p=self.settings.top_p,
                    log_lenience=self.log_lenience,
                    seed=step_seed,
                    uids=uids,
                    strategy=self.strategy,
                    backend=self.verify_backend,
                )
                n = result.accepted_len.tolist()
                lp_new = result.new_logprobs.cpu()
                stats.draft_tokens = int(lengths.sum())
                stats.accepted_tokens = int(sum(n))

                # Sample the token at each rejection point from the scoring output there.
                rejected_rows = [row for row, i in enumerate(drafted) if n[row] < len(draft_ids[row])]
                if rejected_rows:
                    rows_t = torch.tensor(rejected_rows, device=device)
                    cols_t = torch.tensor([n[r] for r in rejected_rows], device=device)
                    gen = torch.Generator(device=device)
                    gen.manual_seed(step_seed % (1 << 63))
                    tok, tok_lp = sample_tokens(scores.logits_at(rows_t, cols_t), self.settings, gen)
                    tok, tok_lp = tok.tolist(), tok_lp.tolist()
                sampled = {r: (tok[k], tok_lp[k]) for k, r in enumerate(rejected_rows)}
                for row, i in enumerate(drafted):
                    k = n[row]
                    responses[i] = draft_ids[row][:k]
                    logprobs[i] = lp_new[row, :k].tolist()
                    prefix_len[i] = k
                    if k == len(draft_ids[row]):
                        stats.full_reuse_count += 1
                        finish[i] = drafts[i].finish_reason if len(draft_ids[row]) == len(drafts[i]) else "length"
                        continue
                    t, t_lp = sampled[row]
                    responses[i].append(t)
                    logprobs[i].append(t_lp)
                    stats.tokens_generated += 1
                    if t in self.eos_ids:
                        finish[i] = "eos"
                    elif len(responses[i]) >= budgets[i]:
                        finish[i] = "length"
                _sync(device)
            except BaseException:
                if handle is not None:
                    self.backend.release(handle)
                raise
        t2 = time.perf_counter()
        stats.scoring_seconds += t2 - t1

        todo = [i for i in range(bsz) if finish[i] is None]
        if handle is not None:
            # Drafted rows continue inside the backend's cache; undrafted ones ride along.
            in_handle = {i: row for row, i in enumerate(drafted)}
            extra = [i for i in todo if i not in in_handle]
            try:
                conts = self.backend.continue_from(
                    handle,
                    [prefix_len[i] for i in drafted],
                    [responses[i][-1] if finish[i] is None else None for i in drafted],
                    [budgets[i] - len(responses[i]) if finish[i] is None else 0 for i in drafted],
                    self.settings,
                    seed=step_seed ^ 0x5EED,
                    extra_contexts=[prompts[i] + responses[i] for i in extra],
                    extra_budgets=[budgets[i] - len(responses[i]) for i in extra],
                )
            except BaseException:
                self.backend.release(handle)
                raise
            for i, c in zip(list(drafted) + extra, conts):
                if finish[i] is not None:
                    continue
                responses[i] = responses[i] + list(c.token_ids)
                logprobs[i] = logprobs[i] + list(c.logprobs)
                finish[i] = c.finish_reason
                stats.tokens_generated += len(c.token_ids)
            stats.reprefill_tokens += int(getattr(getattr(self.backend, "stats", None), "reprefill_tokens", 0) or 0) - reprefill0
            _sync(device)
        elif todo:
            was_drafted = set(drafted)
            stats.reprefill_tokens = sum(len(prompts[i]) + len(responses[i]) for i in todo if i in was_drafted)
            conts = self.backend.generate(
                [prompts[i] + responses[i] for i in todo],
                [budgets[i] - len(responses[i]) for i in todo],
                self.settings,
                seed=step_seed ^ 0x5EED,
            )
            for i, c in zip(todo, conts):
                responses[i] = responses[i] + list(c.token_ids)
                logprobs[i] = logprobs[i] + list(c.logprobs)
                finish[i] = c.finish_reason
                stats.tokens_generated += len(c.token_ids)
            _sync(device)
        t3 = time.perf_counter()
        stats.generation_seconds += t3 - t2

        for i in range(bsz):
            self.cache.store(keys[i], responses[i], logprobs[i], finish[i], step, self.settings)
        stats.vanilla_tokens = sum(len(r) for r in responses)
        stats.assembly_seconds += time.perf_counter() - t3
        return RolloutResult(
            prompt_ids=prompts,
            response_ids=responses,
            logprobs=logprobs,
            finish_reasons=[f or "length" for f in finish],
            verified_prefix_len=prefix_len,
            draft_found=[i in set(drafted) for i in range(bsz)],
            stats=stats,
        )
