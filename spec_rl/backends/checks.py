"""Checks on what flows between the rollout and a backend: ids and lengths before any forward (the error names the
request), and every continuation before it becomes a response and next epoch's draft."""

from __future__ import annotations

import operator
from bisect import bisect_right
from collections.abc import Sequence

import torch

from ..acceptance.scores import DraftScores
from ..util.validation import LOGPROB_SLACK, check_int
from .protocol import Continuation, GenerationBackend


class BackendContractError(RuntimeError):
    """A generation backend returned something its contract rules out (the message names the backend)."""


def _as_list(name: str, ids) -> list:
    if isinstance(ids, torch.Tensor):
        if ids.dim() != 1 or ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            raise TypeError(
                f"{name} must be a 1-D integer tensor or a sequence of token ids, got {ids.dtype} {list(ids.shape)}"
            )
        return ids.tolist()
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence) and not hasattr(ids, "tolist"):
        raise TypeError(f"{name} must be a sequence of token ids, got {type(ids).__name__}")
    values = ids.tolist() if hasattr(ids, "tolist") else list(ids)  # numpy arrays too
    if set(map(type, values)) - {int}:
        for j, t in enumerate(values):
            if isinstance(t, bool) or not hasattr(t, "__index__"):
                raise TypeError(f"{name}[{j}] must be an integer token id, got {t!r}")
        values = [operator.index(t) for t in values]
    return values


def token_ids(name: str, ids, vocab_size: int | None = None, owner: str = "the model") -> list[int]:
    """``ids`` as ints in [0, vocab_size) (None: >= 0). TypeError for non-integers, ValueError naming ``name[j]``."""
    values = _as_list(name, ids)
    if values and (min(values) < 0 or (vocab_size is not None and max(values) >= vocab_size)):
        j = next(j for j, t in enumerate(values) if t < 0 or (vocab_size is not None and t >= vocab_size))
        raise _outside(f"{name}[{j}]", values[j], vocab_size, owner)
    return values


def token_id(name: str, value, vocab_size: int | None = None, owner: str = "the model") -> int:
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"{name} must be an integer token id, got {value!r}")
    value = operator.index(value)
    if value < 0 or (vocab_size is not None and value >= vocab_size):
        raise _outside(name, value, vocab_size, owner)
    return value


def _outside(name: str, value: int, vocab_size: int | None, owner: str) -> ValueError:
    if vocab_size is None:
        return ValueError(f"{name} = {value} is negative; token ids are >= 0")
    return ValueError(
        f"{name} = {value} is outside [0, {vocab_size}) (the vocabulary of {owner}); "
        "tokenize with the policy's own tokenizer"
    )


def model_vocab_size(model) -> int | None:
    """Ids the model reads and emits: the smaller of its input and output embedding rows."""
    rows = []
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        module = getattr(model, getter, lambda: None)()
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.dim() == 2:
            rows.append(int(weight.shape[0]))
    if rows:
        return min(rows)
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    return int(vocab) if vocab else None


def model_max_positions(model) -> int | None:
    """The (text) config's ``max_position_embeddings``, or None."""
    cfg = getattr(model, "config", None)
    if cfg is not None and hasattr(cfg, "get_text_config"):
        cfg = cfg.get_text_config()
    limit = getattr(cfg, "max_position_embeddings", None)
    return int(limit) if isinstance(limit, int) and limit > 0 else None


def check_fits(name: str, length: int, budget: int, limit: int | None, owner: str) -> None:
    """ValueError when ``length`` tokens + ``budget`` new ones pass ``limit`` positions."""
    if limit is not None and length + budget > limit:
        parts = f"{length} tokens + a budget of {budget}" if budget else f"{length} tokens"
        raise ValueError(
            f"{name} needs {length + budget} positions ({parts}), past the model's max_position_embeddings={limit} "
            f"({owner}); shorten it or lower the budget (for a model that takes a longer context, e.g. by RoPE "
            "scaling, raise config.max_position_embeddings to it)"
        )


def checked_contexts(
    contexts: Sequence,
    budgets: Sequence,
    vocab_size: int | None,
    limit: int | None,
    owner: str,
    names: tuple[str, str] = ("contexts", "budgets"),
) -> list[list[int]]:
    """``contexts`` as id lists, each fitting ``limit`` with its budget; TypeError or ValueError naming the row."""
    cname, bname = names
    out = []
    for i, (ctx, budget) in enumerate(zip(contexts, budgets)):
        ids = token_ids(f"{cname}[{i}]", ctx, vocab_size, owner)
        check_fits(f"{cname}[{i}]", len(ids), check_int(f"{bname}[{i}]", budget, low=0), limit, owner)
        out.append(ids)
    return out


def checked_rows(prompts: Sequence, drafts: Sequence, vocab_size: int | None, limit: int | None, owner: str):
    """Scoring rows as id lists; ValueError for unequal counts, an empty prompt, a bad id or a row past ``limit``."""
    if len(prompts) != len(drafts):
        raise ValueError(f"prompts ({len(prompts)}) and drafts ({len(drafts)}) must have the same length")
    prompts = [token_ids(f"prompts[{i}]", p, vocab_size, owner) for i, p in enumerate(prompts)]
    drafts = [token_ids(f"drafts[{i}]", d, vocab_size, owner) for i, d in enumerate(drafts)]
    for i, (p, d) in enumerate(zip(prompts, drafts)):
        if not p:
            raise ValueError(f"prompts[{i}] is empty; a prompt needs at least one token")
        check_fits(f"prompts[{i}] + drafts[{i}]", len(p) + len(d), 0, limit, owner)
    return prompts, drafts


def check_same_length(expected: int, what: str, **named: Sequence) -> None:
    """ValueError naming the first of ``named`` whose length is not ``expected`` (that of ``what``)."""
    for name, values in named.items():
        if len(values) != expected:
            raise ValueError(f"{name} ({len(values)}) and {what} ({expected}) must have the same length")


def check_continue_rows(prompts, drafts, accepted_lens, budgets, sources) -> list[int]:
    """Checked ``sources``; ValueError for a source of another prompt, n past its draft or a negative budget."""
    rows = len(drafts)
    checked = []
    for i in range(rows):
        s, n, budget = (
            sources[i],
            check_int(f"accepted_lens[{i}]", accepted_lens[i]),
            check_int(f"budgets[{i}]", budgets[i]),
        )
        if isinstance(s, bool) or int(s) != s or not 0 <= s < rows:
            raise ValueError(f"sources[{i}] = {s!r} is not a row index in [0, {rows})")
        s = int(s)
        if prompts[s] != prompts[i]:
            raise ValueError(f"sources[{i}] = {s} names a row with another prompt; rows continue drafts of their group")
        if not 0 <= n <= len(drafts[s]):
            raise ValueError(f"accepted_lens[{i}] = {n} is outside [0, {len(drafts[s])}] (the length of draft {s})")
        if budget < 0:
            raise ValueError(f"budgets[{i}] = {budget} is negative")
        checked.append(s)
    return checked


class ModelLimits:
    """Mixin of the backends that run a transformers ``model``: its limits and the input checks against them."""

    model: object

    @property
    def vocab_size(self) -> int | None:
        return model_vocab_size(self.model)

    @property
    def max_positions(self) -> int | None:
        return model_max_positions(self.model)

    def checked_contexts(self, contexts, budgets, names: tuple[str, str] = ("contexts", "budgets")) -> list[list[int]]:
        return checked_contexts(contexts, budgets, self.vocab_size, self.max_positions, type(self).__name__, names)

    def checked_rows(self, prompts, drafts) -> tuple[list[list[int]], list[list[int]]]:
        return checked_rows(prompts, drafts, self.vocab_size, self.max_positions, type(self).__name__)

    def check_continue(self, handle, accepted_lens, first_tokens, budgets, sources) -> list[int]:
        """Check every per-row argument of ``continue_from``, first tokens included; returns the sources."""
        rows = len(handle.drafts)
        sources = range(rows) if sources is None else sources
        named = dict(accepted_lens=accepted_lens, first_tokens=first_tokens, budgets=budgets, sources=sources)
        check_same_length(rows, "the handle's rows", **named)
        checked = check_continue_rows(handle.prompts, handle.drafts, accepted_lens, budgets, sources)
        for i, token in enumerate(first_tokens):
            if token is not None:
                self.check_first_token(i, token, len(handle.prompts[i]) + int(accepted_lens[i]) + 1, int(budgets[i]))
        return checked

    def check_first_token(self, row: int, token, length: int, budget: int) -> None:
        token_id(f"first_tokens[{row}]", token, self.vocab_size, type(self).__name__)
        check_fits(f"row {row}", length, budget, self.max_positions, type(self).__name__)


def check_model_len(max_model_len, backend) -> int:
    """``max_model_len`` as an int >= 2 within the backend's ``max_positions``; TypeError or ValueError."""
    max_model_len = check_int("max_model_len", max_model_len, low=2)
    limit = getattr(backend, "max_positions", None)
    if limit is not None and max_model_len > limit:
        raise ValueError(
            f"max_model_len={max_model_len} exceeds the model's max_position_embeddings={limit} "
            f"({backend_name(backend)}); pass max_model_len <= {limit}"
        )
    return max_model_len


def backend_name(backend) -> str:
    return type(backend).__name__


def check_backend(backend) -> None:
    """TypeError unless ``backend`` is a :class:`~spec_rl.backends.protocol.GenerationBackend`."""
    if not isinstance(backend, GenerationBackend):
        raise TypeError(
            "backend must be a GenerationBackend (TransformersBackend, PagedEngine, or your own class with device, "
            "stats, generate, score_drafts, continue_from and release: subclass GenerationBackend for the optional "
            f"members' defaults), got {backend_name(backend)}"
        )


def scores_vocab_size(scores: DraftScores) -> int | None:
    """V of a scoring pass's logits or LM head; None for precomputed log-probs."""
    if scores.logits is not None:
        return int(scores.logits.shape[-1])
    return int(scores.lm_head_weight.shape[0]) if scores.lm_head_weight is not None else None


def check_scored(out, rows: int, width: int, source: str) -> tuple[DraftScores, object]:
    """``(scores, handle)`` with one [rows, width, ...] score source, else BackendContractError."""
    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], DraftScores)):
        raise BackendContractError(f"{source} must return (DraftScores, handle), got {type(out).__name__}")
    scores = out[0]
    value = getattr(scores, scores.source)
    if not isinstance(value, torch.Tensor) or tuple(value.shape[:2]) != (rows, width):
        shape = list(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise BackendContractError(
            f"{source} returned {scores.source} of shape {shape}; expected [{rows}, {width}, ...]"
        )
    return out


def _fail(source: str, row: int, what: str) -> BackendContractError:
    return BackendContractError(f"{source} returned an invalid continuation for row {row}: {what}")


def _row_of(offsets: list[int], j: int) -> int:
    return bisect_right(offsets, j) - 1


def _flat_ids(source: str, conts: Sequence[Continuation], offsets: list[int], vocab_size: int | None) -> torch.Tensor:
    values = [t for c in conts for t in c.token_ids]
    if set(map(type, values)) - {int}:  # bools and floats are refused, not read as ids
        for j, t in enumerate(values):
            if isinstance(t, bool) or not hasattr(t, "__index__"):
                raise _fail(source, _row_of(offsets, j), f"token ids must be integers, got {t!r}")
        values = [operator.index(t) for t in values]
    if values and (min(values) < 0 or (vocab_size is not None and max(values) >= vocab_size)):
        j = next(j for j, t in enumerate(values) if t < 0 or (vocab_size is not None and t >= vocab_size))
        where = f"[0, {vocab_size}) (the model's vocabulary)" if vocab_size is not None else "the ids >= 0"
        raise _fail(source, _row_of(offsets, j), f"token id {values[j]} outside {where}")
    return torch.tensor(values, dtype=torch.long)


def _check_logprobs(source: str, conts: Sequence[Continuation], offsets: list[int]) -> None:
    try:
        lps = torch.tensor([v for c in conts for v in c.logprobs], dtype=torch.float64)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise BackendContractError(f"{source} returned logprobs that are not numbers ({exc})") from None
    bad = ~torch.isfinite(lps) | (lps > LOGPROB_SLACK)
    if bool(bad.any()):
        j = int(bad.nonzero()[0, 0])
        raise _fail(source, _row_of(offsets, j), f"logprobs must be finite and <= 0, got {float(lps[j])}")


def check_continuations(conts, budgets: Sequence[int], *, source: str, vocab_size: int | None, eos_ids) -> None:
    """BackendContractError naming ``source`` and the row unless each is a Continuation within its budget, with ids in
    the vocabulary, finite log-probs <= 0, and a finish reason that agrees with its tokens."""
    if not isinstance(conts, (list, tuple)) or len(conts) != len(budgets):
        got = f"{len(conts)} continuations" if isinstance(conts, (list, tuple)) else type(conts).__name__
        raise BackendContractError(
            f"{source} returned {got} for {len(budgets)} rows; a backend returns one Continuation per row, in order"
        )
    offsets = [0]
    for i, (c, budget) in enumerate(zip(conts, budgets)):
        if not isinstance(c, Continuation):
            raise _fail(source, i, f"{type(c).__name__} is not a Continuation")
        n = len(c.token_ids)
        if len(c.logprobs) != n:
            raise _fail(source, i, f"{len(c.logprobs)} logprobs for {n} tokens")
        if n > budget:
            raise _fail(source, i, f"{n} tokens but its budget is {budget}")
        offsets.append(offsets[-1] + n)
    ids = _flat_ids(source, conts, offsets, vocab_size)
    _check_finish(source, conts, budgets, ids, offsets, eos_ids)
    _check_logprobs(source, conts, offsets)


def _check_finish(source, conts, budgets, ids: torch.Tensor, offsets: list[int], eos_ids) -> None:
    eos = sorted(int(e) for e in eos_ids)
    lengths = torch.tensor([b - a for a, b in zip(offsets[:-1], offsets[1:])], dtype=torch.long)
    is_eos = torch.isin(ids, torch.tensor(eos, dtype=torch.long))
    rows = torch.repeat_interleave(torch.arange(len(conts)), lengths)
    eos_count = torch.zeros(len(conts), dtype=torch.long).index_add_(0, rows, is_eos.long())
    last = torch.tensor(offsets[1:], dtype=torch.long) - 1
    ends_eos = (lengths > 0) & is_eos[last.clamp(min=0)] if ids.numel() else torch.zeros(len(conts), dtype=torch.bool)
    hint = f" (the rollout's EOS ids are {eos}; give the backend the same set)"
    for i, (n, count, at_end) in enumerate(zip(lengths.tolist(), eos_count.tolist(), ends_eos.tolist())):
        reason, budget = conts[i].finish_reason, budgets[i]
        if count > int(at_end):
            raise _fail(source, i, "tokens after an EOS id" + hint)
        if reason not in ("eos", "length"):
            raise _fail(source, i, f"finish_reason must be 'eos' or 'length', got {reason!r}")
        if reason == "eos" and not at_end:
            what = f"last token {int(ids[offsets[i + 1] - 1])} is not an EOS id" if n else "it has no tokens"
            raise _fail(source, i, f"finish_reason 'eos' but its {what}" + hint)
        if reason == "length" and at_end:
            raise _fail(source, i, f"finish_reason 'length' but it ends with the EOS id {int(ids[offsets[i + 1] - 1])}")
        if reason == "length" and n < budget:
            raise _fail(source, i, f"finish_reason 'length' with {n} tokens, fewer than its budget of {budget}")
