"""Shared helpers for the Triton kernel tests (not a test module)."""

from __future__ import annotations

import math
import os

import pytest
import torch
from modes import rule_mode

try:
    import triton
except Exception as exc:  # not installed, or a broken install: skip every kernel test module
    pytest.skip(f"triton is not importable ({type(exc).__name__}: {exc})", allow_module_level=True)

import triton.language as tl

import spec_rl.kernels as K
from spec_rl.acceptance.dispatch import VerifyOptions
from spec_rl.acceptance.reference import lengths_mask, make_result, reference_verify
from spec_rl.acceptance.scores import DraftScores
from spec_rl.kernels._common import as_i32, seed_words
from spec_rl.kernels.philox import philox_uniform_tl, philox_words_tl, u32_from_i32_tl
from spec_rl.sampling.distribution import SamplingSettings
from spec_rl.sampling.philox import philox_uniform

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

if not K.is_available(DEVICE):  # e.g. TRITON_INTERPRET was set to 0 on a CPU-only machine
    pytest.skip(
        f"Triton kernels cannot run on {DEVICE} (TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')!r})",
        allow_module_level=True,
    )

# Accuracy bound asserted for the new log-probs (absolute, nats), against the
# float64 reference computed from the *same* low-precision inputs (so bf16 /
# fp16 quantisation of the logits is not an error of the kernel):
#   from-logits, any input dtype: only the kernel's fp32 normaliser rounds,
#     |err| <= 1e-5 + 1e-6 * |lp|;
#   fused LM head: additionally the fp32-accumulated dot products over d
#     (exact bf16/fp16 products, fp32 sums; fp32 inputs use an IEEE fp32
#     dot): |err| <= 2e-5 + 1e-6 * |lp| for the small d used here.
LOGITS_ATOL = 1e-5
HIDDEN_ATOL = 2e-5
RTOL = 1e-6

# Decisions are compared on inputs whose acceptance margin |log l + lp_new -
# lp_old - log u| is at least this far from the tie (the kernel's log-probs
# differ from the float64 reference by < 1e-4).
TIE_MARGIN = 1e-2


def assert_lp_close(got: torch.Tensor, ref: torch.Tensor, atol: float) -> None:
    got = got.double().cpu()
    ref = ref.double().cpu()
    both_inf = torch.isinf(got) & torch.isinf(ref) & (torch.sign(got) == torch.sign(ref))
    err = torch.where(both_inf, torch.zeros_like(got), (got - ref).abs())
    bound = atol + RTOL * ref.abs().nan_to_num(posinf=0.0, neginf=0.0)
    assert bool((err <= bound).all()), f"max error {err.max().item():.3g} (bound atol={atol})"


def far_from_ties_old_logprobs(
    lp_ref: torch.Tensor,
    lengths: torch.Tensor,
    seed: int,
    uids: torch.Tensor,
    log_lenience: float,
    generator: torch.Generator,
) -> torch.Tensor:
    """Old log-probs whose test outcome is known and at least TIE_MARGIN from the tie.

    For each sample a rejection point k_b is drawn in [0, length]; tokens
    before it get a positive margin, token k_b a negative one, later tokens a
    random sign. Margin = log l + lp_new - lp_old - log u, so lp_old =
    lp_new + log l - log u - margin.
    """
    bsz, max_len = lp_ref.shape
    u = philox_uniform(seed, uids.cpu().unsqueeze(1), torch.arange(max_len).unsqueeze(0)).double()
    k = torch.floor(torch.rand(bsz, generator=generator, dtype=torch.float64) * (lengths.cpu().double() + 1)).long()
    pos = torch.arange(max_len).unsqueeze(0)
    sign = torch.where(torch.rand(bsz, max_len, generator=generator) < 0.5, -1.0, 1.0).double()
    sign = torch.where(pos < k.unsqueeze(1), 1.0, torch.where(pos == k.unsqueeze(1), -1.0, sign))
    mag = TIE_MARGIN + torch.rand(bsz, max_len, generator=generator, dtype=torch.float64) * 2.0
    lp = lp_ref.double().cpu()
    lp = torch.where(torch.isfinite(lp), lp, torch.full_like(lp, -30.0))
    old = lp + log_lenience - torch.log(u) - sign * mag
    return old.float()


def reference64(
    draft_ids,
    old_logprobs,
    lengths,
    *,
    uids,
    seed,
    log_lenience,
    temperature=1.0,
    top_k=0,
    top_p=1.0,
    rule="lenient",
    return_accept_mask=False,
    **sources,
):
    """reference_verify in float64, inputs moved to the CPU; ``sources`` are DraftScores fields. ``log_lenience`` is
    read by the lenient rule only."""
    cpu = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in sources.items()}
    options = VerifyOptions(
        mode=rule_mode(rule, math.exp(log_lenience)),
        sampling=SamplingSettings(temperature=temperature, top_k=top_k, top_p=top_p),
        return_accept_mask=return_accept_mask,
    )
    return reference_verify(
        draft_ids.cpu(),
        old_logprobs.cpu(),
        lengths.cpu(),
        uids.cpu(),
        DraftScores(**cpu),
        seed=seed,
        options=options,
        compute_dtype=torch.float64,
    )


def packed_rows(draft_ids, old_logprobs, lengths, uids, **settings):
    """The valid tokens of padded drafts [B, R] as tagged rows (sample, token index), and their (b, t) positions."""
    valid = lengths_mask(lengths, draft_ids.shape[1])
    b_idx, t_idx = valid.nonzero(as_tuple=True)
    padded = K.DraftRows.padded(draft_ids, old_logprobs, lengths, uids, **settings)
    rows = K.DraftRows(
        draft_ids[b_idx, t_idx].contiguous(),
        old_logprobs[b_idx, t_idx].contiguous(),
        padded.lengths,
        padded.uids,
        b_idx.to(torch.int32),
        t_idx.to(torch.int32),
        padded.seed,
        padded.log_lenience,
        padded.temperature,
        padded.mode,
    )
    return rows, (b_idx, t_idx)


def _packed_verify(draft_ids, old_logprobs, lengths, uids, scores: DraftScores, config, **settings):
    """The padded drafts' valid tokens through the packed launchers under the tile ``config``, unpacked to
    (new_logprobs, accept, accepted_len) as the padded ones return them."""
    rows, (b_idx, t_idx) = packed_rows(draft_ids, old_logprobs, lengths, uids, **settings)
    if scores.logits is not None:
        lp_p, acc_p, n = K.verify_logits(scores.logits[b_idx, t_idx], rows, config)
    else:
        lp_p, acc_p, n = K.verify_hidden(
            scores.hidden_states[b_idx, t_idx], scores.lm_head_weight, scores.lm_head_bias, rows, config=config
        )
    lp = torch.zeros(draft_ids.shape, dtype=torch.float32, device=draft_ids.device)
    lp[b_idx, t_idx] = lp_p
    accept = torch.zeros(draft_ids.shape, dtype=torch.bool, device=draft_ids.device)
    accept[b_idx, t_idx] = acc_p
    return lp, accept, n


def _padded_verify(draft_ids, old_logprobs, lengths, uids, scores: DraftScores, **settings):
    if scores.logits is not None:
        rows = K.DraftRows.padded(draft_ids, old_logprobs, lengths, uids, **settings)
        return K.verify_logits(scores.logits, rows)
    return K.verify_hidden_padded(
        scores.hidden_states,
        scores.lm_head_weight,
        scores.lm_head_bias,
        draft_ids,
        old_logprobs,
        lengths,
        uids,
        **settings,
    )


def kernel_verify(
    draft_ids,
    old_logprobs,
    lengths,
    *,
    uids,
    seed,
    log_lenience,
    temperature=1.0,
    rule="lenient",
    return_accept_mask=False,
    config=None,
    **sources,
):
    """The kernels' verification packed as a VerifyResult the way the verify functions' triton backend does.

    ``sources``: the score source (logits= or hidden_states= with lm_head_weight=/lm_head_bias=). ``config``: a
    tile override (LogitsConfig or LMHeadConfig) for the packed launchers; without it the padded ones run. A rule
    without a kernel switch (random reuse) scores only and decides with its own torch code.
    """
    scores = DraftScores(**sources)
    decider = rule_mode(rule, math.exp(log_lenience)).rule
    score_only = decider.kernel_switch() is None
    settings = dict(seed=seed, log_lenience=log_lenience, temperature=temperature, score_only=score_only)
    if config is None:
        lp, accept, n = _padded_verify(draft_ids, old_logprobs, lengths.to(draft_ids.device), uids, scores, **settings)
    else:
        lp, accept, n = _packed_verify(
            draft_ids, old_logprobs, lengths.to(draft_ids.device), uids, scores, config, **settings
        )
    assert lp.dtype == torch.float32 and accept.dtype == torch.bool and n.dtype == torch.int64
    if score_only:
        assert torch.equal(n.cpu(), lengths.cpu()) and not bool(accept.any())  # score-only contract
        accept, n = decider.decide(lp, old_logprobs, lengths.to(lp.device), seed, uids.to(lp.device))
    return make_result(lp, n, accept, lengths.to(n.device), return_accept_mask)


def assert_same_decisions(out, ref) -> None:
    assert torch.equal(out.accepted_len.cpu(), ref.accepted_len), (out.accepted_len, ref.accepted_len)
    assert torch.equal(out.full_reuse.cpu(), ref.full_reuse)
    if ref.accept_mask is not None:
        assert torch.equal(out.accept_mask.cpu(), ref.accept_mask)
    assert out.stats.to_dict() == ref.stats.to_dict()


# The device Philox on its own (the verify kernels inline philox_uniform_tl): the twins of
# spec_rl.sampling.philox that the Philox tests compare bit for bit.
@triton.jit(do_not_specialize=["k0_w", "k1_w", "stream_w"])
def _philox_uniform_kernel(out_ptr, uids_ptr, tokens_ptr, n, k0_w, k1_w, stream_w, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    uid = tl.load(uids_ptr + offs, mask=ok, other=0)
    tok = tl.load(tokens_ptr + offs, mask=ok, other=0).to(tl.int32)
    k0 = u32_from_i32_tl(k0_w)
    k1 = u32_from_i32_tl(k1_w)
    stream = u32_from_i32_tl(stream_w)
    tl.store(out_ptr + offs, philox_uniform_tl(k0, k1, tok, uid, stream), mask=ok)


@triton.jit
def _philox_words_kernel(out_ptr, in_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # in: [n, 6] (c0..c3, k0, k1) uint32 in int64; out: [n, 4]
    ok = offs < n
    c0 = tl.load(in_ptr + offs * 6 + 0, mask=ok, other=0).to(tl.uint32)
    c1 = tl.load(in_ptr + offs * 6 + 1, mask=ok, other=0).to(tl.uint32)
    c2 = tl.load(in_ptr + offs * 6 + 2, mask=ok, other=0).to(tl.uint32)
    c3 = tl.load(in_ptr + offs * 6 + 3, mask=ok, other=0).to(tl.uint32)
    k0 = tl.load(in_ptr + offs * 6 + 4, mask=ok, other=0).to(tl.uint32)
    k1 = tl.load(in_ptr + offs * 6 + 5, mask=ok, other=0).to(tl.uint32)
    x0, x1, x2, x3 = philox_words_tl(k0, k1, c0, c1, c2, c3)
    tl.store(out_ptr + offs * 4 + 0, x0.to(tl.int64), mask=ok)
    tl.store(out_ptr + offs * 4 + 1, x1.to(tl.int64), mask=ok)
    tl.store(out_ptr + offs * 4 + 2, x2.to(tl.int64), mask=ok)
    tl.store(out_ptr + offs * 4 + 3, x3.to(tl.int64), mask=ok)


def philox_uniform_triton(seed: int, uids: torch.Tensor, token_index: torch.Tensor, stream: int = 0) -> torch.Tensor:
    """Kernel twin of :func:`spec_rl.sampling.philox.philox_uniform`: float32 uniforms of the broadcast shape on
    uids' device. seed: int (mod 2**64); uids: int64; token_index: integer (mod 2**32); stream: 0 accept, 1 reuse."""
    shape = torch.broadcast_shapes(uids.shape, token_index.shape)
    u = uids.to(torch.int64).expand(shape).contiguous().view(-1)
    t = (token_index.to(torch.int64).to(u.device) & 0xFFFFFFFF).expand(shape).contiguous().view(-1)
    t = torch.where(t >= 2**31, t - 2**32, t).to(torch.int32)
    n = u.numel()
    out = torch.empty(n, dtype=torch.float32, device=u.device)
    if n:
        _philox_uniform_kernel[(triton.cdiv(n, 256),)](out, u, t, n, *seed_words(seed), as_i32(int(stream)), BLOCK=256)
    return out.view(shape)


def philox4x32_triton(counter: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """Raw Philox4x32-10 block function: counter [n, 4], key [n, 2] (uint32 values in int64) -> [n, 4] int64."""
    inp = torch.cat([counter.to(torch.int64), key.to(torch.int64)], dim=1).contiguous()
    n = inp.shape[0]
    out = torch.empty(n, 4, dtype=torch.int64, device=inp.device)
    if n:
        _philox_words_kernel[(triton.cdiv(n, 64),)](out, inp, n, BLOCK=64)
    return out


__all__ = [
    "philox4x32_triton",
    "philox_uniform_triton",
    "DEVICE",
    "HIDDEN_ATOL",
    "LOGITS_ATOL",
    "TIE_MARGIN",
    "K",
    "assert_lp_close",
    "assert_same_decisions",
    "far_from_ties_old_logprobs",
    "kernel_verify",
    "packed_rows",
    "lengths_mask",
    "math",
    "reference64",
    "triton",
]
