"""Triton paged decode attention (kernels/paged_attention.py) against a float64 gather + softmax.

Every cache is poisoned first: all slots hold NaN, then only positions
[0, seq_lens[b]) of each sequence's blocks get real K/V. So NaN in blocks no
sequence references, and in the unused tail of a sequence's last block, would
reach the output if the kernel ever read them. Block ids are a random
permutation (non-contiguous, shuffled), and block-table entries past a
sequence's last block are padding (-1 or num_blocks + 7), which the kernel
must never dereference.

Tolerances (|got - ref| <= atol * max|V| + rtol * |ref|, ref = float64 over
the same low-precision inputs, so quantising Q/K/V is not counted):

* fp32 cache: atol 1e-5, rtol 1e-5 (fp32 products and sums; an IEEE fp32
  tl.dot on the dot path).
* bf16: atol = rtol = 2**-8 (= 2 x the bf16 half-ulp 2**-9): the output is
  rounded to bf16 (<= 2**-9 |ref|) and, on the GPU tl.dot path, the
  probabilities are rounded to bf16 before P @ V (<= 2**-9 max|V|).
* fp16: atol = rtol = 2**-10 (2 x the fp16 half-ulp 2**-11), same argument.
"""

from __future__ import annotations

import pytest
import torch
from _kernel_helpers import DEVICE, K, triton  # noqa: F401  first: skips this module when triton is missing

from spec_rl.kernels.configs import (
    PagedAttentionConfig,
    default_paged_attention_config,
    next_pow2,
    plan_splits,
    splits_for,
)
from spec_rl.kernels.paged_attention import paged_decode_attention

TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2**-8, 2**-8), torch.float16: (2**-10, 2**-10)}


def make_case(
    seq_lens,
    q_heads,
    kv_heads,
    head_dim,
    block_size,
    dtype=torch.float32,
    q_dtype=None,
    seed=0,
    spare_blocks=3,
    pad_cols=1,
    q_scale=1.0,
):
    """Poisoned cache with shuffled blocks; returns (query, kv_cache, block_tables, seq_lens)."""
    g = torch.Generator().manual_seed(seed)
    pages = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(pages) + spare_blocks
    kv = torch.full((num_blocks, 2, block_size, kv_heads, head_dim), float("nan"), dtype=torch.float32)
    perm = torch.randperm(num_blocks, generator=g)
    max_blocks = max(pages + [0]) + pad_cols
    bt = torch.empty(len(seq_lens), max_blocks, dtype=torch.int32)
    used = 0
    for b, n in enumerate(seq_lens):
        # padding entries: garbage that is out of range either way
        bt[b] = torch.where(torch.arange(max_blocks) % 2 == 0, -1, num_blocks + 7).int()
        ids = perm[used : used + pages[b]]
        used += pages[b]
        bt[b, : pages[b]] = ids.int()
        for p in range(n):
            kv[ids[p // block_size], :, p % block_size] = torch.randn(2, kv_heads, head_dim, generator=g)
    q = torch.randn(len(seq_lens), q_heads, head_dim, generator=g) * q_scale
    q = q.to(q_dtype or dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return q.to(DEVICE), kv.to(dtype).to(DEVICE), bt.to(DEVICE), lens.to(DEVICE)


def _sequences(query, kv_cache, block_tables, seq_lens):
    """Per sequence (b, q [Hq, D], keys [n, Hq, D], values [n, Hq, D]) in float64 on the CPU; skips seq_len 0."""
    query, kv_cache, block_tables, seq_lens = (t.cpu() for t in (query, kv_cache, block_tables, seq_lens))
    block_size, kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = query.shape[1] // kv_heads
    for b in range(query.shape[0]):
        pos = torch.arange(int(seq_lens[b]))
        if pos.numel() == 0:
            continue
        blocks = block_tables[b].long()[pos // block_size]
        keys = kv_cache[blocks, 0, pos % block_size].double().repeat_interleave(group, dim=1)
        vals = kv_cache[blocks, 1, pos % block_size].double().repeat_interleave(group, dim=1)
        yield b, query[b].double(), keys, vals


def reference64(query, kv_cache, block_tables, seq_lens, scale):
    """float64 gather of each sequence's K/V, then softmax(scale * q K^T) V; zeros for seq_len 0."""
    out = torch.zeros(query.shape, dtype=torch.float64)
    for b, q, keys, vals in _sequences(query, kv_cache, block_tables, seq_lens):
        scores = torch.einsum("hd,nhd->hn", q, keys) * scale
        out[b] = torch.einsum("hn,nhd->hd", torch.softmax(scores, dim=-1), vals)
    return out


def score_rounding(query, kv_cache, block_tables, seq_lens, scale, dtype=torch.float32):
    """Bound on the rounding error of a score in ``dtype``: a few ulps of the largest |score| (the score and its
    product with log2(e) for exp2). A score error d moves the softmax weights by a factor e^{+-d}, the output by
    <= 2 d vmax."""
    worst = 0.0
    for _, q, keys, _ in _sequences(query, kv_cache, block_tables, seq_lens):
        worst = max(worst, float(torch.einsum("hd,nhd->hn", q, keys).abs().max()) * abs(scale))
    return 4 * torch.finfo(dtype).eps * worst


def assert_close(got, ref, kv_cache, dtype, score_err=0.0):
    atol, rtol = TOL[dtype]
    got = got.double().cpu()
    finite = kv_cache[torch.isfinite(kv_cache)]
    vmax = float(finite.abs().max()) if finite.numel() else 1.0
    err = (got - ref).abs()
    bound = (atol + 2 * score_err) * vmax + rtol * ref.abs()
    assert bool(torch.isfinite(got).all()), "non-finite output (poisoned slot read?)"
    assert bool((err <= bound).all()), f"max error {float(err.max()):.3g}, max excess {float((err - bound).max()):.3g}"


BCAST16 = PagedAttentionConfig(block_n=16, use_dot=False)
BCAST8 = PagedAttentionConfig(block_n=8, use_dot=False)
DOT16 = PagedAttentionConfig(block_n=16, use_dot=True)

# (seq_lens, q_heads, kv_heads, head_dim, block_size, cache dtype, query dtype, config;
#  None = default_paged_attention_config)
CASES = [
    # GQA 1, multi-tile (16-token tiles over 16-token blocks), lengths 0 / 1 / exact multiple / ragged
    ([0, 1, 16, 37, 48], 2, 2, 32, 16, torch.float32, None, BCAST16),
    ([0, 1, 16, 37, 48], 2, 2, 32, 16, torch.bfloat16, None, DOT16),
    # GQA 2 (Qwen3), block_size 8, default tiles (one tile straddles several blocks)
    ([1, 8, 23, 40], 4, 2, 64, 8, torch.float32, None, None),
    ([1, 8, 23, 40], 4, 2, 64, 8, torch.bfloat16, None, None),
    # GQA 4: bf16 broadcast path with 8-token tiles inside 16-token blocks; fp32 dot path
    ([5, 32, 33], 4, 1, 32, 16, torch.bfloat16, None, BCAST8),
    ([5, 32, 33], 4, 1, 32, 16, torch.float32, None, DOT16),
    # GQA 2, fp16, block_size 32, both paths
    ([0, 31, 64, 65], 4, 2, 32, 32, torch.float16, None, None),
    ([0, 31, 64, 65], 4, 2, 32, 32, torch.float16, None, BCAST16),
    # non-power-of-two group (3 -> padded) and head_dim (24 -> masked to 32)
    ([7, 19], 6, 2, 24, 8, torch.float32, None, BCAST16),
    ([7, 19], 6, 2, 24, 8, torch.float16, None, DOT16),
    # tiny-model head_dim 8 (broadcast only); fp32 query over a bf16 cache (output fp32)
    ([1, 20], 4, 2, 8, 16, torch.bfloat16, torch.float32, None),
    # head_dim 256
    ([5, 20], 2, 1, 256, 16, torch.float32, None, None),
    ([5, 20], 2, 1, 256, 16, torch.bfloat16, None, None),
    # groups of 8 and 16 (dot path, padded to 16 rows)
    ([3, 40], 8, 1, 32, 16, torch.bfloat16, None, None),
    ([0, 17, 30], 16, 2, 16, 8, torch.float32, None, DOT16),
    ([20], 16, 1, 32, 16, torch.float16, None, None),
]


def _case_id(c) -> str:
    path = "dot" if (c[7] or default_paged_attention_config(c[1] // c[2], c[3], c[5])).use_dot else "bcast"
    return f"lens{c[0]}-G{c[1] // c[2]}-D{c[3]}-bs{c[4]}-{c[5]}-{path}".replace("torch.", "")


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_matches_float64_reference(case):
    lens, hq, kvh, dim, bs, dtype, q_dtype, cfg = case
    q, kv, bt, sl = make_case(lens, hq, kvh, dim, bs, dtype, q_dtype, seed=len(lens) + dim)
    scale = dim**-0.5
    out = paged_decode_attention(q, kv, bt, sl, scale, config=cfg, num_splits=1)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert_close(out, reference64(q, kv, bt, sl, scale), kv, dtype)
    for b, n in enumerate(lens):
        if n == 0:
            assert bool((out[b] == 0).all()), "seq_len 0 must give a zero row"


def test_default_config_rule():
    assert default_paged_attention_config(2, 128, torch.bfloat16) == PagedAttentionConfig(64, 8, True, 2)
    assert default_paged_attention_config(2, 128, torch.float32).use_dot is False
    assert default_paged_attention_config(8, 128, torch.float32).use_dot is True
    assert default_paged_attention_config(2, 8, torch.bfloat16).use_dot is False  # tl.dot needs K >= 16
    for g in (1, 2, 3, 4, 8, 16, 32):
        for d in (8, 16, 24, 32, 64, 128, 256):
            for dt in (torch.float32, torch.bfloat16):
                cfg = default_paged_attention_config(g, d, dt)
                if not cfg.use_dot:  # the broadcast product stays within 8192 fp32 elements (no spills)
                    assert next_pow2(g) * cfg.block_n * next_pow2(max(d, 8)) <= 8192 or cfg.block_n == 8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_k_matches_single_pass(dtype):
    lens = [0, 1, 70, 129, 200]
    q, kv, bt, sl = make_case(lens, 4, 2, 32, 16, dtype, seed=11)
    cfg = PagedAttentionConfig(block_n=16, use_dot=dtype != torch.float32)
    ref = reference64(q, kv, bt, sl, 0.2)
    single = paged_decode_attention(q, kv, bt, sl, 0.2, config=cfg, num_splits=1)
    assert_close(single, ref, kv, dtype)
    for splits in (2, 5, 16):
        out = paged_decode_attention(q, kv, bt, sl, 0.2, config=cfg, num_splits=splits)
        assert_close(out, ref, kv, dtype)
        if dtype == torch.float32:
            # only the merge order differs: a few fp32 ulps
            torch.testing.assert_close(out, single, atol=1e-6, rtol=1e-6)
        # fixed-order merge: bit-identical on a rerun
        again = paged_decode_attention(q, kv, bt, sl, 0.2, config=cfg, num_splits=splits)
        assert torch.equal(out, again)


def test_split_partitions_cover_everything_whatever_max_seq_len():
    """max_seq_len only sizes partitions: an underestimate still attends to every token."""
    q, kv, bt, sl = make_case([150, 9], 2, 1, 32, 16, seed=5)
    ref = reference64(q, kv, bt, sl, 0.3)
    cfg = PagedAttentionConfig(block_n=16)
    out = paged_decode_attention(q, kv, bt, sl, 0.3, config=cfg, num_splits=4, max_seq_len=40)
    assert_close(out, ref, kv, torch.float32)


def test_automatic_split_on_small_batch_long_context():
    # Interpreter's nominal 4 SMs: 1 x 1 programs -> split-K is chosen automatically.
    lens = [600]
    q, kv, bt, sl = make_case(lens, 2, 1, 32, 16, seed=3)
    cfg = default_paged_attention_config(2, 32, torch.float32)
    assert plan_splits(1, 1, 600, cfg.block_n, 4)[0] > 1
    out = paged_decode_attention(q, kv, bt, sl, 32**-0.5, max_seq_len=600)
    assert_close(out, reference64(q, kv, bt, sl, 32**-0.5), kv, torch.float32)
    single = paged_decode_attention(q, kv, bt, sl, 32**-0.5, num_splits=1)
    torch.testing.assert_close(out, single, atol=1e-6, rtol=1e-6)


def test_large_scores_online_softmax_is_stable():
    # scores of several hundred (exp overflows fp32 without the running max); at that size the fp32 rounding of the
    # scores themselves (~1e-4 absolute) dominates the error, so the bound includes it
    q, kv, bt, sl = make_case([45, 3], 4, 2, 32, 8, seed=9, q_scale=60.0)
    ref = reference64(q, kv, bt, sl, 1.0)
    score_err = score_rounding(q, kv, bt, sl, 1.0)
    assert 1e-5 < score_err < 1e-3  # the case is one of large scores, and the bound stays tight
    for splits in (1, 3):
        out = paged_decode_attention(q, kv, bt, sl, 1.0, config=PagedAttentionConfig(16), num_splits=splits)
        assert_close(out, ref, kv, torch.float32, score_err)


def test_strided_query_and_out_buffer():
    q, kv, bt, sl = make_case([13, 30], 4, 2, 32, 16, seed=21)
    big = torch.randn(2, 8, 32, device=DEVICE)
    big[:, ::2] = q  # query is a strided view (head stride 64)
    query = big[:, ::2]
    out_big = torch.full((2, 4, 64), 7.0, device=DEVICE)
    out = out_big[:, :, :32]
    got = paged_decode_attention(query, kv, bt, sl, 0.25, out=out, num_splits=1)
    assert got.data_ptr() == out.data_ptr()
    assert_close(out, reference64(q, kv, bt, sl, 0.25), kv, torch.float32)
    assert bool((out_big[:, :, 32:] == 7.0).all()), "wrote outside out"


def test_empty_batch():
    kv = torch.zeros(2, 2, 16, 1, 32, device=DEVICE)
    q = torch.zeros(0, 2, 32, device=DEVICE)
    bt = torch.zeros(0, 3, dtype=torch.int32, device=DEVICE)
    sl = torch.zeros(0, dtype=torch.int32, device=DEVICE)
    assert paged_decode_attention(q, kv, bt, sl, 1.0).shape == (0, 2, 32)
    # a batch whose block tables have no columns: every sequence is empty
    q1 = torch.randn(2, 2, 32, device=DEVICE)
    out = paged_decode_attention(q1, kv, torch.zeros(2, 0, dtype=torch.int32, device=DEVICE), sl.new_zeros(2), 1.0)
    assert bool((out == 0).all())


def test_plan_splits_rule():
    # enough (sequence, kv head) programs to fill 132 SMs: never split
    assert plan_splits(64, 8, 1024, 64, 132) == (1, 1024)
    # short context: never split
    assert plan_splits(1, 8, 300, 64, 132)[0] == 1
    # small batch, long context: split into partitions of >= 256 tokens, multiples of block_n
    splits, per = plan_splits(2, 8, 8192, 64, 132)
    assert splits > 1 and per % 64 == 0 and per >= 256 and splits * per >= 8192 and (splits - 1) * per < 8192
    assert splits_for(5, 200, 16) == (5, 48)
    assert splits_for(100, 40, 16) == (3, 16)
    assert splits_for(1, 0, 16) == (1, 16)


def test_bad_configs_are_refused():
    with pytest.raises(AssertionError, match="block_n"):
        PagedAttentionConfig(block_n=24)
    with pytest.raises(AssertionError, match="tl.dot"):
        PagedAttentionConfig(block_n=8, use_dot=True)


def test_unused_table_entries_are_not_read():
    # entries past a sequence's last block are padding (-1 / num_blocks + 7 from make_case)
    q, kv, bt, sl = make_case([16, 3], 2, 1, 32, 16, seed=4, pad_cols=3)
    assert bool((bt[:, 1:] < 0).any()) and bool((bt[:, 1:] >= kv.shape[0]).any())
    out = paged_decode_attention(q, kv, bt, sl, 0.2)
    assert_close(out, reference64(q, kv, bt, sl, 0.2), kv, torch.float32)
