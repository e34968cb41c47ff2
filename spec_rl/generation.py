"""Generation backends: continue sequences from prompt + verified prefix.

A backend receives, per sequence, the context to continue (prompt ids plus
the verified prefix of the draft) and a token budget, and returns the new
tokens with their log-probabilities under the *sampling* distribution
(temperature, top-k, top-p exactly as given; no hidden defaults such as
transformers' ``generate`` top_k=50). Budget bookkeeping lives in the
rollout: budget = min(max_response_len, max_model_len - prompt_len) - n.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from .sampling import SamplingSettings, sample_tokens
from .scoring import DraftScores, PolicyScorer


@dataclass
class Continuation:
    """New tokens for one sequence.

    Attributes:
        token_ids: sampled ids (EOS included if one was sampled; nothing after it).
        logprobs: their sampling log-probs (float, same length).
        finish_reason: "eos" if the last token is an EOS id, else "length"
            (the budget ran out; a zero budget gives an empty "length" result).
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str


@dataclass
class BackendStats:
    """Counters of a generation backend since it was built (tokens and forward calls).

    Attributes:
        prefill_tokens: context tokens fed to prefill forwards (scoring excluded).
        reprefill_tokens: tokens of [prompt, verified prefix, token] that were
            prefilled again after the scoring pass (0 for a splicing backend
            whose cache was large enough).
        decode_steps: sequential decode forwards (one per step, whatever the batch size).
    """

    prefill_tokens: int = 0
    reprefill_tokens: int = 0
    decode_steps: int = 0

    def copy(self) -> "BackendStats":
        return dataclasses.replace(self)


@runtime_checkable
class GenerationBackend(Protocol):
    """What the speculative rollout needs from an inference engine (paper Alg. 1, steps 1 and 4).

    ``score_drafts`` has the contract of :meth:`spec_rl.scoring.PolicyScorer.score`
    and also returns a handle; ``continue_from`` cuts row i to prompt + n_i,
    feeds ``first_tokens[i]`` (None: just release the row) and samples up to
    ``budgets[i]`` more tokens; ``extra_contexts`` are generated from scratch in
    the same batches. It returns continuations for the handle's rows, then the
    extras. ``release`` frees a handle that will not be continued. ``stats``
    counts prefill/re-prefill tokens and decode steps.
    """

    stats: BackendStats

    @property
    def device(self) -> torch.device: ...

    def generate(
        self, contexts: Sequence[Sequence[int]], budgets: Sequence[int], settings: SamplingSettings, seed: int
    ) -> list[Continuation]:
        """Sample up to ``budgets[i]`` tokens after ``contexts[i]`` for every i."""
        ...

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
class ScoredDrafts:
    """Handle of :class:`ReprefillBackend`: the rows scored by ``score_drafts``."""

    prompts: list[list[int]]
    drafts: list[list[int]]
    used: bool = False


class ReprefillBackend:
    """``score_drafts``/``continue_from``/``release`` for a backend that only generates from contexts.

    Scoring runs :attr:`scorer` (a :class:`~spec_rl.scoring.PolicyScorer`);
    the continuation prefills [prompt, y_<n, token] again, as the SPEC-RL
    reference implementation does, and counts those tokens in
    ``stats.reprefill_tokens``. Subclasses set ``scorer`` and ``stats`` and
    implement ``generate``.
    """

    scorer: PolicyScorer
    stats: BackendStats

    def generate(self, contexts, budgets, settings, seed) -> list[Continuation]:  # pragma: no cover - abstract
        raise NotImplementedError

    def score_drafts(self, prompts, drafts) -> tuple[DraftScores, ScoredDrafts]:
        """Score the drafts (one forward per chunk) and keep the rows for :meth:`continue_from`."""
        rows = ScoredDrafts([list(map(int, p)) for p in prompts], [list(map(int, d)) for d in drafts])
        return self.scorer.score(rows.prompts, rows.drafts), rows

    def continue_from(
        self, handle: ScoredDrafts, accepted_lens, first_tokens, budgets, settings, seed, extra_contexts=(), extra_budgets=()
    ) -> list[Continuation]:
        """Generate from [prompt, y_<n, first token] per scored row (re-prefilled), then from each extra context."""
        if not isinstance(handle, ScoredDrafts) or handle.used:
            raise ValueError("handle must come from this backend's score_drafts and be continued once")
        handle.used = True
        rows = len(handle.prompts)
        results: list[Continuation | None] = [None] * (rows + len(extra_contexts))
        todo, contexts, todo_budgets = [], [], []
        for i, (n, tok, budget) in enumerate(zip(accepted_lens, first_tokens, budgets)):
            if tok is None or budget == 0:
                results[i] = Continuation([], [], "length")
                continue
            todo.append(i)
            contexts.append(handle.prompts[i] + handle.drafts[i][: int(n)] + [int(tok)])
            todo_budgets.append(int(budget))
        self.stats.reprefill_tokens += sum(len(c) for c in contexts)
        todo += [rows + k for k in range(len(extra_contexts))]
        contexts += [list(c) for c in extra_contexts]
        todo_budgets += [int(b) for b in extra_budgets]
        for i, c in zip(todo, self.generate(contexts, todo_budgets, settings, seed)):
            results[i] = c
        return results  # type: ignore[return-value]

    def release(self, handle: ScoredDrafts) -> None:
        """Nothing is held between scoring and continuation: just mark the handle used."""
        handle.used = True


def backend_arguments(eos_ids, pad_id: int, max_batch_size: int) -> tuple[list[int], int, int]:
    """Validated (sorted EOS ids, pad id, max batch size) shared by every generation backend.

    Raises:
        ValueError: no EOS id, or ``max_batch_size`` < 1.
    """
    if not eos_ids:
        raise ValueError("eos_ids must contain at least one end-of-sequence id (see spec_rl.generation.eos_token_ids)")
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    return sorted({int(x) for x in eos_ids}), int(pad_id), int(max_batch_size)


def eos_token_ids(model, tokenizer=None) -> set[int]:
    """The full EOS set: generation_config and config may each list several ids."""
    ids: set[int] = set()
    for src in (getattr(model, "generation_config", None), getattr(model, "config", None), tokenizer):
        value = getattr(src, "eos_token_id", None) if src is not None else None
        if value is None:
            continue
        if isinstance(value, int):
            ids.add(value)
        else:
            ids.update(int(v) for v in value)
    return ids


class TransformersBackend(ReprefillBackend):
    """Batched sampling with a transformers causal LM and its KV cache.

    Contexts are left-padded; positions come from the attention mask, so
    padding never shifts a sequence. Each row stops at its own budget or at
    any id in ``eos_ids``. Log-probs are taken from the same processed
    distribution the token was sampled from (:func:`spec_rl.sampling.sample_tokens`).

    Args:
        model: a transformers ``PreTrainedModel`` with a causal LM head.
        eos_ids: the complete set of end-of-sequence ids (see :func:`eos_token_ids`).
        pad_id: id used for left padding (any valid id; it is masked out).
        max_batch_size: sequences per forward batch (memory bound).
        progress: show a tqdm bar over decode steps.
        max_tokens_per_forward: chunk bound of the scoring pass (see :class:`~spec_rl.scoring.PolicyScorer`).
    """

    def __init__(
        self,
        model,
        eos_ids: set[int] | Sequence[int],
        pad_id: int,
        max_batch_size: int = 256,
        progress: bool = False,
        max_tokens_per_forward: int | None = None,
    ):
        self.model = model
        self.eos_ids, self.pad_id, self.max_batch_size = backend_arguments(eos_ids, pad_id, max_batch_size)
        self.progress = progress
        self.scorer = PolicyScorer(model, self.pad_id, max_tokens_per_forward)
        self.stats = BackendStats()

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def generate(
        self,
        contexts: Sequence[Sequence[int]],
        budgets: Sequence[int],
        settings: SamplingSettings,
        seed: int,
    ) -> list[Continuation]:
        if len(contexts) != len(budgets):
            raise ValueError(f"contexts ({len(contexts)}) and budgets ({len(budgets)}) must have the same length")
        results: list[Continuation | None] = [None] * len(contexts)
        todo = []
        for i, (ctx, budget) in enumerate(zip(contexts, budgets)):
            if budget < 0:
                raise ValueError(f"budgets[{i}] = {budget} is negative")
            if len(ctx) == 0:
                raise ValueError(f"contexts[{i}] is empty; a context needs at least one token (the prompt)")
            if budget == 0:
                results[i] = Continuation([], [], "length")
            else:
                todo.append(i)
        # Sort by length so left padding within a batch stays small.
        todo.sort(key=lambda i: len(contexts[i]))
        generator = torch.Generator(device=self.device)
        generator.manual_seed(int(seed) % (1 << 63))
        for start in range(0, len(todo), self.max_batch_size):
            chunk = todo[start : start + self.max_batch_size]
            outs = self._generate_batch([contexts[i] for i in chunk], [int(budgets[i]) for i in chunk], settings, generator)
            for i, out in zip(chunk, outs):
                results[i] = out
        return results  # type: ignore[return-value]

    @torch.no_grad()
    def _generate_batch(
        self,
        contexts: list[Sequence[int]],
        budgets: list[int],
        settings: SamplingSettings,
        generator: torch.Generator,
    ) -> list[Continuation]:
        device = self.device
        bsz = len(contexts)
        width = max(len(c) for c in contexts)
        input_ids = torch.full((bsz, width), self.pad_id, dtype=torch.long, device=device)
        attn = torch.zeros((bsz, width), dtype=torch.long, device=device)
        for row, ctx in enumerate(contexts):
            input_ids[row, width - len(ctx) :] = torch.as_tensor(list(ctx), dtype=torch.long)
            attn[row, width - len(ctx) :] = 1
        budget_t = torch.tensor(budgets, device=device)
        eos_t = torch.tensor(self.eos_ids, device=device)
        tokens = torch.full((bsz, max(budgets)), self.pad_id, dtype=torch.long, device=device)
        logps = torch.zeros((bsz, max(budgets)), dtype=torch.float32, device=device)
        done = torch.zeros(bsz, dtype=torch.bool, device=device)
        ended_eos = torch.zeros(bsz, dtype=torch.bool, device=device)
        lengths = torch.zeros(bsz, dtype=torch.long, device=device)

        # transformers >= 5.24 names the KV cache argument `cache`; earlier versions `past_key_values`.
        cache_arg = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        past = None
        step_ids = input_ids
        position_ids = (attn.cumsum(-1) - 1).clamp(min=0)
        steps = range(max(budgets))
        if self.progress:
            from tqdm.auto import tqdm

            steps = tqdm(steps, desc="decode", leave=False)
        # `rows[j]` is the original row of batch position j. Finished rows are dropped from the
        # batch (and the KV cache) once they are a quarter of it: decode cost on CPU scales with
        # the batch, and a few long responses should not keep every row alive.
        rows = torch.arange(bsz, device=device)
        self.stats.prefill_tokens += int(attn.sum())
        for t in steps:
            self.stats.decode_steps += 1
            out = self.model(
                input_ids=step_ids,
                attention_mask=attn,
                position_ids=position_ids,
                use_cache=True,
                **{cache_arg: past},
            )
            past = getattr(out, cache_arg, None)
            ids, lp = sample_tokens(out.logits[:, -1, :], settings, generator)
            active = ~done[rows]
            act_rows = rows[active]
            tokens[act_rows, t] = ids[active]
            logps[act_rows, t] = lp[active]
            lengths[act_rows] += 1
            is_eos = torch.isin(ids, eos_t) & active
            ended_eos[rows[is_eos]] = True
            done[rows] |= is_eos | (lengths[rows] >= budget_t[rows])
            if bool(done.all()):
                break
            step_ids = ids.unsqueeze(1)
            attn = torch.cat([attn, torch.ones((attn.shape[0], 1), dtype=attn.dtype, device=device)], dim=1)
            position_ids = position_ids[:, -1:] + 1
            keep = ~done[rows]
            if int(keep.sum()) * 4 <= 3 * rows.numel() and hasattr(past, "batch_select_indices"):
                idx = keep.nonzero().squeeze(1)
                past.batch_select_indices(idx)
                rows, step_ids, attn, position_ids = rows[idx], step_ids[idx], attn[idx], position_ids[idx]
        results = []
        for row in range(bsz):
            n = int(lengths[row])
            results.append(
                Continuation(
                    token_ids=tokens[row, :n].tolist(),
                    logprobs=logps[row, :n].tolist(),
                    finish_reason="eos" if bool(ended_eos[row]) else "length",
                )
            )
        return results
