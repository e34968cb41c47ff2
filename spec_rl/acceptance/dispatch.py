"""Public verification entry point: validate the inputs once, then dispatch.

``verify`` implements the SPEC-RL acceptance rule (arXiv 2509.23232, Sec. 3,
Alg. 1; docs/design.md "The rule") for a batch of drafts. It accepts the
policy's scores in one of three forms:

* ``new_logprobs`` [B, R]: already computed sampling log-probs;
* ``logits`` [B, R, V]: logits aligned with the draft (row i scores draft
  token i, i.e. the logits at the position *before* token i);
* ``hidden_states`` [B, R, d] + ``lm_head_weight`` [V, d] (+ bias [V]):
  final hidden states aligned the same way; logits are never materialised
  for the whole batch.

Backends: ``"reference"`` is the torch implementation in
:mod:`spec_rl.acceptance.reference` (CPU and CUDA). ``"triton"`` is the fused kernels
of :mod:`spec_rl.kernels` (CUDA; on CPU only under ``TRITON_INTERPRET=1``,
for tests). ``"auto"`` uses Triton on CUDA tensors when it is installed and
the settings are plain (top_k = 0, top_p = 1; the kernels do not filter the
vocabulary), and the reference otherwise. Both give identical decisions: the
uniforms are the same Philox bits and the test is done in float64.

Internally the validated inputs travel as one :class:`_Checked` bundle: the
scores as :class:`~spec_rl.acceptance.scores.DraftScores` and the distribution as
:class:`~spec_rl.sampling.distribution.SamplingSettings`, so the keyword list below is
written once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..sampling.distribution import SamplingSettings
from ..util.validation import check_int, format_positions
from .reference import (
    ACCEPTANCE_RULES,
    RANDOM_STRATEGIES,
    VerifyResult,
    lengths_mask,
    lenience_to_log,
    make_result,
    random_reuse_index,
    reference_verify,
)
from .scores import DraftScores

BACKENDS = ("auto", "reference", "triton")
STRATEGIES = ("spec", "random", "random-ref")


@dataclass
class _Checked:
    """Validated verification inputs (padding positions of ``draft_ids`` zeroed)."""

    draft_ids: torch.Tensor
    old_logprobs: torch.Tensor
    lengths: torch.Tensor
    uids: torch.Tensor
    scores: DraftScores
    settings: SamplingSettings
    log_lenience: float
    backend: str


def _detached(t):
    """``t.detach()`` for a tensor (a view: no copy), anything else unchanged (checked later)."""
    return t.detach() if isinstance(t, torch.Tensor) else t


def _pick_backend(backend: str, device: torch.device, settings: SamplingSettings, scores: DraftScores) -> str:
    """Resolve "auto" to a concrete backend (see the module docstring)."""
    if scores.source == "new_logprobs":
        return "reference"  # nothing to score: no kernel needed
    if backend != "auto":
        return backend
    if device.type != "cuda" or scores.source == "new_logprobs" or not settings.is_plain:
        return "reference"
    try:
        from .. import kernels
    except ImportError:
        return "reference"
    return "triton" if kernels.is_available(device) else "reference"


def _check_tensor(name: str, t, shape: tuple[int, ...] | None, kind: str, device: torch.device | None = None) -> None:
    """``check_shape_dtype_device``-style check: a tensor of ``shape`` (None: any), integer or float, on ``device``."""
    if not isinstance(t, torch.Tensor):
        hint = f" (e.g. torch.tensor({name}))" if isinstance(t, (list, tuple)) or hasattr(t, "__array__") else ""
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}{hint}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)}")
    if kind == "float" and not t.is_floating_point():
        raise TypeError(f"{name} must be a float tensor, got {t.dtype}")
    if kind == "int" and (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool):
        raise TypeError(f"{name} must be an integer tensor, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but draft_ids is on {device}; move all inputs to one device")


def _check_finite(name: str, lp: torch.Tensor, valid: torch.Tensor) -> None:
    """NaN/+inf in [B, R] log-probs at valid positions: a ValueError naming the first (sample, token) positions."""
    bad = valid & (torch.isnan(lp) | (lp == float("inf")))
    if bool(bad.any()):
        where = torch.nonzero(bad)
        raise ValueError(
            f"{name} contains NaN or +inf at {where.shape[0]} unmasked position(s) (sample, token): "
            f"{format_positions(where[:8].tolist(), where.shape[0])}; the policy forward produced invalid scores "
            "(check for overflow in fp16, or mask those positions out with lengths)"
        )


def _check_logprobs(name: str, lp: torch.Tensor, valid: torch.Tensor, hint: str = "") -> None:
    _check_finite(name, lp, valid)
    if bool((lp[valid] > 1e-4).any()):
        raise ValueError(f"{name} must be log-probabilities (<= 0); got positive values{hint}")


def _resolve_lengths(draft_ids: torch.Tensor, response_mask, lengths) -> torch.Tensor:
    bsz, max_len = draft_ids.shape
    if response_mask is not None and lengths is not None:
        raise ValueError("pass either response_mask or lengths, not both")
    if response_mask is not None:
        _check_tensor("response_mask", response_mask, (bsz, max_len), "any")
        mask = response_mask.to(torch.bool)
        lens = mask.sum(dim=1)
        if not torch.equal(mask, lengths_mask(lens, max_len)):
            raise ValueError(
                "response_mask must mark a contiguous prefix of each row (right padding); "
                "left-padded or holey masks are not drafts — pass lengths instead"
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
    if sum(x is not None for x in (scores.new_logprobs, scores.logits, scores.hidden_states)) != 1:
        raise ValueError("pass exactly one of new_logprobs, logits, or hidden_states (with lm_head_weight)")
    if scores.same_as is not None:
        _check_tensor("same_as", scores.same_as, shape, "int", device)
        if scores.same_as.numel() and (int(scores.same_as.min()) < 0 or int(scores.same_as.max()) >= shape[0] * shape[1]):
            raise ValueError(f"same_as holds flat indices outside [0, {shape[0] * shape[1]}) (B * R)")
    if scores.new_logprobs is not None:
        _check_tensor("new_logprobs", scores.new_logprobs, shape, "float", device)
        return None
    if scores.logits is not None:
        _check_tensor("logits", scores.logits, None, "float", device)
        if scores.logits.dim() != 3 or tuple(scores.logits.shape[:2]) != shape:
            raise ValueError(f"logits has shape {tuple(scores.logits.shape)}, expected [B, R, V] with [B, R] = {shape}")
        return scores.logits.shape[2]
    hidden, weight, bias = scores.hidden_states, scores.lm_head_weight, scores.lm_head_bias
    if weight is None:
        raise ValueError("hidden_states needs lm_head_weight [V, d]")
    _check_tensor("hidden_states", hidden, None, "float", device)
    if hidden.dim() != 3 or tuple(hidden.shape[:2]) != shape:
        raise ValueError(f"hidden_states has shape {tuple(hidden.shape)}, expected [B, R, d] with [B, R] = {shape}")
    _check_tensor("lm_head_weight", weight, None, "float", device)
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[2]:
        raise ValueError(f"lm_head_weight has shape {tuple(weight.shape)}, expected [V, d] with d = {hidden.shape[2]}")
    if bias is not None:
        _check_tensor("lm_head_bias", bias, (weight.shape[0],), "float", device)
    return weight.shape[0]


def _check_uids(uids, bsz: int, device: torch.device) -> torch.Tensor:
    if uids is None:
        return torch.arange(bsz, device=device, dtype=torch.int64)
    _check_tensor("uids", uids, (bsz,), "int")
    return uids.to(device=device, dtype=torch.int64)


def _validate(draft_ids, old_logprobs, scores, response_mask, lengths, settings, log_lenience, uids, backend) -> _Checked:
    """Every input check of :func:`verify`, in one place."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    _check_tensor("draft_ids", draft_ids, None, "int")
    if draft_ids.dim() != 2:
        raise ValueError(f"draft_ids must be a [B, R] tensor, got shape {tuple(draft_ids.shape)}")
    shape, device = (draft_ids.shape[0], draft_ids.shape[1]), draft_ids.device
    if device.type == "meta":
        raise ValueError("draft_ids is on the meta device (it holds no data); verify needs tensors with values")
    if not isinstance(old_logprobs, torch.Tensor) or tuple(old_logprobs.shape) != shape:
        got = tuple(old_logprobs.shape) if isinstance(old_logprobs, torch.Tensor) else type(old_logprobs).__name__
        raise ValueError(f"old_logprobs has shape {got}, expected draft_ids' shape {shape}")
    _check_tensor("old_logprobs", old_logprobs, shape, "float", device)
    vocab = _check_scores(scores, shape, device)
    lens = _resolve_lengths(draft_ids, response_mask, lengths)
    valid = lengths_mask(lens, shape[1])
    chosen = _pick_backend(backend, device, settings, scores)
    if scores.new_logprobs is not None:
        _check_logprobs("new_logprobs", scores.new_logprobs, valid)
    # Logits or hidden states are not scanned here: both backends flag the positions without a valid
    # distribution while scoring (one read of the scores), with the same error.
    _check_logprobs("old_logprobs", old_logprobs, valid, " — did you pass probabilities or logits?")
    if vocab is not None and valid.any():
        ids = draft_ids[valid]
        if bool(((ids < 0) | (ids >= vocab)).any()):
            raise ValueError(f"draft_ids contains ids outside [0, {vocab}) at unmasked positions (vocabulary size {vocab})")
    safe_ids = torch.where(valid, draft_ids, torch.zeros((), dtype=draft_ids.dtype, device=device))
    return _Checked(safe_ids, old_logprobs, lens, _check_uids(uids, shape[0], device), scores, settings, log_lenience, chosen)


def _verify_triton(c: _Checked, seed: int, strategy: str, return_accept_mask: bool) -> VerifyResult:
    from .. import kernels

    if not kernels.is_available(c.draft_ids.device):
        raise RuntimeError(
            f"backend='triton' is not available on {c.draft_ids.device}: install triton, and on CPU set "
            "TRITON_INTERPRET=1 before importing spec_rl.kernels; or use backend='reference'"
        )
    if not c.settings.is_plain:
        raise NotImplementedError(
            "Triton verification kernels score softmax(logits / T) over the full vocabulary; "
            "top_k/top_p filtering is only in the reference backend"
        )
    s = c.scores
    lp_new, accept, n = kernels.verify_padded(
        c.draft_ids, c.old_logprobs, c.lengths, c.uids,
        seed=seed, log_lenience=c.log_lenience, temperature=c.settings.temperature,
        logits=s.logits, hidden_states=s.hidden_states, lm_head_weight=s.lm_head_weight, lm_head_bias=s.lm_head_bias,
        score_only=strategy in RANDOM_STRATEGIES,
    )  # fmt: skip
    if strategy in RANDOM_STRATEGIES:
        n = random_reuse_index(seed, c.uids, c.lengths, strategy)
        accept = lengths_mask(n, c.draft_ids.shape[1])
    return make_result(lp_new, n, accept, c.lengths, return_accept_mask)


def verify(
    draft_ids: torch.Tensor,
    old_logprobs: torch.Tensor,
    *,
    new_logprobs: torch.Tensor | None = None,
    logits: torch.Tensor | None = None,
    hidden_states: torch.Tensor | None = None,
    lm_head_weight: torch.Tensor | None = None,
    lm_head_bias: torch.Tensor | None = None,
    response_mask: torch.Tensor | None = None,
    lengths: torch.Tensor | None = None,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    lenience: float | None = None,
    log_lenience: float | None = None,
    seed: int = 0,
    uids: torch.Tensor | None = None,
    strategy: str = "spec",
    backend: str = "auto",
    return_accept_mask: bool = False,
    acceptance: str = "lenient",
    same_as: torch.Tensor | None = None,
) -> VerifyResult:
    """Verify a batch of drafts under the current policy (SPEC-RL Sec. 3, Alg. 1).

    Parameters
    ----------
    draft_ids : [B, R] integer tensor
        Token ids of the drafts, right-padded (values at padded positions are ignored).
    old_logprobs : [B, R] float tensor, or None with ``acceptance="exact"``
        Log-probs stored with the drafts (under the policy that last validated them), each <= 0.
    new_logprobs, logits, hidden_states (+ lm_head_weight, lm_head_bias)
        Exactly one score source, see the module docstring.
    response_mask : [B, R] bool, optional
        True on a leading prefix of each row; or ``lengths`` [B] int draft
        lengths in [0, R]. Neither means all R positions are valid.
    temperature, top_k, top_p
        The sampling settings that produced the drafts (ignored with ``new_logprobs``).
    lenience, log_lenience
        l >= 0 (1 = vanilla speculative decoding, inf = reuse all, 0 = reuse
        nothing), or log(l). Default l = 1.
    seed : int
        64-bit seed of the acceptance uniforms.
    uids : [B] int64, optional
        Per-sample ids keying the uniforms (default ``arange(B)``, which makes
        decisions depend on batch position: pass stable ids in training).
    strategy : "spec", "random" or "random-ref"
        Lenient acceptance, or the random-reuse ablation (paper Table 2): n uniform over 0..R
        ("random"), or over 0..R-1 as in the reference implementation ("random-ref": never a full reuse).
    backend : "auto", "reference" or "triton"
    return_accept_mask : bool
        Also return the per-token test outcome.
    acceptance : "lenient" or "exact"
        The paper's test (default), or exact speculative sampling of a point-mass draft: accept
        y_i iff ``log u_i <= lp_new_i`` (old logprobs and lenience unused; docs/design.md
        "Exact acceptance"). With "exact" the token at a rejection must be drawn from the
        residual (pi_t without y_n, renormalised) for the response to be a fresh sample of pi_t.
    same_as : [B, R] int64, optional
        Which positions share one output (:class:`~spec_rl.acceptance.scores.DraftScores`, set by the
        tree-packed scorer): the reference backend then runs the LM head once per distinct output;
        the Triton kernels ignore it.

    Returns
    -------
    :class:`~spec_rl.acceptance.reference.VerifyResult`
        Tensors without autograd history: verification runs under ``torch.no_grad()`` on detached
        inputs, so it never keeps a graph (or its memory) alive.

    Raises
    ------
    ValueError
        Shape mismatches; scores without a valid distribution at unmasked positions (NaN or +inf
        logits, or every logit -inf: the same error, naming the (sample, token) positions, on every
        backend); NaN or positive logprobs; token ids outside [0, V); negative or NaN lenience; bad
        temperature/top-k/top-p values; unknown strategy or backend; meta tensors.
    TypeError
        Wrong types: non-tensor inputs, non-integer ids, non-float scores, a non-integer seed,
        a non-number temperature/top-p or non-integer top-k.
    NotImplementedError
        ``backend="triton"`` with top-k/top-p or a score dtype the kernels do not take.

    Example
    -------
    >>> res = verify(ids, old, logits=logits, lengths=lens, lenience=math.exp(0.5), seed=step_seed, uids=uids)
    >>> keep = [ids[b, : int(n)] for b, n in enumerate(res.accepted_len)]
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if acceptance not in ACCEPTANCE_RULES:
        raise ValueError(f"acceptance must be one of {ACCEPTANCE_RULES}, got {acceptance!r}")
    if acceptance == "exact":
        if strategy in RANDOM_STRATEGIES:
            raise ValueError(f"strategy={strategy!r} (the random-reuse ablation) ignores the scores; acceptance='exact' does not apply")
        if lenience not in (None, 1, 1.0) or log_lenience not in (None, 0, 0.0):
            raise ValueError("lenience applies to acceptance='lenient' only; exact acceptance has no lenience")
        if isinstance(draft_ids, torch.Tensor) and old_logprobs is None:
            old_logprobs = torch.zeros(draft_ids.shape, dtype=torch.float32, device=draft_ids.device)
        elif isinstance(old_logprobs, torch.Tensor):
            old_logprobs = torch.zeros_like(old_logprobs)  # the exact test is the lenient one with lp_old = 0, l = 1
    settings = SamplingSettings(temperature=temperature, top_p=top_p, top_k=top_k)
    seed = check_int("seed", seed, hint=" (the 64-bit seed of the acceptance uniforms, taken modulo 2**64)")
    log_l = lenience_to_log(lenience, log_lenience)
    # Verification never needs gradients: detached inputs and no_grad keep a policy's LM-head Parameter
    # (requires_grad=True) or hidden states from a forward with a graph from growing one here.
    with torch.no_grad():
        scores = DraftScores(
            hidden_states=_detached(hidden_states), logits=_detached(logits), lm_head_weight=_detached(lm_head_weight),
            lm_head_bias=_detached(lm_head_bias), new_logprobs=_detached(new_logprobs), same_as=_detached(same_as),
        )  # fmt: skip
        c = _validate(_detached(draft_ids), _detached(old_logprobs), scores, response_mask, lengths, settings, log_l, uids, backend)
        if c.backend == "triton":
            try:
                return _verify_triton(c, seed, strategy, return_accept_mask)
            except NotImplementedError:
                if backend == "triton":
                    raise
        return reference_verify(
            c.draft_ids, c.old_logprobs, c.lengths, c.uids, c.scores,
            seed=seed, log_lenience=c.log_lenience, settings=c.settings, strategy=strategy,
            return_accept_mask=return_accept_mask,
        )  # fmt: skip
