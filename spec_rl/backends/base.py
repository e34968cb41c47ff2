"""The backend contract, in the order of the data flow (docs/api.md "Backends"): ``score(prompts, drafts)`` gives a
:class:`Scored` (the drafts' scores and what the backend keeps to continue them), ``continue_from(scored, jobs)``
decodes after the verified prefixes (:class:`Cut`) and any fresh contexts in one batch, ``generate(jobs)`` decodes
fresh contexts; each returns one :class:`Continuation` per job. Log-probs are those of the sampling distribution."""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..acceptance.scores import DraftScores
from ..drafts.owner import model_owner, policy_owner
from ..sampling.distribution import SamplingSettings
from ..util.model_config import text_config
from ..util.validation import check_int, check_type


@dataclass
class Continuation:
    """New tokens and their sampling log-probs; "eos" iff the last token is an EOS id, else "length"."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str


@dataclass(kw_only=True)
class Decoding:
    """A :class:`Continuation` being decoded: ``budget`` tokens left, ``last`` the newest token (its K/V not cached
    yet), and ``finish`` set at an EOS id or when the budget runs out."""

    budget: int
    last: int | None = None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish is not None

    def emit(self, tokens: list[int], logprobs: list[float], eos_ids) -> int:
        """Append ``tokens`` (at least one) up to the first EOS id; returns how many were kept."""
        kept = next((i + 1 for i, t in enumerate(tokens) if t in eos_ids), len(tokens))
        self.tokens += tokens[:kept]
        self.logprobs += logprobs[:kept]
        self.budget -= kept
        self.last = self.tokens[-1]
        if self.last in eos_ids:
            self.finish = "eos"
        elif self.budget <= 0:
            self.finish = "length"
        return kept

    def continuation(self) -> Continuation:
        return Continuation(self.tokens, self.logprobs, self.finish or "length")


@dataclass
class BackendStats:
    """Counters since the backend was built (``decode_steps``: sequential forwards, scoring excluded)."""

    prefill_tokens: int = 0
    reprefill_tokens: int = 0
    decode_steps: int = 0
    proposed_tokens: int = 0
    accepted_tokens: int = 0
    decode_rows: int = 0
    decode_positions: int = 0

    def copy(self) -> BackendStats:
        return dataclasses.replace(self)


@dataclass(frozen=True)
class Cut:
    """Where a job continues a scored draft: the first ``n`` tokens of row ``row``'s draft are kept (their K/V where
    the backend keeps it) and ``token`` is fed next. ``row`` may be any row of the same prompt (exact acceptance may
    continue a sibling's draft)."""

    row: int
    n: int
    token: int


@dataclass
class Job:
    """One sequence to decode, up to ``budget`` new tokens: after ``context`` (fresh) or after a :class:`Cut`.
    ``uid`` keys its sampled tokens; ``proposer`` (tail speculation) drafts tokens from history, knowing the response
    so far."""

    budget: int
    uid: int = 0
    context: list[int] | None = None
    cut: Cut | None = None
    proposer: Any = None


def fresh_jobs(contexts: Sequence[Sequence[int]], budgets: Sequence[int]) -> list[Job]:
    """One fresh :class:`Job` per context, keyed by its index (uid i)."""
    return [Job(budget, i, context) for i, (context, budget) in enumerate(zip(contexts, budgets, strict=True))]


@dataclass
class Scored:
    """What :meth:`Backend.score` returns: the drafts' scores [B, R, ...] (row i scores draft token i), the rows
    scored, the backend's own ``state`` for continuing them, and ``progressive`` scores (exact walks extend them)
    where the backend scores only where walks may read."""

    scores: DraftScores
    prompts: list[list[int]]
    drafts: list[list[int]]
    state: Any = None
    progressive: Any = None
    used: bool = False


class Backend:
    """What generates tokens for a speculative rollout (SPEC-RL Alg. 1). A backend implements :meth:`score`,
    :meth:`generate` and :meth:`continue_from`, counts what it did in ``stats`` and names its ``device``; a backend
    built on a transformers ``model`` reads its vocabulary and positions from it. Register one in
    :data:`spec_rl.backends.BACKENDS` to make it a ``--backend`` choice."""

    stats: BackendStats
    model: Any = None

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def vocab_size(self) -> int | None:
        """Ids the model reads and emits (the smaller embedding); None where unknown."""
        rows = []
        for getter in ("get_input_embeddings", "get_output_embeddings"):
            weight = getattr(getattr(self.model, getter, lambda: None)(), "weight", None)
            if isinstance(weight, torch.Tensor) and weight.dim() == 2:
                rows.append(int(weight.shape[0]))
        return min(rows) if rows else None

    #: The policy's tokenizer where the backend knows it (``for_policy`` and the adapters set it; a user may): the
    #: owner tag then names it, so a store of another tokenizer's drafts is refused too.
    tokenizer = None

    @property
    def owner(self) -> str | None:
        """The policy's owner tag (spec_rl.drafts.owner): the architecture from the model's config, and the
        tokenizer's digest where :attr:`tokenizer` is set; a store of another policy's drafts is refused with it.
        None where unknown."""
        config = text_config(self.model)
        if not callable(getattr(self.tokenizer, "get_vocab", None)):  # none set, or a processor without a vocabulary
            return model_owner(config) if config else None
        memo = getattr(self, "_owner_memo", None)  # the tokenizer's digest hashes its whole vocabulary: once
        if memo is None or memo[0] is not self.tokenizer:
            memo = self._owner_memo = (self.tokenizer, policy_owner(self.tokenizer, config))
        return memo[1]

    @property
    def max_positions(self) -> int | None:
        """The model's ``max_position_embeddings``; None where unknown."""
        limit = getattr(text_config(self.model), "max_position_embeddings", None)
        return int(limit) if isinstance(limit, int) and limit > 0 else None

    @classmethod
    def for_policy(cls, policy: Policy) -> Backend:
        """The backend a trainer builds for ``policy`` (knowing its tokenizer)."""
        backend = cls(policy.model, policy.eos_ids, policy.pad_id)
        backend.tokenizer = policy.tokenizer
        return backend

    def score(self, prompts: Sequence[Sequence[int]], drafts: Sequence[Sequence[int]], logprobs=None) -> Scored:
        """Score each [prompt, draft] under the current policy; ``logprobs`` (the drafts' stored ones) ask for scores
        only where exact walks may read, where the backend can."""
        raise NotImplementedError

    def generate(self, jobs: Sequence[Job], settings: SamplingSettings, seed: int) -> list[Continuation]:
        """Decode every job (fresh contexts); ``seed`` keys the samples with each job's uid."""
        raise NotImplementedError

    def continue_from(
        self, scored: Scored, jobs: Sequence[Job], settings: SamplingSettings, seed: int
    ) -> list[Continuation]:
        """Decode jobs with cuts of ``scored`` and fresh ones in one batch; ``scored`` is used up (released)."""
        raise NotImplementedError

    def release(self, scored: Scored) -> None:
        """Drop what ``scored`` keeps, when it will not be continued."""
        scored.used = True

    def sync_weights(self) -> None:
        """Called after every policy update; an engine with its own copy of the weights reloads them."""

    # -- input checks of the public methods (the rollout's calls pass them; a user's own call is refused clearly)
    def checked_rows(self, prompts, drafts) -> tuple[list[list[int]], list[list[int]]]:
        """Scoring rows as id lists; ValueError for unequal counts, an empty prompt, a bad id or a row too long."""
        if len(prompts) != len(drafts):
            raise ValueError(f"prompts ({len(prompts)}) and drafts ({len(drafts)}) must have the same length")
        owner, vocab = type(self).__name__, self.vocab_size
        prompts = [token_ids(f"prompts[{i}]", p, vocab, owner) for i, p in enumerate(prompts)]
        drafts = [token_ids(f"drafts[{i}]", d, vocab, owner) for i, d in enumerate(drafts)]
        for i, (p, d) in enumerate(zip(prompts, drafts)):
            if not p:
                raise ValueError(f"prompts[{i}] is empty; a prompt needs at least one token")
            self._check_fits(f"prompts[{i}] + drafts[{i}]", len(p) + len(d), 0)
        return prompts, drafts

    def checked_jobs(self, jobs: Sequence[Job], scored: Scored | None = None) -> list[Job]:
        """``jobs`` with their contexts as id lists; TypeError or ValueError naming ``jobs[i]``: not a Job, a negative
        budget, a context with bad ids or past the model's positions, a cut without ``scored``, of a row it does not
        hold, past its draft, or with a bad token."""
        owner, vocab, out = type(self).__name__, self.vocab_size, []
        if scored is not None and (not isinstance(scored, Scored) or scored.used):
            got = "one already continued or released" if isinstance(scored, Scored) else type(scored).__name__
            raise ValueError(f"scored must come from this backend's score and be continued once, got {got}")
        for i, job in enumerate(jobs):
            name = f"jobs[{i}]"
            check_type(name, job, Job)
            budget = check_int(f"{name}.budget", job.budget, low=0)
            if (job.context is None) == (job.cut is None):
                raise ValueError(f"{name} needs exactly one of context (fresh) and cut (after a scored draft)")
            if job.context is not None:
                ids = token_ids(f"{name}.context", job.context, vocab, owner)
                if not ids:
                    raise ValueError(f"{name}.context is empty; a context needs at least one token (the prompt)")
                self._check_fits(f"{name}.context", len(ids), budget)
                job = dataclasses.replace(job, context=ids)
            else:
                cut = job.cut
                if scored is None:
                    raise ValueError(f"{name} continues a cut; generate() takes fresh contexts only")
                drafts = scored.drafts
                row = check_int(f"{name}.cut.row", cut.row, low=0, high=len(drafts) - 1, hint=" (a row of scored)")
                n = check_int(f"{name}.cut.n", cut.n, low=0, high=len(drafts[row]), hint=f" (draft {row}'s length)")
                token_id(f"{name}.cut.token", cut.token, vocab, owner)
                self._check_fits(name, len(scored.prompts[row]) + n + 1, budget)
            out.append(job)
        return out

    def _check_fits(self, name: str, length: int, budget: int) -> None:
        limit = self.max_positions
        if limit is not None and length + budget > limit:
            parts = f"{length} tokens + a budget of {budget}" if budget else f"{length} tokens"
            raise ValueError(
                f"{name} needs {length + budget} positions ({parts}), past the model's max_position_embeddings="
                f"{limit} ({type(self).__name__}); shorten it or lower the budget (for a model that takes a longer "
                "context, e.g. by RoPE scaling, raise config.max_position_embeddings to it)"
            )


@dataclass
class Policy:
    """What a trainer hands :meth:`Backend.for_policy`: the model and its tokenizer, EOS ids and pad id, the context
    limit, and a folder the backend may write to."""

    model: Any
    tokenizer: Any
    eos_ids: list[int]
    pad_id: int
    max_model_len: int
    workdir: Any


def token_ids(name: str, ids, vocab_size: int | None = None, owner: str = "the model") -> list[int]:
    """``ids`` (a sequence of ints, numpy array or 1-D integer tensor) as ints in [0, vocab_size) (None: >= 0).
    TypeError for anything but integers (never rounded), ValueError naming ``name[j]``."""
    tensor = isinstance(ids, torch.Tensor)
    if (tensor and (ids.dim() != 1 or ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool)) or (
        not tensor and (isinstance(ids, (str, bytes)) or not (isinstance(ids, Sequence) or hasattr(ids, "tolist")))
    ):
        got = f"{ids.dtype} {list(ids.shape)}" if tensor else type(ids).__name__
        raise TypeError(f"{name} must be a 1-D integer tensor or a sequence of token ids, got {got}")
    values = ids.tolist() if hasattr(ids, "tolist") else list(ids)
    if set(map(type, values)) - {int}:
        values = [token_id(f"{name}[{j}]", t) for j, t in enumerate(values)]
    if values and (min(values) < 0 or (vocab_size is not None and max(values) >= vocab_size)):
        j = next(j for j, t in enumerate(values) if t < 0 or (vocab_size is not None and t >= vocab_size))
        token_id(f"{name}[{j}]", values[j], vocab_size, owner)
    return values


def token_id(name: str, value, vocab_size: int | None = None, owner: str = "the model") -> int:
    """``value`` as an int token id in [0, vocab_size); TypeError for a non-integer, ValueError outside the range."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"{name} must be an integer token id, got {value!r}")
    value = operator.index(value)
    if value < 0 or (vocab_size is not None and value >= vocab_size):
        where = "the ids >= 0" if vocab_size is None else f"[0, {vocab_size}) (the vocabulary of {owner})"
        raise ValueError(f"{name} = {value} is outside {where}; tokenize with the policy's own tokenizer")
    return value


def eos_token_ids(model, tokenizer=None) -> set[int]:
    """The full EOS set: generation_config, config and tokenizer may each list several ids."""
    ids: set[int] = set()
    for src in (getattr(model, "generation_config", None), getattr(model, "config", None), tokenizer):
        value = getattr(src, "eos_token_id", None)
        if value is not None:
            ids.update([value] if isinstance(value, int) else (int(v) for v in value))
    return ids


def policy_tokens(model, tokenizer) -> tuple[set[int], int]:
    """The model's full EOS set (:func:`eos_token_ids`) and its pad id: the tokenizer's, else the tokenizer's EOS id,
    else the smallest of the set. ValueError naming what to set when there is no EOS id."""
    eos = eos_token_ids(model, tokenizer)
    if not eos:
        raise ValueError("no EOS id found in the model's generation_config/config or the tokenizer; set eos_token_id")
    pad = getattr(tokenizer, "pad_token_id", None)
    if pad is None:
        pad = getattr(tokenizer, "eos_token_id", None)
        pad = pad if isinstance(pad, int) else min(eos)
    return eos, int(pad)


def eos_and_pad(eos_ids, pad_id: int) -> tuple[list[int], int]:
    """Sorted EOS ids and the pad id of a backend's constructor; ValueError without EOS ids."""
    if not eos_ids:
        raise ValueError("eos_ids must contain at least one end-of-sequence id (spec_rl.backends.eos_token_ids)")
    return sorted({int(x) for x in eos_ids}), int(pad_id)
