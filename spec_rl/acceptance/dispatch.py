"""The verify functions (SPEC-RL Sec. 3, Alg. 1; contract: docs/api.md "Verification"): inputs validated once, then
"reference" (torch), "triton" (fused kernels; CUDA, or CPU under ``TRITON_INTERPRET=1``) or "auto" (Triton for CUDA
tensors with plain sampling). Backends decide alike: same Philox uniforms, float64 test.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..sampling.distribution import SamplingSettings, check_settings
from ..util.triton import kernels_for
from ..util.validation import (
    LOGPROB_SLACK,
    check_choice,
    check_int,
    check_type,
    format_positions,
    invalid_scores_message,
)
from .mode import RolloutMode
from .reference import SCORE_NAMES, VerifyResult, lengths_mask, make_result, reference_verify
from .rules import Rule
from .scores import DraftScores

BACKENDS = ("auto", "reference", "triton")


@dataclass(frozen=True)
class VerifyOptions:
    """How the verify functions decide.

    ``mode``: a :class:`~spec_rl.acceptance.mode.RolloutMode` that reuses drafts, or its name (``"spec"``: the paper's
    lenient rule at e^0.5; ``"exact"``: lossless; ``"random"``: the ablation; ``"l=1"``, ...). ``sampling``: the
    settings that produced the drafts (scores are log-softmaxed under them). ``backend``: "auto", "reference" or
    "triton". ``return_accept_mask``: also return the per-token outcomes. ValueError for an unknown mode or backend,
    or a mode without drafts; TypeError for wrongly typed fields.
    """

    mode: RolloutMode | str = "spec"
    sampling: SamplingSettings = field(default_factory=SamplingSettings)
    backend: str = "auto"
    return_accept_mask: bool = False

    def __post_init__(self) -> None:
        mode = RolloutMode.parse(self.mode)
        if mode.rule is None:
            raise ValueError(f"mode {self.mode!r} reuses no drafts: there is nothing to verify")
        if mode.rule.verified_by() != mode.rule or mode.rule.shared_keys:
            raise ValueError(
                f"mode {self.mode!r}: {mode.rule.describe()} is made by a rollout (its draw needs the draft's own "
                "policy, or its keys the rollout's keyed walk), which the verify functions alone cannot honour: run "
                "it through SpeculativeRollout, or verify with the rule's test alone (e.g. l=1, exact)"
            )
        object.__setattr__(self, "mode", mode)
        check_choice("backend", self.backend, BACKENDS)
        if not isinstance(self.return_accept_mask, bool):
            raise TypeError(f"return_accept_mask must be True or False, got {self.return_accept_mask!r}")
        check_settings(self.sampling, "sampling")

    @property
    def rule(self) -> Rule:
        return self.mode.rule


@dataclass
class _Checked:
    """Validated verification inputs (``draft_ids`` zeroed at padding)."""

    draft_ids: torch.Tensor
    old_logprobs: torch.Tensor
    lengths: torch.Tensor
    uids: torch.Tensor
    scores: DraftScores
    backend: str


def _detached(t):
    return t.detach() if isinstance(t, torch.Tensor) else t


def _pick_backend(backend: str, device: torch.device, settings: SamplingSettings, scores: DraftScores) -> str:
    """Resolve "auto" to a concrete backend (see the module docstring)."""
    if scores.source == "new_logprobs":
        return "reference"  # nothing to score: no kernel needed
    if backend != "auto":
        return backend
    if device.type != "cuda" or not settings.is_plain:
        return "reference"
    return "triton" if kernels_for(device) is not None else "reference"


def _check_tensor(name: str, t, shape: tuple | None, kind: str, device: torch.device | None = None) -> None:
    """A tensor with values of ``shape`` (None: any; a str entry names a free size, e.g. "V") and ``kind`` ("int",
    "float", "any"), on ``device`` (None: any)."""
    hint = f" (e.g. torch.tensor({name}))" if isinstance(t, (list, tuple)) or hasattr(t, "__array__") else ""
    check_type(name, t, torch.Tensor, "a torch.Tensor", hint)
    if t.device.type == "meta":
        raise ValueError(f"{name} is on the meta device (it holds no data); verify needs tensors with values")
    if shape is not None and (
        t.dim() != len(shape) or any(n != s for n, s in zip(t.shape, shape) if isinstance(s, int))
    ):
        want = str(tuple(shape)).replace("'", "")
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {want}")
    integer = not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)
    if kind != "any" and integer != (kind == "int"):
        raise TypeError(f"{name} must be a{'n integer' if kind == 'int' else ' float'} tensor, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but draft_ids is on {device}; move all inputs to one device")


def _check_logprobs(name: str, lp: torch.Tensor, valid: torch.Tensor, hint: str) -> None:
    """ValueError naming the first (sample, token) positions of [B, R] ``lp`` that are NaN or > 0 where ``valid``."""
    bad = valid & (torch.isnan(lp) | (lp > LOGPROB_SLACK))
    if bool(bad.any()):
        where = torch.nonzero(bad)
        raise ValueError(
            f"{name} must be log-probabilities (<= 0, not NaN), got {lp[bad][0].item()} at {where.shape[0]} unmasked "
            f"position(s) (sample, token): {format_positions(where[:8].tolist(), where.shape[0])}{hint}"
        )


def _resolve_lengths(draft_ids: torch.Tensor, lengths) -> torch.Tensor:
    bsz, max_len = draft_ids.shape
    if isinstance(lengths, torch.Tensor) and lengths.dim() == 2:  # a [B, R] response mask
        _check_tensor("lengths", lengths, (bsz, max_len), "any")
        mask = lengths.to(torch.bool)
        lens = mask.sum(dim=1)
        if not torch.equal(mask, lengths_mask(lens, max_len)):
            raise ValueError(
                "lengths as a [B, R] mask must mark a contiguous prefix of each row (right padding); "
                "left-padded or holey masks are not drafts: pass [B] lengths instead"
            )
        return lens.to(torch.int64)
    if lengths is None:
        return torch.full((bsz,), max_len, dtype=torch.int64, device=draft_ids.device)
    _check_tensor("lengths", lengths, (bsz,), "int")
    lens = lengths.to(device=draft_ids.device, dtype=torch.int64)
    if bool(((lens < 0) | (lens > max_len)).any()):
        raise ValueError(f"lengths must lie in [0, {max_len}] (the padded draft length)")
    return lens


def _check_scores(scores: DraftScores, shape: tuple[int, int], device: torch.device) -> int | None:
    """Shapes, dtypes and devices of the one score source; returns the vocabulary size (None for new_logprobs)."""
    sources = (scores.new_logprobs, scores.logits, scores.hidden_states)
    if sum(x is not None for x in sources) != 1 or (scores.hidden_states is None) != (scores.lm_head_weight is None):
        raise ValueError("pass exactly one of new_logprobs, logits, or hidden_states with lm_head_weight")
    if scores.same_as is not None:
        _check_tensor("same_as", scores.same_as, shape, "int", device)
    if scores.new_logprobs is not None:
        _check_tensor("new_logprobs", scores.new_logprobs, shape, "float", device)
        return None
    if scores.logits is not None:
        _check_tensor("logits", scores.logits, (*shape, "V"), "float", device)
        return scores.logits.shape[2]
    hidden, weight, bias = scores.hidden_states, scores.lm_head_weight, scores.lm_head_bias
    _check_tensor("hidden_states", hidden, (*shape, "d"), "float", device)
    _check_tensor("lm_head_weight", weight, ("V", hidden.shape[2]), "float", device)
    if bias is not None:
        _check_tensor("lm_head_bias", bias, (weight.shape[0],), "float", device)
    return weight.shape[0]


def _validate(draft_ids, old_logprobs, scores, lengths, uids, options: VerifyOptions) -> _Checked:
    _check_tensor("draft_ids", draft_ids, ("B", "R"), "int")
    shape, device = (draft_ids.shape[0], draft_ids.shape[1]), draft_ids.device
    _check_tensor("old_logprobs", old_logprobs, shape, "float", device)
    vocab = _check_scores(scores, shape, device)
    lens = _resolve_lengths(draft_ids, lengths)
    valid = lengths_mask(lens, shape[1])
    chosen = _pick_backend(options.backend, device, options.sampling, scores)
    if scores.new_logprobs is not None:
        _check_logprobs("new_logprobs", scores.new_logprobs, valid, "; the policy forward produced invalid scores")
    # Logits and hidden states are not scanned here: both backends flag positions without a distribution while
    # scoring (one read of the scores), with the same error.
    _check_logprobs("old_logprobs", old_logprobs, valid, " — did you pass probabilities or logits?")
    if vocab is not None and bool((valid & ((draft_ids < 0) | (draft_ids >= vocab))).any()):
        raise ValueError(f"draft_ids contains ids outside [0, {vocab}) at unmasked positions (vocabulary size {vocab})")
    if uids is None:
        uids = torch.arange(shape[0], device=device)
    _check_tensor("uids", uids, (shape[0],), "int")
    safe_ids = torch.where(valid, draft_ids, torch.zeros((), dtype=draft_ids.dtype, device=device))
    return _Checked(safe_ids, old_logprobs, lens, uids.to(device=device, dtype=torch.int64), scores, chosen)


def _verify_triton(c: _Checked, seed: int, options: VerifyOptions) -> VerifyResult:
    from .. import kernels

    if not kernels.is_available(c.draft_ids.device):
        raise RuntimeError(
            f"backend='triton' is not available on {c.draft_ids.device}: install triton, and on CPU set "
            "TRITON_INTERPRET=1 before importing spec_rl.kernels; or use backend='reference'"
        )
    if not options.sampling.is_plain:
        raise NotImplementedError(
            "Triton verification kernels score softmax(logits / T) over the full vocabulary; "
            "top_k/top_p filtering is only in the reference backend"
        )
    switch = options.rule.kernel_switch()  # where it does not read lp_old, verify_scores passed zeros
    log_l = switch[0] if switch is not None else 0.0
    settings = dict(seed=seed, log_lenience=log_l, temperature=options.sampling.temperature, score_only=switch is None)
    s, drafts = c.scores, (c.draft_ids, c.old_logprobs, c.lengths, c.uids)
    try:
        if s.logits is not None:
            lp_new, accept, n = kernels.verify_logits(s.logits, kernels.DraftRows.padded(*drafts, **settings))
        else:
            head = (s.hidden_states, s.lm_head_weight, s.lm_head_bias)
            lp_new, accept, n = kernels.verify_hidden_padded(*head, *drafts, **settings)
    except kernels.InvalidScores as bad:  # worded as the reference's
        raise ValueError(invalid_scores_message(SCORE_NAMES[s.source], bad.positions, bad.total)) from None
    if switch is None:  # the kernels scored; the rule decides in torch
        accept, n = options.rule.decide(lp_new, c.old_logprobs, c.lengths, seed, c.uids)
    return make_result(lp_new, n, accept, c.lengths, options.return_accept_mask)


def verify_scores(
    draft_ids,
    old_logprobs,
    scores: DraftScores,
    lengths=None,
    *,
    seed: int = 0,
    uids=None,
    options: VerifyOptions | None = None,
) -> VerifyResult:
    """Body of the verify functions; ``scores`` holds one source. Arguments and errors as :func:`verify_logits`."""
    options = check_type("options", VerifyOptions() if options is None else options, VerifyOptions)
    seed = check_int("seed", seed, hint=" (the 64-bit seed of the acceptance uniforms, taken modulo 2**64)")
    switch = options.rule.kernel_switch()
    if isinstance(draft_ids, torch.Tensor) and switch is not None and not switch[1]:  # e.g. exact: lp_old is not read
        old_logprobs = torch.zeros(draft_ids.shape, dtype=torch.float32, device=draft_ids.device)
    # No autograd: an LM-head Parameter or hidden states that carry a graph must not grow it here.
    with torch.no_grad():
        scores = DraftScores(**{k: _detached(v) for k, v in vars(scores).items()})
        c = _validate(_detached(draft_ids), _detached(old_logprobs), scores, _detached(lengths), uids, options)
        if c.backend == "triton":
            try:
                return _verify_triton(c, seed, options)
            except NotImplementedError:
                if options.backend == "triton":
                    raise
        return reference_verify(c.draft_ids, c.old_logprobs, c.lengths, c.uids, c.scores, seed=seed, options=options)


def verify_logprobs(
    draft_ids,
    old_logprobs,
    new_logprobs,
    lengths=None,
    *,
    seed: int = 0,
    uids=None,
    options: VerifyOptions | None = None,
) -> VerifyResult:
    """Verify drafts with already computed ``new_logprobs`` [B, R] float (<= 0); the rest as :func:`verify_logits`."""
    return verify_scores(
        draft_ids, old_logprobs, DraftScores(new_logprobs=new_logprobs), lengths, seed=seed, uids=uids, options=options
    )


def verify_logits(
    draft_ids, old_logprobs, logits, lengths=None, *, seed: int = 0, uids=None, options: VerifyOptions | None = None
) -> VerifyResult:
    """Verify B drafts against the current policy's logits (SPEC-RL Sec. 3, Alg. 1).

    Args:
        draft_ids: [B, R] integer token ids, right-padded.
        old_logprobs: [B, R] float log-probs stored with the drafts (None for a rule that reads none, e.g. exact).
        logits: [B, R, V] float; row i scores draft token i (the logits at the position before it).
        lengths: [B] integer draft lengths, or a [B, R] bool mask of a leading prefix; None: all R valid.
        seed: 64-bit seed of the acceptance uniforms; uids: [B] int64 stable per-sample ids (default arange(B)).

    Returns a :class:`~spec_rl.acceptance.reference.VerifyResult` without autograd history. ValueError: shapes, ids
    outside [0, V), scores without a distribution (named by (sample, token)), NaN or positive log-probs. TypeError:
    wrongly typed inputs. NotImplementedError: backend "triton" with top-k/top-p or float64 scores. RuntimeError:
    backend "triton" where it is not available.
    """
    return verify_scores(
        draft_ids, old_logprobs, DraftScores(logits=logits), lengths, seed=seed, uids=uids, options=options
    )


def verify_hidden(
    draft_ids,
    old_logprobs,
    hidden_states,
    lm_head,
    lengths=None,
    *,
    seed: int = 0,
    uids=None,
    options: VerifyOptions | None = None,
) -> VerifyResult:
    """Verify drafts from final hidden states [B, R, d] and ``lm_head`` (weight [V, d], or a module with ``.weight``
    and ``.bias``, e.g. ``model.get_output_embeddings()``) without forming [B, R, V] logits; the rest as
    :func:`verify_logits`."""
    weight, bias = lm_head, None
    if not isinstance(lm_head, torch.Tensor):
        weight, bias = getattr(lm_head, "weight", None), getattr(lm_head, "bias", None)
        if not isinstance(weight, torch.Tensor):
            raise TypeError(
                f"lm_head must be a [V, d] weight tensor or a module with .weight, got {type(lm_head).__name__}"
            )
    scores = DraftScores(hidden_states=hidden_states, lm_head_weight=weight, lm_head_bias=bias)
    return verify_scores(draft_ids, old_logprobs, scores, lengths, seed=seed, uids=uids, options=options)
