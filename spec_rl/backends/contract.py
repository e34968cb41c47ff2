"""What the rollout checks in a backend's answers before they become responses and next epoch's drafts: a backend
(perhaps a user's own) that breaks the contract gets a BackendContractError naming it (docs/bad-inputs.md)."""

from __future__ import annotations

import math
import numbers
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


def check_scored(scored, rows: int, width: int, source: str) -> None:
    """BackendContractError unless ``scored`` is a Scored whose scores are [rows, width, ...]."""
    scores = getattr(scored, "scores", None)
    value = getattr(scores, scores.source, None) if isinstance(scores, DraftScores) else None
    if not isinstance(scored, Scored) or not isinstance(value, torch.Tensor) or tuple(value.shape[:2]) != (rows, width):
        got = f"{scores.source} of shape {list(value.shape)}" if isinstance(value, torch.Tensor) else repr(scored)[:80]
        raise BackendContractError(
            f"{source} returned {got}; expected a Scored with DraftScores of shape [{rows}, {width}, ...]"
        )


def check_continuations(conts, budgets: Sequence[int], *, source: str, vocab_size: int | None, eos_ids) -> None:
    """BackendContractError naming ``source`` and the row unless each is a Continuation within its budget, with ids in
    the vocabulary, finite log-probs <= 0, and a finish reason that agrees with its tokens."""
    if not isinstance(conts, (list, tuple)) or len(conts) != len(budgets):
        got = f"{len(conts)} continuations" if isinstance(conts, (list, tuple)) else type(conts).__name__
        raise BackendContractError(
            f"{source} returned {got} for {len(budgets)} rows; a backend returns one Continuation per row, in order"
        )
    eos = sorted(int(e) for e in eos_ids)
    for i, (c, budget) in enumerate(zip(conts, budgets)):
        problem = _continuation_problem(c, budget, vocab_size, eos)
        if problem:
            raise BackendContractError(f"{source} returned an invalid continuation for row {i}: {problem}")


def _continuation_problem(c, budget: int, vocab_size: int | None, eos: list[int]) -> str | None:
    """What is wrong with one continuation (the contract of :func:`check_continuations`), or None."""
    if not isinstance(c, Continuation):
        return f"{type(c).__name__} is not a Continuation"
    ids, n = c.token_ids, len(c.token_ids)
    if len(c.logprobs) != n:
        return f"{len(c.logprobs)} logprobs for {n} tokens"
    if n > budget:
        return f"{n} tokens but its budget is {budget}"
    odd = [t for t in ids if isinstance(t, bool) or not isinstance(t, numbers.Integral)]
    if odd:
        return f"token ids must be integers, got {odd[0]!r}"
    outside = [t for t in ids if t < 0 or (vocab_size is not None and t >= vocab_size)]
    if outside:
        where = f"[0, {vocab_size}) (the model's vocabulary)" if vocab_size is not None else "the ids >= 0"
        return f"token id {outside[0]} outside {where}"
    bad_lp = [v for v in c.logprobs if not (isinstance(v, numbers.Real) and -math.inf < v <= LOGPROB_SLACK)]
    if bad_lp:
        return f"logprobs must be finite and <= 0, got {bad_lp[0]!r}"
    hint = f" (the rollout's EOS ids are {eos}; give the backend the same set)"
    at_end = n > 0 and ids[-1] in eos
    if sum(t in eos for t in ids) > at_end:
        return "tokens after an EOS id" + hint
    if c.finish_reason == "eos" and not at_end:
        last = f"its last token {ids[-1]} is not an EOS id" if n else "it has no tokens"
        return f"finish_reason 'eos' but {last}{hint}"
    if c.finish_reason == "length" and at_end:
        return f"finish_reason 'length' but it ends with the EOS id {ids[-1]}"
    if c.finish_reason == "length" and n < budget:
        return f"finish_reason 'length' with {n} tokens, fewer than its budget of {budget}"
    if c.finish_reason not in ("eos", "length"):
        return f"finish_reason must be 'eos' or 'length', got {c.finish_reason!r}"
    return None


def check_shared_outputs(same, prompts: Sequence[Sequence[int]], drafts: Sequence[Sequence[int]], source: str) -> None:
    """BackendContractError naming ``source`` and the first wrong entry of ``DraftScores.same_as`` ([B, R] int64 or
    None): ``same[b, r] = b' * R + r'`` must name the first position scored by the same output (in column r, inside its
    draft, same prompt, naming itself; drafts b, b' share their first r tokens; padding names itself), or a token would
    be scored with another prefix."""
    if same is None:
        return
    bsz, width = len(drafts), max([len(d) for d in drafts] + [1])
    shaped = isinstance(same, torch.Tensor) and tuple(same.shape) == (bsz, width) and same.dtype == torch.int64
    t = same.cpu() if shaped else None
    if not shaped or (t.numel() and (int(t.min()) < 0 or int(t.max()) >= bsz * width)):
        what = f"{tuple(same.shape)} {same.dtype}" if isinstance(same, torch.Tensor) else type(same).__name__
        what += f" with indices in [{int(t.min())}, {int(t.max())}]" if shaped else ""
        raise BackendContractError(
            f"{source} returned same_as {what}; expected None or int64 [{bsz}, {width}] of flat indices in "
            f"[0, {bsz * width})"
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
