"""Public entry points of the Triton verification kernels.

* :func:`verify_padded` -- padded [B, R] drafts, for ``spec_rl.acceptance.dispatch``'s
  ``"triton"`` backend: tensors in, (new log-probs, per-token outcome,
  rejection index) out. Inputs are assumed validated by ``spec_rl.acceptance.dispatch``
  except for scores without a valid distribution (NaN or +inf logits, or a
  row of -inf logits, from logits / hidden states / LM-head weight), which the
  kernels detect with an in-kernel flag (a ValueError naming the (sample,
  token) positions is raised; no result is returned).
* packed entry points for trainers that never pad:
  :func:`verify_packed_logits`, :func:`verify_packed_hidden` (rows of
  logits [N, V] / hidden states [N, d], each row tagged with its sample and
  its token index), :func:`rows_from_cu_seqlens` to build the tags from
  cumulative lengths, and score-only :func:`logprobs_from_logits` /
  :func:`logprobs_from_hidden`.
* :func:`is_available` -- whether the kernels can run on a device.

Decision rule (SPEC-RL, arXiv 2509.23232, Sec. 3, Alg. 1; docs/design.md
"The rule"): token i of sample b is accepted iff ``log u_i <= log(l) +
lp_new_i - lp_old_i`` with u_i = Philox(seed, uid_b, i) (spec_rl.sampling.philox);
the accepted length n_b is the first rejected token index (or the draft
length). The kernels live beside their launchers in :mod:`.from_logits` and
:mod:`.lm_head`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._common import FLOAT_DTYPES, DraftRows, epilogue_mode
from .checks import check_device, is_available, packed_rows, raise_if_flagged, row_vector, unit_stride
from .configs import LMHeadConfig, LogitsConfig
from .from_logits import launch_from_logits
from .lm_head import launch_lm_head, offsets_alignment

_HIDDEN_SOURCE = "logits (hidden_states @ lm_head_weight.T)"


@dataclass
class PackedVerifyOutput:
    """Result of a packed verification over N rows and B samples.

    Attributes:
        new_logprobs: [N] float32 sampling log-probs of the rows' draft tokens
            (0 on padding rows, i.e. row_sample == -1).
        accept: [N] bool per-token test outcome (False on padding rows), or
            None for score-only calls.
        accepted_len: [B] int64 rejection index n_b = min(lengths[b], first
            rejected token index of sample b).
    """

    new_logprobs: torch.Tensor
    accept: torch.Tensor | None
    accepted_len: torch.Tensor


def _packed_output(launched, rows: DraftRows, source: str, score_only: bool) -> PackedVerifyOutput:
    lp, acc, n, flag = launched
    raise_if_flagged(flag, source, lp, (rows.row_sample, rows.row_token))
    return PackedVerifyOutput(lp, None if score_only else acc.bool(), n.to(torch.int64))


# ----------------------------------------------------------------------------
# packed API


def rows_from_cu_seqlens(cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row tags for drafts packed back to back (varlen layout).

    Args:
        cu_seqlens: [B + 1] integer cumulative lengths (cu[0] = 0, cu[B] = N).

    Returns:
        (row_sample [N] int32, row_token [N] int32, lengths [B] int64) on
        cu_seqlens' device (one host sync to read N).

    Raises:
        ValueError: not 1-D, cu[0] != 0, or decreasing.
    """
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1 or cu_seqlens.is_floating_point():
        raise ValueError("cu_seqlens must be a 1-D integer tensor [B + 1]")
    cu = cu_seqlens.to(torch.int64)
    lengths = cu[1:] - cu[:-1]
    if int(cu[0]) != 0 or bool((lengths < 0).any()):
        raise ValueError("cu_seqlens must start at 0 and be non-decreasing")
    n_rows = int(cu[-1])
    b = torch.arange(lengths.numel(), device=cu.device)
    row_sample = torch.repeat_interleave(b, lengths, output_size=n_rows)
    row_token = torch.arange(n_rows, device=cu.device) - cu[:-1][row_sample]
    return row_sample.to(torch.int32), row_token.to(torch.int32), lengths


def verify_packed_logits(
    logits: torch.Tensor,
    draft_ids: torch.Tensor,
    old_logprobs: torch.Tensor,
    *,
    row_sample: torch.Tensor,
    row_token: torch.Tensor,
    lengths: torch.Tensor,
    uids: torch.Tensor,
    seed: int,
    log_lenience: float,
    temperature: float = 1.0,
    config: LogitsConfig | None = None,
    score_only: bool = False,
) -> PackedVerifyOutput:
    """Verify packed draft tokens from rows of logits, reading the logits once.

    Args:
        logits: [N, V] bf16/fp16/fp32 with unit stride over V and any row
            stride. Row r scores ``draft_ids[r]`` (the logits at the position
            before that token).
        draft_ids: [N] integer token ids in [0, V) (not range-checked here;
            ``spec_rl.acceptance.dispatch`` validates ids).
        old_logprobs: [N] float stored log-probs (<= 0).
        row_sample: [N] int sample index in [0, B) of each row; -1 marks a
            padding row (not read, log-prob 0, not accepted).
        row_token: [N] int 0-based token index of the row within its draft
            (keys the Philox uniform together with the sample's uid).
        lengths: [B] int draft lengths in tokens. Every token index in
            [0, lengths[b]) of sample b must appear in exactly one row.
        uids: [B] int64 per-sample ids; seed: 64-bit int; log_lenience:
            log(l), +inf accepts all, -inf rejects all.
        temperature: > 0, the temperature that produced the drafts.
        config: tile override (default :func:`~.configs.default_logits_config`).
        score_only: only compute log-probs (accept=None, accepted_len=lengths).

    Returns:
        :class:`PackedVerifyOutput`.

    Raises:
        ValueError: a scored row without a valid distribution (NaN or +inf
            logits, or every logit -inf), named as (sample, token); or shape errors.
        RuntimeError: the kernels cannot run on the inputs' device.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [N, V], got shape {tuple(logits.shape)}")
    if logits.dtype not in FLOAT_DTYPES:
        raise TypeError(f"logits must be bfloat16, float16 or float32, got {logits.dtype}")
    logits = unit_stride(logits)
    mode = epilogue_mode(log_lenience, score_only)
    rows = packed_rows(
        logits.shape[0], draft_ids, old_logprobs, row_sample, row_token, lengths, uids,
        seed=seed, log_lenience=log_lenience, temperature=temperature, mode=mode,
    )  # fmt: skip
    check_device(logits, *rows.tensors())
    return _packed_output(launch_from_logits(logits, rows, config), rows, "logits", score_only)


def verify_packed_hidden(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    draft_ids: torch.Tensor,
    old_logprobs: torch.Tensor,
    *,
    row_sample: torch.Tensor,
    row_token: torch.Tensor,
    lengths: torch.Tensor,
    uids: torch.Tensor,
    seed: int,
    log_lenience: float,
    lm_head_bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    config: LMHeadConfig | None = None,
    score_only: bool = False,
    row_offsets: torch.Tensor | None = None,
    row_offsets_multiple_of: int = 1,
) -> PackedVerifyOutput:
    """Verify packed draft tokens from final hidden states with the fused LM head.

    The logits ``hidden @ lm_head_weight.T (+ bias)`` are never materialised;
    extra memory is (2 * splits + 1) * N float32 (splits ~16).

    Args:
        hidden: [N, d] (or any 2-D view when ``row_offsets`` is given),
            bf16/fp16/fp32, unit stride over d. Row r scores ``draft_ids[r]``.
        lm_head_weight: [V, d], unit stride over d. bf16/fp16 with the same
            dtype as ``hidden`` use tensor cores with fp32 accumulation;
            fp32 or mixed dtypes use an IEEE fp32 dot (slow, exact products).
        lm_head_bias: optional [V].
        row_offsets: optional [N] int64 element offsets of each row inside
            ``hidden`` (gathers rows of a padded [B, T, d] tensor without a
            copy); when given, N is taken from ``draft_ids``.
        row_offsets_multiple_of: a power of two dividing every row offset
            (and 16 / element size at most); a promise that lets the kernel
            use 16-byte loads. Wrong values give wrong results.
        Other arguments as :func:`verify_packed_logits`.

    Returns:
        :class:`PackedVerifyOutput`.

    Raises:
        ValueError: a scored row without a valid distribution (NaN, overflow to
            +inf, or every logit -inf), named as (sample, token); or shape errors.
        RuntimeError: the kernels cannot run on the inputs' device.
    """
    if hidden.dim() != 2 or lm_head_weight.dim() != 2 or hidden.shape[-1] != lm_head_weight.shape[1]:
        raise ValueError(
            f"hidden [N, d] and lm_head_weight [V, d] disagree: {tuple(hidden.shape)} vs {tuple(lm_head_weight.shape)}"
        )
    if hidden.dtype not in FLOAT_DTYPES or lm_head_weight.dtype not in FLOAT_DTYPES:
        raise TypeError(f"hidden/lm_head_weight must be bf16/fp16/fp32, got {hidden.dtype}/{lm_head_weight.dtype}")
    if lm_head_bias is not None and lm_head_bias.shape != (lm_head_weight.shape[0],):
        raise ValueError(f"lm_head_bias must be [{lm_head_weight.shape[0]}], got {tuple(lm_head_bias.shape)}")
    if hidden.stride(-1) != 1 and row_offsets is not None:
        raise ValueError("hidden must have unit stride over d when row_offsets is given")
    hidden, weight = unit_stride(hidden), unit_stride(lm_head_weight)
    bias = lm_head_bias.contiguous() if lm_head_bias is not None else None
    align = int(row_offsets_multiple_of)
    if align < 1 or align & (align - 1):
        raise ValueError(f"row_offsets_multiple_of must be a power of two >= 1, got {row_offsets_multiple_of!r}")
    n_rows = draft_ids.shape[0] if row_offsets is not None else hidden.shape[0]
    mode = epilogue_mode(log_lenience, score_only)
    rows = packed_rows(
        n_rows, draft_ids, old_logprobs, row_sample, row_token, lengths, uids,
        seed=seed, log_lenience=log_lenience, temperature=temperature, mode=mode,
    )  # fmt: skip
    if row_offsets is not None:
        row_offsets = row_vector(row_offsets, n_rows, "row_offsets").to(torch.int64)
    check_device(hidden, weight, bias, *rows.tensors())
    row_align = min(align, max(1, 16 // hidden.element_size()))
    launched = launch_lm_head(hidden, weight, bias, rows, row_offsets=row_offsets, row_align=row_align, config=config)
    return _packed_output(launched, rows, _HIDDEN_SOURCE, score_only)


def _score_only_tags(rows: int, device: torch.device):
    """Tags of N rows scored on their own: token r of one sample (errors name row r as (0, r))."""
    zeros = torch.zeros(rows, dtype=torch.int32, device=device)
    tokens = torch.arange(rows, dtype=torch.int32, device=device)
    one = torch.zeros(1, dtype=torch.int64, device=device)
    return dict(row_sample=zeros, row_token=tokens, lengths=one, uids=one, seed=0, log_lenience=0.0)


def logprobs_from_logits(
    logits: torch.Tensor, token_ids: torch.Tensor, temperature: float = 1.0, config: LogitsConfig | None = None
) -> torch.Tensor:
    """log softmax(logits / T)[token] for logits [N, V] and ids [N] -> [N] float32 (one read of the logits).

    Raises:
        ValueError: a row without a valid distribution (NaN or +inf logits, or all -inf), named as (0, row).
    """
    rows = logits.shape[0]
    old = torch.zeros(rows, dtype=torch.float32, device=logits.device)
    out = verify_packed_logits(
        logits, token_ids, old, temperature=temperature, config=config, score_only=True,
        **_score_only_tags(rows, logits.device),
    )  # fmt: skip
    return out.new_logprobs


def logprobs_from_hidden(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    token_ids: torch.Tensor,
    lm_head_bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    config: LMHeadConfig | None = None,
) -> torch.Tensor:
    """log softmax((hidden @ W.T + b) / T)[token] for hidden [N, d] -> [N] float32, logits never materialised.

    Raises:
        ValueError: a row without a valid distribution (NaN, overflow, or all -inf), named as (0, row).
    """
    rows = hidden.shape[0]
    old = torch.zeros(rows, dtype=torch.float32, device=hidden.device)
    out = verify_packed_hidden(
        hidden, lm_head_weight, token_ids, old, lm_head_bias=lm_head_bias, temperature=temperature, config=config,
        score_only=True, **_score_only_tags(rows, hidden.device),
    )  # fmt: skip
    return out.new_logprobs


# ----------------------------------------------------------------------------
# padded API (spec_rl.acceptance.dispatch's "triton" backend)


def _padded_from_logits(logits, draft_ids, old_logprobs, lengths, uids, settings, config):
    """From-logits kernel over padded [B, R, V] logits (padded rows are never read)."""
    if logits.dtype not in FLOAT_DTYPES:
        raise NotImplementedError(f"Triton kernels take bf16/fp16/fp32 logits, got {logits.dtype}; use the reference")
    logits = unit_stride(logits)
    ids, old = draft_ids.reshape(-1).contiguous(), old_logprobs.reshape(-1).contiguous()
    rows = DraftRows(ids, old, lengths, uids, None, None, **settings)
    check_device(logits, *rows.tensors())
    lp, acc, n, flag = launch_from_logits(logits, rows, config)
    return lp.view(draft_ids.shape), acc.view(draft_ids.shape).bool(), n, flag


def _padded_from_hidden(hidden, weight, bias, draft_ids, old_logprobs, lengths, uids, settings, config):
    """Fused LM-head kernel over the valid rows of padded [B, R, d] hidden states (gathered in-kernel)."""
    if weight is None:
        raise ValueError("hidden_states needs lm_head_weight [V, d]")
    if hidden.dtype not in FLOAT_DTYPES or weight.dtype not in FLOAT_DTYPES:
        raise NotImplementedError(
            f"Triton kernels take bf16/fp16/fp32 hidden states and LM head, got {hidden.dtype}/{weight.dtype}; "
            "use the reference"
        )
    hidden, weight = unit_stride(hidden), unit_stride(weight)
    bias = bias.contiguous() if bias is not None else None
    check_device(hidden, weight, bias, draft_ids, old_logprobs, lengths, uids)
    valid = torch.arange(draft_ids.shape[1], device=lengths.device).unsqueeze(0) < lengths.unsqueeze(1)
    bt = valid.nonzero()
    b_idx, t_idx = bt[:, 0], bt[:, 1]
    s_b, s_t = hidden.stride(0), hidden.stride(1)
    ids, old = draft_ids[b_idx, t_idx].contiguous(), old_logprobs[b_idx, t_idx].contiguous()
    rows = DraftRows(ids, old, lengths, uids, b_idx.to(torch.int32), t_idx.to(torch.int32), **settings)
    lp_p, acc_p, n, flag = launch_lm_head(
        hidden, weight, bias, rows, row_offsets=(b_idx * s_b + t_idx * s_t).contiguous(),
        row_align=offsets_alignment(hidden.element_size(), s_b, s_t), config=config,
    )  # fmt: skip
    lp_new = torch.zeros(draft_ids.shape, dtype=torch.float32, device=draft_ids.device)
    lp_new[b_idx, t_idx] = lp_p
    accept = torch.zeros(draft_ids.shape, dtype=torch.bool, device=draft_ids.device)
    accept[b_idx, t_idx] = acc_p.bool()
    return lp_new, accept, n, flag


def verify_padded(
    draft_ids: torch.Tensor,
    old_logprobs: torch.Tensor,
    lengths: torch.Tensor,
    uids: torch.Tensor,
    *,
    seed: int,
    log_lenience: float,
    temperature: float,
    logits: torch.Tensor | None = None,
    hidden_states: torch.Tensor | None = None,
    lm_head_weight: torch.Tensor | None = None,
    lm_head_bias: torch.Tensor | None = None,
    score_only: bool = False,
    logits_config: LogitsConfig | None = None,
    lm_head_config: LMHeadConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Score right-padded drafts and apply the acceptance test in one pass over the scores.

    Inputs are assumed validated by ``spec_rl.acceptance.dispatch`` (shapes, devices, ids
    in [0, V), lenience); this function checks only what the kernels need.

    Parameters
    ----------
    draft_ids : [B, R] integer tensor
        Draft token ids (any value at padding positions).
    old_logprobs : [B, R] float tensor
        Stored log-probs of the draft tokens.
    lengths : [B] integer tensor
        Draft lengths in tokens (0 <= lengths[b] <= R).
    uids : [B] int64 tensor
        Per-sample ids keying the uniforms.
    seed : int
        64-bit seed of the uniforms.
    log_lenience : float
        log(l); +inf accepts every draft token, -inf rejects them all.
    temperature : float
        T > 0 of the sampling distribution softmax(logits / T).
    logits : [B, R, V] tensor, optional
        Row i scores draft token i; bf16/fp16/fp32 with unit stride over V
        (other strides are copied). Padded rows are never read.
    hidden_states : [B, R, d] tensor, optional
        Instead of logits: final hidden states, with ``lm_head_weight`` [V, d]
        (and optional ``lm_head_bias`` [V]); only valid rows are scored,
        gathered in-kernel without a copy.
    score_only : bool
        Only compute the log-probs (for the random-reuse strategy, which
        draws n on the host): ``accept`` is all False, ``accepted_len`` is
        ``lengths``.
    logits_config, lm_head_config : optional
        Tile overrides (:class:`~.configs.LogitsConfig`, :class:`~.configs.LMHeadConfig`).

    Returns
    -------
    new_logprobs : [B, R] float32
        Sampling log-probs of the draft tokens under the scores, 0 at padding.
    accept : [B, R] bool
        Per-token test outcome (False at padding).
    accepted_len : [B] int64
        Rejection index: the first rejected token index, or the draft length.

    Raises
    ------
    ValueError
        A scored position without a valid distribution (NaN or +inf logits, or
        every logit -inf), named as (sample, token); not exactly one score source;
        hidden_states without lm_head_weight.
    NotImplementedError
        Scores that are not bf16/fp16/fp32 (e.g. float64): use the reference.
    RuntimeError
        The kernels cannot run on the inputs' device.

    Example
    -------
    >>> lp_new, accept, n = verify_padded(ids, old, lengths, uids, seed=7, log_lenience=0.5,
    ...                                   temperature=1.0, logits=logits)
    """
    if (logits is None) == (hidden_states is None):
        raise ValueError("pass exactly one of logits or hidden_states (with lm_head_weight)")
    device = draft_ids.device
    lengths = lengths.to(device=device, dtype=torch.int64).contiguous()
    uids = uids.to(device=device, dtype=torch.int64).contiguous()
    mode = epilogue_mode(log_lenience, score_only)
    settings = dict(seed=seed, log_lenience=log_lenience, temperature=temperature, mode=mode)
    inputs = (draft_ids, old_logprobs, lengths, uids, settings)
    if logits is not None:
        lp_new, accept, n, flag = _padded_from_logits(logits, *inputs, logits_config)
        raise_if_flagged(flag, "logits", lp_new)
    else:
        lp_new, accept, n, flag = _padded_from_hidden(
            hidden_states, lm_head_weight, lm_head_bias, *inputs, lm_head_config
        )
        raise_if_flagged(flag, _HIDDEN_SOURCE, lp_new)
    if score_only:  # the kernel made no decisions (its accept buffer is unwritten)
        accept = torch.zeros_like(accept)
    return lp_new, accept, n.to(torch.int64)


__all__ = [
    "PackedVerifyOutput",
    "is_available",
    "logprobs_from_hidden",
    "logprobs_from_logits",
    "rows_from_cu_seqlens",
    "verify_packed_hidden",
    "verify_packed_logits",
    "verify_padded",
]
