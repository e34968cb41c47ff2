"""What the rollout checks in a backend's answers before they become responses and next epoch's drafts: a backend
(perhaps a user's own) that breaks the contract gets a BackendContractError naming it (docs/bad-inputs.md)."""

from __future__ import annotations

import operator
from bisect import bisect_right
from collections.abc import Sequence

import torch

from ..acceptance.scores import DraftScores
from ..sampling.groups import int64_tensor, rows_by_prompt
from ..util.validation import LOGPROB_SLACK, check_int
from .base import Backend, Continuation, Scored


class BackendContractError(RuntimeError):
    """A generation backend returned something its contract rules out (the message names the backend)."""


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
    """TypeError unless ``backend`` is a :class:`~spec_rl.backends.base.Backend`."""
    if not isinstance(backend, Backend):
        raise TypeError(
            "backend must be a Backend (TransformersBackend, VLLMBackend, PagedEngine, or your own subclass of "
            f"spec_rl.backends.Backend), got {backend_name(backend)}"
        )


def scores_vocab_size(scores: DraftScores) -> int | None:
    """V of a scoring pass's logits or LM head; None for precomputed log-probs."""
    if scores.logits is not None:
        return int(scores.logits.shape[-1])
    return int(scores.lm_head_weight.shape[0]) if scores.lm_head_weight is not None else None


def check_scored(scored, rows: int, width: int, source: str) -> None:
    """BackendContractError unless ``scored`` is a Scored whose scores are [rows, width, ...]."""
    if not (isinstance(scored, Scored) and isinstance(scored.scores, DraftScores)):
        raise BackendContractError(f"{source} must return a Scored holding DraftScores, got {type(scored).__name__}")
    scores = scored.scores
    value = getattr(scores, scores.source)
    if not isinstance(value, torch.Tensor) or tuple(value.shape[:2]) != (rows, width):
        shape = list(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise BackendContractError(
            f"{source} returned {scores.source} of shape {shape}; expected [{rows}, {width}, ...]"
        )


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


def check_shared_outputs(same, prompts: Sequence[Sequence[int]], drafts: Sequence[Sequence[int]], source: str) -> None:
    """BackendContractError naming ``source`` and the first wrong entry of ``DraftScores.same_as`` ([B, R] int64 or
    None): ``same[b, r] = b' * R + r'`` must name the first position scored by the same output (in column r, inside its
    draft, same prompt, naming itself; drafts b, b' share their first r tokens; padding names itself), or a token would
    be scored with another prefix."""
    if same is None:
        return
    bsz, width = len(drafts), max([len(d) for d in drafts] + [1])
    if not (isinstance(same, torch.Tensor) and tuple(same.shape) == (bsz, width) and same.dtype == torch.int64):
        what = f"{tuple(same.shape)} {same.dtype}" if isinstance(same, torch.Tensor) else type(same).__name__
        raise BackendContractError(
            f"{source} returned same_as {what}; expected None or int64 [{bsz}, {width}] of flat indices in "
            f"[0, {bsz * width})"
        )
    t = same.cpu()
    if t.numel() and (int(t.min()) < 0 or int(t.max()) >= bsz * width):
        raise BackendContractError(
            f"{source} returned same_as with indices outside [0, {bsz * width}) (the flat [B, R] range)"
        )
    ok = _matches(t, prompts, drafts)
    if not bool(ok.all()):
        b, r = (int(v) for v in torch.nonzero(~ok)[0])
        raise BackendContractError(
            f"{source} returned same_as[{b}, {r}] = {int(t[b, r])}, which does not name a position scored by the same "
            "output (same prompt, same draft prefix, same column; padding names itself); return same_as=None if "
            "the backend does not share outputs"
        )


def _matches(t: torch.Tensor, prompts, drafts) -> torch.Tensor:
    """[B, R] bool: entry (b, r) of ``t`` satisfies every rule of the module docstring."""
    bsz, width = t.shape
    lengths = int64_tensor([len(d) for d in drafts])
    cols = torch.arange(width).expand(bsz, width)
    own = torch.arange(bsz).unsqueeze(1) * width + cols
    valid = cols < lengths.unsqueeze(1)
    ids = torch.zeros((bsz, width), dtype=torch.long)
    ids[valid] = int64_tensor([x for d in drafts for x in d])
    group = torch.zeros(bsz, dtype=torch.long)
    for g, rows in enumerate(rows_by_prompt(prompts).values()):
        group[rows] = g
    tb, tr = t // width, t % width
    ok = (tr == cols) & (cols < lengths[tb]) & (group[tb] == group.unsqueeze(1))
    ok &= t.view(-1)[t.view(-1)].view(bsz, width) == t  # the representative names itself
    prev = torch.ones((bsz, width), dtype=torch.bool)
    if width > 1:  # same token at r - 1 and the same representative there
        back = (cols - 1).clamp(min=0)[:, 1:]
        prev[:, 1:] = (ids[tb[:, 1:], back] == ids[:, :-1]) & (t[tb[:, 1:], back] == t[:, :-1])
    return torch.where(valid, ok & prev, t == own)
