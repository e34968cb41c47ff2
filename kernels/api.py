"""Python entry points of the Triton verification backend.

Two levels:

* :func:`verify_triton` -- the signature and semantics of
  :func:`spec_rl.acceptance.reference_verify` (padded [B, R] drafts), for
  ``spec_rl.verify``'s dispatcher. Inputs are assumed validated by
  ``spec_rl.verify`` except for NaN in logits / hidden states / LM-head
  weight, which the kernels detect with an in-kernel flag (a ValueError is
  raised; no result is returned).
* packed entry points for trainers that never pad:
  :func:`verify_packed_logits`, :func:`verify_packed_hidden` (rows of
  logits [N, V] / hidden states [N, d], each row tagged with its sample and
  its token index), :func:`rows_from_cu_seqlens` to build the tags from
  cumulative lengths, and score-only :func:`logprobs_from_logits` /
  :func:`logprobs_from_hidden`.

Decision rule (SPEC-RL, arXiv 2509.23232, Alg. 1; DESIGN.md "The rule"):
token i of sample b is accepted iff ``log u_i <= log(l) + lp_new_i -
lp_old_i`` with u_i = Philox(seed, uid_b, i) (spec_rl.philox); the accepted
length n_b is the first rejected token index (or the draft length).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton

from spec_rl.acceptance import VerifyResult, VerifyStats, lengths_mask, random_reuse_index, reference_verify

from ._common import MODE_SCORE_ONLY, as_i32, f64_words, lenience_mode, split_u64
from .configs import LMHeadConfig, LogitsConfig, default_lm_head_config, default_logits_config
from .from_logits import verify_from_logits_kernel
from .lm_head import lm_head_merge_kernel, lm_head_partial_kernel

# The kernels were created by the interpreter when TRITON_INTERPRET=1 was set
# before this module was imported (triton reads it at decoration time).
INTERPRET = type(verify_from_logits_kernel).__name__ == "InterpretedFunction"

_LOG2E = 1.4426950408889634  # log2(e)
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def is_available(device: torch.device | str | None = None) -> bool:
    """True when the kernels can run on ``device`` (default: CUDA if present).

    CUDA tensors need a CUDA build of torch with a visible GPU; CPU tensors
    need the Triton interpreter (TRITON_INTERPRET=1 set before importing
    spec_rl.kernels) -- slow, for tests only.
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available()
    if device.type == "cpu":
        return INTERPRET
    return False


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


# ----------------------------------------------------------------------------
# helpers


def _check_device(*tensors: torch.Tensor) -> None:
    dev = tensors[0].device
    if not is_available(dev):
        hint = (
            "set TRITON_INTERPRET=1 before importing spec_rl.kernels to run them on CPU (slow; tests only)"
            if dev.type == "cpu"
            else "no usable CUDA device"
        )
        raise RuntimeError(f"Triton verification kernels cannot run on {dev}: {hint}")
    for t in tensors[1:]:
        if t is not None and t.device != dev:
            raise ValueError(f"all inputs must be on {dev}; got a tensor on {t.device}")


def _seed_args(seed: int) -> tuple[int, int]:
    lo, hi = split_u64(seed)
    return as_i32(lo), as_i32(hi)


def _nan_error(source: str) -> ValueError:
    return ValueError(
        f"{source} contain NaN (or +inf) at unmasked positions; the policy forward produced invalid scores "
        "(check for overflow in fp16, or mask those positions out)"
    )


def _row_vector(t: torch.Tensor, n: int, name: str) -> torch.Tensor:
    if t.shape != (n,):
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected ({n},)")
    return t.contiguous()


def _decision_buffers(n_rows: int, lengths: torch.Tensor, device: torch.device):
    lp = torch.empty(n_rows, dtype=torch.float32, device=device)
    acc = torch.empty(n_rows, dtype=torch.int8, device=device)
    n = lengths.to(device=device, dtype=torch.int32).clone()
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    return lp, acc, n, flag


def _scalar_args(seed: int, log_lenience: float, temperature: float):
    k0, k1 = _seed_args(seed)
    ll = log_lenience if math.isfinite(log_lenience) else 0.0
    l_lo, l_hi = f64_words(ll)
    t_lo, t_hi = f64_words(float(temperature))
    return k0, k1, l_lo, l_hi, t_lo, t_hi, _LOG2E / float(temperature)


# ----------------------------------------------------------------------------
# kernel launchers


def _launch_from_logits(
    logits: torch.Tensor,
    *,
    packed: bool,
    n_rows: int,
    T: int,
    stride_b: int,
    stride_t: int,
    ids: torch.Tensor,
    old: torch.Tensor,
    row_sample: torch.Tensor | None,
    row_token: torch.Tensor | None,
    lengths: torch.Tensor,
    uids: torch.Tensor,
    seed: int,
    log_lenience: float,
    temperature: float,
    mode: int,
    config: LogitsConfig | None,
):
    device = logits.device
    vocab = logits.shape[-1]
    cfg = config or default_logits_config(vocab, logits.dtype, INTERPRET)
    lp, acc, n, flag = _decision_buffers(n_rows, lengths, device)
    if n_rows == 0:
        return lp, acc, n, flag
    dummy = n  # unused pointer slots must still be tensors
    k0, k1, l_lo, l_hi, t_lo, t_hi, c = _scalar_args(seed, log_lenience, temperature)
    verify_from_logits_kernel[(triton.cdiv(n_rows, cfg.block_r),)](
        logits,
        ids,
        old,
        lp,
        acc,
        n,
        flag,
        row_sample if row_sample is not None else dummy,
        row_token if row_token is not None else dummy,
        lengths,
        uids,
        n_rows,
        vocab,
        T,
        stride_b,
        stride_t,
        k0,
        k1,
        l_lo,
        l_hi,
        t_lo,
        t_hi,
        c,
        PACKED=packed,
        MODE=mode,
        BLOCK_R=cfg.block_r,
        BLOCK_V=cfg.block_v,
        USE_LIBDEVICE=not INTERPRET,
        num_warps=cfg.num_warps,
    )
    return lp, acc, n, flag


def _row_align(elem_size: int, *strides: int) -> int:
    """Largest power of two p <= 16 bytes / elem_size dividing every stride (a tl.multiple_of hint)."""
    p = max(1, 16 // elem_size)
    while p > 1 and any(s % p for s in strides):
        p //= 2
    return p


def _launch_lm_head(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    n_rows: int,
    row_offsets: torch.Tensor | None,
    row_align: int,
    stride_h: int,
    ids: torch.Tensor,
    old: torch.Tensor,
    row_sample: torch.Tensor,
    row_token: torch.Tensor,
    lengths: torch.Tensor,
    uids: torch.Tensor,
    seed: int,
    log_lenience: float,
    temperature: float,
    mode: int,
    config: LMHeadConfig | None,
):
    device = hidden.device
    vocab, d = weight.shape
    tensor_core = hidden.dtype == weight.dtype and hidden.dtype in (torch.bfloat16, torch.float16)
    cfg = config or default_lm_head_config(d, vocab, hidden.dtype if tensor_core else torch.float32, INTERPRET)
    # The Triton 3.x interpreter computes bf16 tl.dot wrongly (it treats the
    # raw bf16 bits as integers); upcasting first is numerically what the
    # tensor cores do (exact bf16 products, fp32 accumulation).
    dot_fp32 = not tensor_core or (INTERPRET and hidden.dtype == torch.bfloat16)
    lp, acc, n, flag = _decision_buffers(n_rows, lengths, device)
    if n_rows == 0:
        return lp, acc, n, flag
    n_vtiles, per_split, n_splits = cfg.splits(vocab)
    part_m = torch.empty(n_splits, n_rows, dtype=torch.float32, device=device)
    part_s = torch.empty(n_splits, n_rows, dtype=torch.float32, device=device)
    tgt = torch.empty(n_rows, dtype=torch.float32, device=device)
    k0, k1, l_lo, l_hi, t_lo, t_hi, c = _scalar_args(seed, log_lenience, temperature)
    grid = (triton.cdiv(n_rows, cfg.block_m) * n_splits,)
    lm_head_partial_kernel[grid](
        hidden,
        weight,
        bias if bias is not None else tgt,
        ids,
        row_offsets if row_offsets is not None else tgt,
        part_m,
        part_s,
        tgt,
        n_rows,
        vocab,
        d,
        stride_h,
        weight.stride(0),
        n_vtiles,
        per_split,
        n_splits,
        c,
        HAS_BIAS=bias is not None,
        HAS_ROW_MAP=row_offsets is not None,
        ROW_ALIGN=row_align,
        EVEN_K=d % cfg.block_k == 0,
        DOT_FP32=dot_fp32,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        FLATTEN=cfg.flatten,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    lm_head_merge_kernel[(triton.cdiv(n_rows, cfg.merge_block),)](
        part_m,
        part_s,
        tgt,
        old,
        lp,
        acc,
        n,
        flag,
        row_sample,
        row_token,
        uids,
        n_rows,
        n_splits,
        k0,
        k1,
        l_lo,
        l_hi,
        t_lo,
        t_hi,
        c,
        MODE=mode,
        BLOCK=cfg.merge_block,
        USE_LIBDEVICE=not INTERPRET,
        num_warps=4,
    )
    return lp, acc, n, flag


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


def _packed_inputs(rows, draft_ids, old_logprobs, row_sample, row_token, lengths, uids):
    draft_ids = _row_vector(draft_ids, rows, "draft_ids")
    old_logprobs = _row_vector(old_logprobs, rows, "old_logprobs")
    if draft_ids.is_floating_point():
        raise TypeError(f"draft_ids must be an integer tensor, got {draft_ids.dtype}")
    if not old_logprobs.is_floating_point():
        raise TypeError(f"old_logprobs must be a float tensor, got {old_logprobs.dtype}")
    row_sample = _row_vector(row_sample, rows, "row_sample").to(torch.int32)
    row_token = _row_vector(row_token, rows, "row_token").to(torch.int32)
    if lengths.dim() != 1 or uids.shape != lengths.shape:
        raise ValueError(f"lengths and uids must both be [B]; got {tuple(lengths.shape)} and {tuple(uids.shape)}")
    return draft_ids, old_logprobs, row_sample, row_token, lengths.contiguous(), uids.to(torch.int64).contiguous()


def _finish_packed(lp, acc, n, flag, source: str, score_only: bool) -> PackedVerifyOutput:
    if int(flag.item()):
        raise _nan_error(source)
    return PackedVerifyOutput(lp, None if score_only else acc.bool(), n.to(torch.int64))


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
            ``spec_rl.verify`` validates ids).
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
        ValueError: NaN (or +inf) in a scored row's logits, or shape errors.
        RuntimeError: the kernels cannot run on the inputs' device.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [N, V], got shape {tuple(logits.shape)}")
    if logits.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"logits must be bfloat16, float16 or float32, got {logits.dtype}")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    rows = logits.shape[0]
    draft_ids, old_logprobs, row_sample, row_token, lengths, uids = _packed_inputs(
        rows, draft_ids, old_logprobs, row_sample, row_token, lengths, uids
    )
    _check_device(logits, draft_ids, old_logprobs, row_sample, row_token, lengths, uids)
    lp, acc, n, flag = _launch_from_logits(
        logits,
        packed=True,
        n_rows=rows,
        T=rows,
        stride_b=0,
        stride_t=logits.stride(0),
        ids=draft_ids,
        old=old_logprobs,
        row_sample=row_sample,
        row_token=row_token,
        lengths=lengths,
        uids=uids,
        seed=seed,
        log_lenience=log_lenience,
        temperature=temperature,
        mode=MODE_SCORE_ONLY if score_only else lenience_mode(log_lenience),
        config=config,
    )
    return _finish_packed(lp, acc, n, flag, "logits", score_only)


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
        ValueError: NaN (or overflow to +inf) in a scored row's logits, or shape errors.
        RuntimeError: the kernels cannot run on the inputs' device.
    """
    if hidden.dim() != 2 or lm_head_weight.dim() != 2 or hidden.shape[-1] != lm_head_weight.shape[1]:
        raise ValueError(
            f"hidden [N, d] and lm_head_weight [V, d] disagree: {tuple(hidden.shape)} vs {tuple(lm_head_weight.shape)}"
        )
    if hidden.dtype not in _FLOAT_DTYPES or lm_head_weight.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"hidden/lm_head_weight must be bf16/fp16/fp32, got {hidden.dtype}/{lm_head_weight.dtype}")
    if lm_head_bias is not None and lm_head_bias.shape != (lm_head_weight.shape[0],):
        raise ValueError(f"lm_head_bias must be [{lm_head_weight.shape[0]}], got {tuple(lm_head_bias.shape)}")
    if hidden.stride(-1) != 1:
        if row_offsets is not None:
            raise ValueError("hidden must have unit stride over d when row_offsets is given")
        hidden = hidden.contiguous()
    if lm_head_weight.stride(1) != 1:
        lm_head_weight = lm_head_weight.contiguous()
    bias = lm_head_bias.contiguous() if lm_head_bias is not None else None
    align = int(row_offsets_multiple_of)
    if align < 1 or align & (align - 1):
        raise ValueError(f"row_offsets_multiple_of must be a power of two >= 1, got {row_offsets_multiple_of!r}")
    rows = draft_ids.shape[0] if row_offsets is not None else hidden.shape[0]
    draft_ids, old_logprobs, row_sample, row_token, lengths, uids = _packed_inputs(
        rows, draft_ids, old_logprobs, row_sample, row_token, lengths, uids
    )
    if row_offsets is not None:
        row_offsets = _row_vector(row_offsets, rows, "row_offsets").to(torch.int64)
    _check_device(hidden, lm_head_weight, bias, draft_ids, old_logprobs, row_sample, row_token, lengths, uids)
    lp, acc, n, flag = _launch_lm_head(
        hidden,
        lm_head_weight,
        bias,
        n_rows=rows,
        row_offsets=row_offsets,
        row_align=min(align, max(1, 16 // hidden.element_size())),
        stride_h=hidden.stride(0),
        ids=draft_ids,
        old=old_logprobs,
        row_sample=row_sample,
        row_token=row_token,
        lengths=lengths,
        uids=uids,
        seed=seed,
        log_lenience=log_lenience,
        temperature=temperature,
        mode=MODE_SCORE_ONLY if score_only else lenience_mode(log_lenience),
        config=config,
    )
    return _finish_packed(lp, acc, n, flag, "logits (hidden_states @ lm_head_weight.T)", score_only)


def _score_only_tags(rows: int, device: torch.device):
    zeros = torch.zeros(rows, dtype=torch.int32, device=device)
    one = torch.zeros(1, dtype=torch.int64, device=device)
    return dict(row_sample=zeros, row_token=zeros, lengths=one, uids=one, seed=0, log_lenience=0.0)


def logprobs_from_logits(
    logits: torch.Tensor, token_ids: torch.Tensor, temperature: float = 1.0, config: LogitsConfig | None = None
) -> torch.Tensor:
    """log softmax(logits / T)[token] for logits [N, V] and ids [N] -> [N] float32 (one read of the logits).

    Raises:
        ValueError: NaN (or +inf) logits.
    """
    rows = logits.shape[0]
    old = torch.zeros(rows, dtype=torch.float32, device=logits.device)
    out = verify_packed_logits(
        logits,
        token_ids,
        old,
        temperature=temperature,
        config=config,
        score_only=True,
        **_score_only_tags(rows, logits.device),
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
    """log softmax((hidden @ W.T + b) / T)[token] for hidden [N, d] -> [N] float32, logits never materialised.

    Raises:
        ValueError: NaN (or overflow) in the logits.
    """
    rows = hidden.shape[0]
    old = torch.zeros(rows, dtype=torch.float32, device=hidden.device)
    out = verify_packed_hidden(
        hidden,
        lm_head_weight,
        token_ids,
        old,
        lm_head_bias=lm_head_bias,
        temperature=temperature,
        config=config,
        score_only=True,
        **_score_only_tags(rows, hidden.device),
    )
    return out.new_logprobs


# ----------------------------------------------------------------------------
# padded API (the reference's signature)


def verify_triton(
    draft_ids: torch.Tensor,
    old_logprobs: torch.Tensor,
    lengths: torch.Tensor,
    *,
    seed: int,
    uids: torch.Tensor,
    log_lenience: float,
    new_logprobs: torch.Tensor | None = None,
    logits: torch.Tensor | None = None,
    hidden_states: torch.Tensor | None = None,
    lm_head_weight: torch.Tensor | None = None,
    lm_head_bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    strategy: str = "spec",
    return_accept_mask: bool = False,
    logits_config: LogitsConfig | None = None,
    lm_head_config: LMHeadConfig | None = None,
) -> VerifyResult:
    """Triton backend with the signature and semantics of :func:`spec_rl.acceptance.reference_verify`.

    Shapes: draft_ids/old_logprobs [B, R]; lengths [B] int; uids [B] int64;
    exactly one of new_logprobs [B, R], logits [B, R, V] (any strides with
    unit vocabulary stride; others are copied), or hidden_states [B, R, d]
    with lm_head_weight [V, d] (+ lm_head_bias [V]). Row i of logits/hidden
    scores draft token i. Inputs are assumed validated by ``spec_rl.verify``
    (shapes, devices, id range, lenience), except NaN in logits / hidden /
    weight, which the kernels detect.

    Sources: logits -> the from-logits kernel (padded rows are never read);
    hidden_states -> the fused LM-head kernel over the valid rows only
    (gathered in-kernel through row offsets, no copy); new_logprobs -> the
    reference's torch code on the inputs' device (no kernel needed).
    strategy="random" scores with the kernels and draws n with the
    reference's ``random_reuse_index`` (identical decisions).

    Returns:
        :class:`spec_rl.acceptance.VerifyResult` (new_logprobs float32 with 0
        at padding, accepted_len int64, full_reuse, optional accept_mask, stats).

    Raises:
        NotImplementedError: top_k != 0 or top_p < 1 with logits/hidden
            sources (the kernels score the plain softmax(logits / T)), or
            float64 (or other non bf16/fp16/fp32) scores: fall back to the
            reference.
        ValueError: NaN (or +inf) in the scored logits; unknown strategy.
        RuntimeError: the kernels cannot run on the inputs' device.
    """
    if strategy not in ("spec", "random"):
        raise ValueError(f"strategy must be 'spec' or 'random', got {strategy!r}")
    if new_logprobs is not None:
        return reference_verify(
            draft_ids,
            old_logprobs,
            lengths,
            seed=seed,
            uids=uids,
            log_lenience=log_lenience,
            new_logprobs=new_logprobs,
            strategy=strategy,
            return_accept_mask=return_accept_mask,
        )
    if top_k != 0 or top_p < 1.0:
        raise NotImplementedError(
            "Triton verification kernels score softmax(logits / T) over the full vocabulary; "
            "top_k/top_p filtering is only in the reference backend"
        )
    if (logits is None) == (hidden_states is None):
        raise ValueError("pass exactly one of new_logprobs, logits, or hidden_states (with lm_head_weight)")
    bsz, max_len = draft_ids.shape
    device = draft_ids.device
    lengths = lengths.to(device=device, dtype=torch.int64).contiguous()
    uids = uids.to(device=device, dtype=torch.int64).contiguous()
    mode = lenience_mode(log_lenience) if strategy == "spec" else MODE_SCORE_ONLY

    if logits is not None:
        if logits.dtype not in _FLOAT_DTYPES:
            raise NotImplementedError(
                f"Triton kernels take bf16/fp16/fp32 logits, got {logits.dtype}; use the reference"
            )
        if logits.stride(-1) != 1:
            logits = logits.contiguous()
        _check_device(logits, draft_ids, old_logprobs, lengths, uids)
        lp, acc, n, flag = _launch_from_logits(
            logits,
            packed=False,
            n_rows=bsz * max_len,
            T=max_len,
            stride_b=logits.stride(0),
            stride_t=logits.stride(1),
            ids=draft_ids.reshape(-1).contiguous(),
            old=old_logprobs.reshape(-1).contiguous(),
            row_sample=None,
            row_token=None,
            lengths=lengths,
            uids=uids,
            seed=seed,
            log_lenience=log_lenience,
            temperature=temperature,
            mode=mode,
            config=logits_config,
        )
        lp_new = lp.view(bsz, max_len)
        accept = acc.view(bsz, max_len).bool()
        source = "logits"
    else:
        if lm_head_weight is None:
            raise ValueError("hidden_states needs lm_head_weight [V, d]")
        if hidden_states.dtype not in _FLOAT_DTYPES or lm_head_weight.dtype not in _FLOAT_DTYPES:
            raise NotImplementedError(
                f"Triton kernels take bf16/fp16/fp32 hidden states and LM head, got {hidden_states.dtype}/"
                f"{lm_head_weight.dtype}; use the reference"
            )
        if hidden_states.stride(-1) != 1:
            hidden_states = hidden_states.contiguous()
        if lm_head_weight.stride(1) != 1:
            lm_head_weight = lm_head_weight.contiguous()
        bias = lm_head_bias.contiguous() if lm_head_bias is not None else None
        _check_device(hidden_states, lm_head_weight, bias, draft_ids, old_logprobs, lengths, uids)
        valid = lengths_mask(lengths, max_len)
        bt = valid.nonzero()
        b_idx, t_idx = bt[:, 0], bt[:, 1]
        s_b, s_t = hidden_states.stride(0), hidden_states.stride(1)
        lp_p, acc_p, n, flag = _launch_lm_head(
            hidden_states,
            lm_head_weight,
            bias,
            n_rows=bt.shape[0],
            row_offsets=(b_idx * s_b + t_idx * s_t).contiguous(),
            row_align=_row_align(hidden_states.element_size(), s_b, s_t),
            stride_h=0,
            ids=draft_ids[b_idx, t_idx].contiguous(),
            old=old_logprobs[b_idx, t_idx].contiguous(),
            row_sample=b_idx.to(torch.int32),
            row_token=t_idx.to(torch.int32),
            lengths=lengths,
            uids=uids,
            seed=seed,
            log_lenience=log_lenience,
            temperature=temperature,
            mode=mode,
            config=lm_head_config,
        )
        lp_new = torch.zeros(bsz, max_len, dtype=torch.float32, device=device)
        lp_new[b_idx, t_idx] = lp_p
        accept = torch.zeros(bsz, max_len, dtype=torch.bool, device=device)
        accept[b_idx, t_idx] = acc_p.bool()
        source = "logits (hidden_states @ lm_head_weight.T)"

    if strategy == "random":
        n = random_reuse_index(seed, uids, lengths)
        accept = lengths_mask(n, max_len)
    else:
        n = n.to(torch.int64)
    full = n == lengths
    # One host transfer for the NaN flag and the stats.
    flag_v, draft_tokens, accepted_tokens, full_count = torch.stack(
        [flag[0].to(torch.int64), lengths.sum(), n.sum(), full.sum()]
    ).tolist()
    if flag_v:
        raise _nan_error(source)
    stats = VerifyStats(
        num_samples=bsz,
        draft_tokens=int(draft_tokens),
        accepted_tokens=int(accepted_tokens),
        full_reuse_count=int(full_count),
    )
    return VerifyResult(
        new_logprobs=lp_new,
        accepted_len=n,
        full_reuse=full,
        accept_mask=accept if return_accept_mask else None,
        stats=stats,
    )


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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """TEMPORARY shim over verify_triton: (new_logprobs [B, R], accept [B, R] bool, accepted_len [B] int64)."""
    res = verify_triton(
        draft_ids, old_logprobs, lengths, seed=seed, uids=uids, log_lenience=log_lenience, logits=logits,
        hidden_states=hidden_states, lm_head_weight=lm_head_weight, lm_head_bias=lm_head_bias,
        temperature=temperature, strategy="random" if score_only else "spec", return_accept_mask=True,
    )
    return res.new_logprobs, res.accept_mask, res.accepted_len
