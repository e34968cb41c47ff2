"""Public verification entry points (docs/api.md "Kernels"): padded drafts or packed rows, from logits or hidden
states; the rule is SPEC-RL Sec. 3, Alg. 1 (docs/design.md "The rule"), u = Philox(seed, uid, token index).

Scores without a valid distribution (NaN, +inf, a row of -inf) set an in-kernel flag and raise ValueError."""

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
    """Packed result: new_logprobs [N] f32 (0 on padding rows), accept [N] bool (None when score-only),
    accepted_len [B] int64 = min(lengths[b], first rejected token index of sample b)."""

    new_logprobs: torch.Tensor
    accept: torch.Tensor | None
    accepted_len: torch.Tensor


@dataclass
class PackedDrafts:
    """N draft tokens packed back to back (docs/api.md): draft_ids, old_logprobs, row_sample, row_token: [N];
    lengths, uids: [B]. row_sample in [0, B) (-1: padding, never read); row_token keys the uniform; each index below
    lengths[b] is in exactly one row; row_offsets: optional [N] int64 element offsets into ``hidden``;
    row_offsets_multiple_of: a power of two dividing them (a promise for 16-byte loads: if false, wrong results)."""

    draft_ids: torch.Tensor
    old_logprobs: torch.Tensor
    row_sample: torch.Tensor
    row_token: torch.Tensor
    lengths: torch.Tensor
    uids: torch.Tensor
    row_offsets: torch.Tensor | None = None
    row_offsets_multiple_of: int = 1

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens, draft_ids, old_logprobs, uids, **extra) -> PackedDrafts:
        """Drafts back to back with cumulative lengths ``cu_seqlens`` [B + 1] (:func:`rows_from_cu_seqlens`)."""
        row_sample, row_token, lengths = rows_from_cu_seqlens(cu_seqlens)
        return cls(draft_ids, old_logprobs, row_sample, row_token, lengths, uids, **extra)

    def rows(self, n_rows: int, **settings) -> DraftRows:
        return packed_rows(
            n_rows,
            self.draft_ids,
            self.old_logprobs,
            self.row_sample,
            self.row_token,
            self.lengths,
            self.uids,
            **settings,
        )


def _packed_output(launched, rows: DraftRows, source: str, score_only: bool) -> PackedVerifyOutput:
    lp, acc, n, flag = launched
    raise_if_flagged(flag, source, lp, (rows.row_sample, rows.row_token))
    return PackedVerifyOutput(lp, None if score_only else acc.bool(), n.to(torch.int64))


def rows_from_cu_seqlens(cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row_sample [N] int32, row_token [N] int32, lengths [B] int64) from cu_seqlens [B + 1] (one sync).
    ValueError unless cu_seqlens is a 1-D integer tensor starting at 0 and non-decreasing."""
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
    drafts: PackedDrafts,
    *,
    seed: int,
    log_lenience: float,
    temperature: float = 1.0,
    config: LogitsConfig | None = None,
    score_only: bool = False,
) -> PackedVerifyOutput:
    """Verify packed drafts from logits [N, V] bf16/fp16/fp32 (unit stride over V), read once; row r scores id r.

    ``log_lenience``: log(l), +inf accepts all, -inf rejects all; ``score_only``: log-probs only (accept None,
    accepted_len = lengths). Ids are not range-checked. Raises ValueError for bad shapes or a row without a valid
    distribution (named as (sample, token)), TypeError for other dtypes, RuntimeError if the device has no kernels."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [N, V], got shape {tuple(logits.shape)}")
    if logits.dtype not in FLOAT_DTYPES:
        raise TypeError(f"logits must be bfloat16, float16 or float32, got {logits.dtype}")
    logits = unit_stride(logits)
    mode = epilogue_mode(log_lenience, score_only)
    rows = drafts.rows(logits.shape[0], seed=seed, log_lenience=log_lenience, temperature=temperature, mode=mode)
    check_device(logits, *rows.tensors())
    return _packed_output(launch_from_logits(logits, rows, config), rows, "logits", score_only)


def verify_packed_hidden(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    drafts: PackedDrafts,
    *,
    seed: int,
    log_lenience: float,
    lm_head_bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    config: LMHeadConfig | None = None,
    score_only: bool = False,
) -> PackedVerifyOutput:
    """Verify packed drafts from hidden states with the fused LM head; extra memory (2 * splits + 1) * N f32.

    ``hidden``: [N, d] (any 2-D view with ``drafts.row_offsets``), unit stride over d; ``lm_head_weight``: [V, d]
    (bf16/fp16 of hidden's dtype: tensor cores with fp32 accumulation, else an IEEE fp32 dot); ``lm_head_bias``:
    optional [V]. Other arguments and errors as :func:`verify_packed_logits`."""
    if hidden.dim() != 2 or lm_head_weight.dim() != 2 or hidden.shape[-1] != lm_head_weight.shape[1]:
        raise ValueError(
            f"hidden [N, d] and lm_head_weight [V, d] disagree: {tuple(hidden.shape)} vs {tuple(lm_head_weight.shape)}"
        )
    if hidden.dtype not in FLOAT_DTYPES or lm_head_weight.dtype not in FLOAT_DTYPES:
        raise TypeError(f"hidden/lm_head_weight must be bf16/fp16/fp32, got {hidden.dtype}/{lm_head_weight.dtype}")
    if lm_head_bias is not None and lm_head_bias.shape != (lm_head_weight.shape[0],):
        raise ValueError(f"lm_head_bias must be [{lm_head_weight.shape[0]}], got {tuple(lm_head_bias.shape)}")
    row_offsets = drafts.row_offsets
    if hidden.stride(-1) != 1 and row_offsets is not None:
        raise ValueError("hidden must have unit stride over d when row_offsets is given")
    hidden, weight = unit_stride(hidden), unit_stride(lm_head_weight)
    bias = lm_head_bias.contiguous() if lm_head_bias is not None else None
    align = int(drafts.row_offsets_multiple_of)
    if align < 1 or align & (align - 1):
        raise ValueError(f"row_offsets_multiple_of must be a power of two >= 1, got {drafts.row_offsets_multiple_of!r}")
    n_rows = drafts.draft_ids.shape[0] if row_offsets is not None else hidden.shape[0]
    mode = epilogue_mode(log_lenience, score_only)
    rows = drafts.rows(n_rows, seed=seed, log_lenience=log_lenience, temperature=temperature, mode=mode)
    if row_offsets is not None:
        row_offsets = row_vector(row_offsets, n_rows, "row_offsets").to(torch.int64)
    check_device(hidden, weight, bias, *rows.tensors())
    row_align = min(align, max(1, 16 // hidden.element_size()))
    launched = launch_lm_head(hidden, weight, bias, rows, row_offsets=row_offsets, row_align=row_align, config=config)
    return _packed_output(launched, rows, _HIDDEN_SOURCE, score_only)


def _score_only_drafts(token_ids: torch.Tensor) -> PackedDrafts:
    """Row r as token r of sample 0 (errors name it (0, r))."""
    rows, device = token_ids.shape[0], token_ids.device
    zeros = torch.zeros(rows, dtype=torch.int32, device=device)
    tokens = torch.arange(rows, dtype=torch.int32, device=device)
    one = torch.zeros(1, dtype=torch.int64, device=device)
    old = torch.zeros(rows, dtype=torch.float32, device=device)
    return PackedDrafts(token_ids, old, zeros, tokens, one, one)


def logprobs_from_logits(
    logits: torch.Tensor, token_ids: torch.Tensor, temperature: float = 1.0, config: LogitsConfig | None = None
) -> torch.Tensor:
    """log softmax(logits / T)[token] for logits [N, V], ids [N] -> [N] f32; invalid row r: ValueError at (0, r)."""
    out = verify_packed_logits(
        logits,
        _score_only_drafts(token_ids),
        seed=0,
        log_lenience=0.0,
        temperature=temperature,
        config=config,
        score_only=True,
    )
    return out.new_logprobs


def logprobs_from_hidden(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    token_ids: torch.Tensor,
    lm_head_bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    config: LMHeadConfig | None = None,
) -> torch.Tensor:
    """log softmax((hidden @ W.T + b) / T)[token] for hidden [N, d] -> [N] f32; invalid row r: ValueError (0, r)."""
    out = verify_packed_hidden(
        hidden,
        lm_head_weight,
        _score_only_drafts(token_ids),
        seed=0,
        log_lenience=0.0,
        lm_head_bias=lm_head_bias,
        temperature=temperature,
        config=config,
        score_only=True,
    )
    return out.new_logprobs


def _padded_from_logits(logits, draft_ids, old_logprobs, lengths, uids, settings, config):
    if logits.dtype not in FLOAT_DTYPES:
        raise NotImplementedError(f"Triton kernels take bf16/fp16/fp32 logits, got {logits.dtype}; use the reference")
    logits = unit_stride(logits)
    ids, old = draft_ids.reshape(-1).contiguous(), old_logprobs.reshape(-1).contiguous()
    rows = DraftRows(ids, old, lengths, uids, None, None, **settings)
    check_device(logits, *rows.tensors())
    lp, acc, n, flag = launch_from_logits(logits, rows, config)
    return lp.view(draft_ids.shape), acc.view(draft_ids.shape).bool(), n, flag


def _padded_from_hidden(hidden, weight, bias, draft_ids, old_logprobs, lengths, uids, settings, config):
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
        hidden,
        weight,
        bias,
        rows,
        row_offsets=(b_idx * s_b + t_idx * s_t).contiguous(),
        row_align=offsets_alignment(hidden.element_size(), s_b, s_t),
        config=config,
    )
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
    scores,
    *,
    seed: int,
    log_lenience: float,
    temperature: float,
    score_only: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The "triton" backend of the verify functions (inputs assumed validated): right-padded drafts [B, R].

    ``scores``: ``logits`` [B, R, V], or ``hidden_states`` [B, R, d] with ``lm_head_weight`` [V, d] (and
    ``lm_head_bias``), e.g. a :class:`spec_rl.DraftScores`; padding is never read. Returns new_logprobs [B, R] f32
    (0 at padding), accept [B, R] bool (False if ``score_only``), accepted_len [B] int64. Raises ValueError for an
    invalid distribution (sample, token), NotImplementedError unless bf16/fp16/fp32, RuntimeError without kernels."""
    logits, hidden_states = scores.logits, scores.hidden_states
    lm_head_weight, lm_head_bias = scores.lm_head_weight, scores.lm_head_bias
    if (logits is None) == (hidden_states is None):
        raise ValueError("pass exactly one of logits or hidden_states (with lm_head_weight)")
    device = draft_ids.device
    lengths = lengths.to(device=device, dtype=torch.int64).contiguous()
    uids = uids.to(device=device, dtype=torch.int64).contiguous()
    mode = epilogue_mode(log_lenience, score_only)
    settings = dict(seed=seed, log_lenience=log_lenience, temperature=temperature, mode=mode)
    inputs = (draft_ids, old_logprobs, lengths, uids, settings)
    if logits is not None:
        lp_new, accept, n, flag = _padded_from_logits(logits, *inputs, None)
        raise_if_flagged(flag, "logits", lp_new)
    else:
        lp_new, accept, n, flag = _padded_from_hidden(hidden_states, lm_head_weight, lm_head_bias, *inputs, None)
        raise_if_flagged(flag, _HIDDEN_SOURCE, lp_new)
    if score_only:  # the accept buffer is unwritten
        accept = torch.zeros_like(accept)
    return lp_new, accept, n.to(torch.int64)


__all__ = [
    "PackedDrafts",
    "PackedVerifyOutput",
    "is_available",
    "logprobs_from_hidden",
    "logprobs_from_logits",
    "rows_from_cu_seqlens",
    "verify_packed_hidden",
    "verify_packed_logits",
    "verify_padded",
]
