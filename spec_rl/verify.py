"""Public verification entry point: validates inputs, then dispatches.

``verify`` implements the SPEC-RL acceptance rule (arXiv 2509.23232, Alg. 1;
DESIGN.md "The rule") for a batch of drafts. It accepts the policy's scores in
one of three forms:

* ``new_logprobs`` [B, R]: already computed sampling log-probs;
* ``logits`` [B, R, V]: logits aligned with the draft (row i scores draft
  token i, i.e. the logits at the position *before* token i);
* ``hidden_states`` [B, R, d] + ``lm_head_weight`` [V, d] (+ bias [V]):
  final hidden states aligned the same way; logits are never materialised
  for the whole batch.

Backends: ``"reference"`` is the torch implementation in
:mod:`spec_rl.reference` (CPU and CUDA). ``"triton"`` is the fused kernels
of :mod:`spec_rl.kernels` (CUDA; on CPU only under ``TRITON_INTERPRET=1``,
for tests). ``"auto"`` uses Triton on CUDA tensors when it is installed and
the settings are plain (top_k = 0, top_p = 1; the kernels do not filter the
vocabulary), and the reference otherwise. Both give identical decisions: the
uniforms are the same Philox bits and the test is done in float64.
"""

from __future__ import annotations

import math

import torch

from .reference import VerifyResult, lenience_to_log, lengths_mask, reference_verify

_BACKENDS = ("auto", "reference", "triton")


def _pick_backend(backend: str, device: torch.device, top_k: int, top_p: float, has_scores: bool) -> str:
    """Resolve "auto" to a concrete backend (see the module docstring)."""
    if backend != "auto":
        return backend
    if device.type != "cuda" or not has_scores or top_k != 0 or top_p < 1.0:
        return "reference"
    try:
        from . import kernels
    except ImportError:
        return "reference"
    return "triton" if kernels.is_available(device) else "reference"


def _check_no_nan(name: str, tensor: torch.Tensor, valid_rows: torch.Tensor | None = None) -> None:
    values = tensor if valid_rows is None else tensor[valid_rows]
    if values.is_floating_point() and bool((torch.isnan(values) | (values == float("inf"))).any()):
        raise ValueError(
            f"{name} contains NaN or +inf at unmasked positions; the policy forward produced invalid scores "
            "(check for overflow in fp16, or mask those positions out)"
        )


def _resolve_lengths(
    draft_ids: torch.Tensor, response_mask: torch.Tensor | None, lengths: torch.Tensor | None
) -> torch.Tensor:
    bsz, max_len = draft_ids.shape
    if response_mask is not None and lengths is not None:
        raise ValueError("pass either response_mask or lengths, not both")
    if response_mask is not None:
        if response_mask.shape != draft_ids.shape:
            raise ValueError(f"response_mask has shape {tuple(response_mask.shape)}, expected draft_ids' shape {(bsz, max_len)}")
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
    if lengths.shape != (bsz,):
        raise ValueError(f"lengths has shape {tuple(lengths.shape)}, expected ({bsz},)")
    if lengths.is_floating_point():
        raise TypeError(f"lengths must be an integer tensor, got {lengths.dtype}")
    lens = lengths.to(device=draft_ids.device, dtype=torch.int64)
    if bool(((lens < 0) | (lens > max_len)).any()):
        raise ValueError(f"lengths must lie in [0, {max_len}] (the padded draft length)")
    return lens


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
) -> VerifyResult:
    """Verify a batch of drafts under the current policy (SPEC-RL Alg. 1).

    Args:
        draft_ids: [B, R] integer token ids of the drafts, right-padded
            (values at padded positions are ignored).
        old_logprobs: [B, R] float log-probs stored with the drafts (under the
            policy that last validated them), each <= 0.
        new_logprobs / logits / hidden_states (+ lm_head_weight,
            lm_head_bias): exactly one score source, see the module docstring.
        response_mask: [B, R] bool, True on a leading prefix of each row; or
        lengths: [B] int draft lengths in [0, R]. Neither means all R valid.
        temperature, top_k, top_p: the sampling settings that produced the
            drafts (ignored when ``new_logprobs`` is given).
        lenience: l >= 0 (1 = vanilla speculative decoding, inf = reuse all,
            0 = reuse nothing); or log_lenience = log(l). Default l = 1.
        seed: 64-bit seed of the acceptance uniforms.
        uids: [B] int64 per-sample ids keying the uniforms (default
            ``arange(B)``, which makes decisions depend on batch position:
            pass stable ids in training).
        strategy: "spec" (lenient acceptance) or "random" (random-reuse
            ablation, paper Table 2: n uniform over 0..R).
        backend: "auto" or "reference".
        return_accept_mask: also return the per-token test outcome.

    Returns:
        :class:`~spec_rl.reference.VerifyResult`.

    Raises:
        ValueError: shape mismatches, NaN scores or old logprobs at unmasked
            positions, positive old logprobs, token ids outside [0, V),
            negative or NaN lenience, bad temperature/top-k/top-p.
        TypeError: wrong dtypes (non-integer ids, non-float scores).
    """
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    if strategy not in ("spec", "random"):
        raise ValueError(f"strategy must be 'spec' or 'random', got {strategy!r}")
    if not isinstance(draft_ids, torch.Tensor) or draft_ids.dim() != 2:
        raise ValueError("draft_ids must be a [B, R] tensor")
    if draft_ids.is_floating_point() or draft_ids.dtype == torch.bool:
        raise TypeError(f"draft_ids must be an integer tensor, got {draft_ids.dtype}")
    bsz, max_len = draft_ids.shape
    device = draft_ids.device
    if not isinstance(old_logprobs, torch.Tensor) or old_logprobs.shape != draft_ids.shape:
        got = tuple(old_logprobs.shape) if isinstance(old_logprobs, torch.Tensor) else type(old_logprobs).__name__
        raise ValueError(f"old_logprobs has shape {got}, expected draft_ids' shape {(bsz, max_len)}")
    if not old_logprobs.is_floating_point():
        raise TypeError(f"old_logprobs must be a float tensor, got {old_logprobs.dtype}")
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    if int(top_k) != top_k or top_k < 0:
        raise ValueError(f"top_k must be an integer >= 0 (0 disables), got {top_k!r}")
    if not (0.0 < float(top_p) <= 1.0):
        raise ValueError(f"top_p must be in (0, 1] (1 disables), got {top_p!r}")
    log_l = lenience_to_log(lenience, log_lenience)

    sources = [x is not None for x in (new_logprobs, logits, hidden_states)]
    if sum(sources) != 1:
        raise ValueError("pass exactly one of new_logprobs, logits, or hidden_states (with lm_head_weight)")

    lens = _resolve_lengths(draft_ids, response_mask, lengths)
    valid = lengths_mask(lens, max_len)
    chosen = _pick_backend(backend, device, int(top_k), float(top_p), new_logprobs is None)
    # The kernels flag NaN in logits/hidden states themselves; scanning here would read the scores twice.
    scan_scores = chosen == "reference"

    tensors = {"old_logprobs": old_logprobs}
    vocab = None
    if new_logprobs is not None:
        if new_logprobs.shape != draft_ids.shape:
            raise ValueError(f"new_logprobs has shape {tuple(new_logprobs.shape)}, expected {(bsz, max_len)}")
        if not new_logprobs.is_floating_point():
            raise TypeError(f"new_logprobs must be a float tensor, got {new_logprobs.dtype}")
        tensors["new_logprobs"] = new_logprobs
        _check_no_nan("new_logprobs", new_logprobs, valid)
        if bool((new_logprobs[valid] > 1e-4).any()):
            raise ValueError("new_logprobs must be log-probabilities (<= 0); got positive values")
    elif logits is not None:
        if logits.dim() != 3 or logits.shape[:2] != draft_ids.shape:
            raise ValueError(f"logits has shape {tuple(logits.shape)}, expected [B, R, V] with [B, R] = {(bsz, max_len)}")
        if not logits.is_floating_point():
            raise TypeError(f"logits must be a float tensor, got {logits.dtype}")
        tensors["logits"] = logits
        vocab = logits.shape[2]
        if scan_scores:
            _check_no_nan("logits", logits, valid)
    else:
        if lm_head_weight is None:
            raise ValueError("hidden_states needs lm_head_weight [V, d]")
        if hidden_states.dim() != 3 or hidden_states.shape[:2] != draft_ids.shape:
            raise ValueError(
                f"hidden_states has shape {tuple(hidden_states.shape)}, expected [B, R, d] with [B, R] = {(bsz, max_len)}"
            )
        if lm_head_weight.dim() != 2 or lm_head_weight.shape[1] != hidden_states.shape[2]:
            raise ValueError(
                f"lm_head_weight has shape {tuple(lm_head_weight.shape)}, expected [V, d] with d = {hidden_states.shape[2]}"
            )
        if lm_head_bias is not None and lm_head_bias.shape != (lm_head_weight.shape[0],):
            raise ValueError(f"lm_head_bias has shape {tuple(lm_head_bias.shape)}, expected ({lm_head_weight.shape[0]},)")
        tensors.update(hidden_states=hidden_states, lm_head_weight=lm_head_weight)
        if lm_head_bias is not None:
            tensors["lm_head_bias"] = lm_head_bias
        vocab = lm_head_weight.shape[0]
        if scan_scores:
            _check_no_nan("hidden_states", hidden_states, valid)
            _check_no_nan("lm_head_weight", lm_head_weight)
    for name, t in tensors.items():
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but draft_ids is on {device}; move all inputs to one device")

    _check_no_nan("old_logprobs", old_logprobs, valid)
    if bool((old_logprobs[valid] > 1e-4).any()):
        raise ValueError("old_logprobs must be log-probabilities (<= 0); got positive values — did you pass probabilities or logits?")
    if vocab is not None and valid.any():
        ids = draft_ids[valid]
        if bool(((ids < 0) | (ids >= vocab)).any()):
            raise ValueError(f"draft_ids contains ids outside [0, {vocab}) at unmasked positions (vocabulary size {vocab})")
    safe_ids = torch.where(valid, draft_ids, torch.zeros((), dtype=draft_ids.dtype, device=device))

    if uids is None:
        uids = torch.arange(bsz, device=device, dtype=torch.int64)
    else:
        if not isinstance(uids, torch.Tensor) or uids.shape != (bsz,):
            raise ValueError(f"uids must be a [{bsz}] int64 tensor of per-sample ids")
        if uids.is_floating_point():
            raise TypeError(f"uids must be an integer tensor, got {uids.dtype}")
        uids = uids.to(device=device, dtype=torch.int64)

    args = dict(
        seed=int(seed),
        uids=uids,
        log_lenience=log_l,
        new_logprobs=new_logprobs,
        logits=logits,
        hidden_states=hidden_states,
        lm_head_weight=lm_head_weight,
        lm_head_bias=lm_head_bias,
        temperature=float(temperature),
        top_k=int(top_k),
        top_p=float(top_p),
        strategy=strategy,
        return_accept_mask=return_accept_mask,
    )
    if chosen == "triton":
        from . import kernels

        if not kernels.is_available(device):
            raise RuntimeError(
                f"backend='triton' is not available on {device}: install triton, and on CPU set TRITON_INTERPRET=1 "
                "before importing spec_rl.kernels; or use backend='reference'"
            )
        try:
            return kernels.verify_triton(safe_ids, old_logprobs, lens, **args)
        except NotImplementedError:
            if backend == "triton":
                raise
            # Fall back to the NaN-checked reference for what the kernels do not cover.
    if not scan_scores:  # fell back from the kernels: scan now
        if logits is not None:
            _check_no_nan("logits", logits, valid)
        elif hidden_states is not None:
            _check_no_nan("hidden_states", hidden_states, valid)
    return reference_verify(safe_ids, old_logprobs, lens, **args)
