"""Paged KV-cache ops (spec_rl.ops, compiled as spec_rl._C from csrc/) against the pure-torch reference.

Every test poisons the cache with NaN first and compares bit patterns, so a
slot written where it should not be, or a slot left unwritten, fails; each
op's result is also checked against an independent per-slot oracle written
here. CUDA variants run when a device is visible (same tests, device="cuda").
"""

from __future__ import annotations

import pytest
import torch

import spec_rl.ops as ops
from spec_rl.ops import torch_kv

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")),
]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Bit pattern view (NaN == NaN, -0.0 != +0.0)."""
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


def _assert_same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype
    diff = (_bits(a) != _bits(b)).nonzero()
    assert diff.numel() == 0, f"{diff.shape[0]} elements differ, first at {diff[0].tolist()}"


def _poisoned(num_blocks, block_size, heads, dim, dtype, device) -> torch.Tensor:
    return torch.full((num_blocks, 2, block_size, heads, dim), float("nan"), dtype=dtype, device=device)


def _rand(gen: torch.Generator, shape, dtype, device) -> torch.Tensor:
    # Distinct values per element, none NaN: any misplaced row shows up.
    return torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype).to(device)


def _written_mask(kv_cache: torch.Tensor) -> torch.Tensor:
    """[num_blocks, block_size] bool: slot holds no NaN in either K or V (was written)."""
    return ~torch.isnan(kv_cache.float()).any(dim=4).any(dim=3).any(dim=1)


def _write_positions(kv_cache, key, value, table, start, ref=False) -> None:
    """K/V [H, n, D] to logical positions start .. start + n - 1 of the sequence with block table ``table``."""
    block_size = kv_cache.shape[2]
    pos = torch.arange(start, start + key.shape[1], device=key.device)
    slots = table.long()[pos // block_size] * block_size + pos % block_size
    (torch_kv if ref else ops).write_kv(kv_cache, key.transpose(0, 1), value.transpose(0, 1), slots)


# --------------------------------------------------------------------------- availability


def test_native_ops_are_built():
    # CI has a C++ compiler: a silent fallback to the reference must fail here.
    assert ops.native_available(), f"spec_rl._C did not load: {ops._native_error}"
    assert ops.native_available("cpu")
    for name in ("write_kv", "copy_blocks", "gather_kv"):
        assert hasattr(torch.ops.spec_rl, name)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_native_cuda_ops_are_built():
    assert ops.native_available("cuda"), "spec_rl._C was built without CUDA kernels on a CUDA machine"


# --------------------------------------------------------------------------- write_kv


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size,head_dim", [(1, 8), (16, 3), (32, 8)])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_write_kv_matches_reference(device, dtype, block_size, head_dim, slot_dtype):
    gen = torch.Generator().manual_seed(block_size * 7 + head_dim)
    num_blocks, heads, tokens = 5, 2, 23
    capacity = num_blocks * block_size
    slots = torch.randperm(capacity, generator=gen)[: min(tokens, capacity)]
    slots = torch.cat([slots, torch.full((tokens - slots.numel(),), -1, dtype=torch.long)])
    slots[::4] = -1  # padding rows
    slots = slots.to(slot_dtype).to(device)
    key = _rand(gen, (tokens, heads, head_dim), dtype, device)
    value = _rand(gen, (tokens, heads, head_dim), dtype, device)

    cache = _poisoned(num_blocks, block_size, heads, head_dim, dtype, device)
    expected = cache.clone()
    ops.write_kv(cache, key, value, slots)
    torch_kv.write_kv(expected, key, value, slots)
    _assert_same_bits(cache, expected)

    # Independent oracle: each kept token is in its slot, every other slot is untouched.
    written = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    for t, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        blk, off = divmod(s, block_size)
        _assert_same_bits(cache[blk, 0, off], key[t])
        _assert_same_bits(cache[blk, 1, off], value[t])
        written[blk, off] = True
    assert torch.equal(_written_mask(cache).cpu(), written)


@pytest.mark.parametrize("device", DEVICES)
def test_write_kv_direct_native_call_and_noncontiguous_inputs(device):
    gen = torch.Generator().manual_seed(1)
    cache = _poisoned(4, 16, 2, 8, torch.float32, device)
    expected = cache.clone()
    key = _rand(gen, (2, 10, 8), torch.float32, device).transpose(0, 1)  # [10, 2, 8], non-contiguous
    value = _rand(gen, (10, 2, 8), torch.float32, device)
    slots = torch.tensor([0, 17, -1, 63, 5, -1, 32, 33, 48, 1], device=device)
    torch.ops.spec_rl.write_kv(cache, key, value, slots)
    torch_kv.write_kv(expected, key, value, slots)
    _assert_same_bits(cache, expected)


@pytest.mark.parametrize("device", DEVICES)
def test_write_kv_all_padding_and_empty(device):
    cache = _poisoned(2, 4, 1, 4, torch.float16, device)
    before = cache.clone()
    key = torch.ones(3, 1, 4, dtype=torch.float16, device=device)
    ops.write_kv(cache, key, key, torch.full((3,), -1, device=device))
    ops.write_kv(cache, key[:0], key[:0], torch.empty(0, dtype=torch.long, device=device))
    torch.ops.spec_rl.write_kv(cache, key[:0], key[:0], torch.empty(0, dtype=torch.long, device=device))
    _assert_same_bits(cache, before)


# --------------------------------------------------------------------------- copy_blocks


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "mapping",
    [
        [[0, 3], [1, 4]],  # disjoint sources and destinations
        [[0, 1], [1, 2], [2, 0]],  # a cycle: every block is both a source and a destination
        [[2, 2], [1, 0], [4, 1]],  # src == dst, and block 1 read then overwritten
        [[3, 0], [3, 1], [3, 2]],  # one source fanned out
    ],
)
def test_copy_blocks_matches_reference(device, dtype, mapping):
    gen = torch.Generator().manual_seed(len(mapping))
    cache = _rand(gen, (5, 2, 16, 2, 3), dtype, device)
    cache[4, :, 5:] = float("nan")  # a partially filled block
    original = cache.clone()
    expected = cache.clone()
    block_mapping = torch.tensor(mapping, device=device)
    ops.copy_blocks(cache, block_mapping)
    torch_kv.copy_blocks(expected, block_mapping)
    _assert_same_bits(cache, expected)
    dsts = {d for _, d in mapping}
    for s, d in mapping:
        _assert_same_bits(cache[d], original[s])  # sources read before any write
    for blk in range(5):
        if blk not in dsts:
            _assert_same_bits(cache[blk], original[blk])


@pytest.mark.parametrize("device", DEVICES)
def test_copy_blocks_empty_mapping(device):
    cache = _poisoned(3, 4, 1, 8, torch.float32, device)
    before = cache.clone()
    ops.copy_blocks(cache, torch.empty(0, 2, dtype=torch.long, device=device))
    torch.ops.spec_rl.copy_blocks(cache, torch.empty(0, 2, dtype=torch.long, device=device))
    _assert_same_bits(cache, before)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_shared_prompt_blocks_copy_on_write(device, dtype):
    """G samples share a prompt's blocks; the last partial block is copied on write before they diverge."""
    gen = torch.Generator().manual_seed(11)
    block_size, heads, dim, prompt_len, group = 16, 2, 8, 20, 3  # prompt: one full block + 4 tokens
    cont_lens = [12, 0, 29]  # sample 1 adds nothing; sample 2 crosses two block boundaries
    cache = _poisoned(12, block_size, heads, dim, dtype, device)

    prompt_k = _rand(gen, (1, heads, prompt_len, dim), dtype, device)
    prompt_v = _rand(gen, (1, heads, prompt_len, dim), dtype, device)
    shared = torch.tensor([[0, 1]], dtype=torch.int32, device=device)
    idx = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731
    _write_positions(cache, prompt_k[0], prompt_v[0], shared[0], 0)
    shared_before = cache[:2].clone()

    # Copy-on-write of the partial block 1 into each sample's own block (2, 3, 4); fresh blocks after.
    tables = torch.tensor([[0, 2, 5, -1], [0, 3, -1, -1], [0, 4, 6, 7]], dtype=torch.int32, device=device)
    ops.copy_blocks(cache, idx([[1, 2], [1, 3], [1, 4]]))
    seq = max(cont_lens)
    cont_k = _rand(gen, (group, heads, seq, dim), dtype, device)
    cont_v = _rand(gen, (group, heads, seq, dim), dtype, device)
    for g, n in enumerate(cont_lens):  # left-padded continuations
        _write_positions(cache, cont_k[g, :, seq - n :], cont_v[g, :, seq - n :], tables[g], prompt_len)

    _assert_same_bits(cache[:2], shared_before)  # the shared blocks are untouched
    lengths = idx([prompt_len + n for n in cont_lens])
    key, value = ops.gather_kv(cache, tables, lengths)
    for g, n in enumerate(cont_lens):
        want_k = torch.cat([prompt_k[0], cont_k[g, :, seq - n :]], dim=1)
        want_v = torch.cat([prompt_v[0], cont_v[g, :, seq - n :]], dim=1)
        _assert_same_bits(key[g, :, : prompt_len + n], want_k)
        _assert_same_bits(value[g, :, : prompt_len + n], want_v)
        assert not key[g, :, prompt_len + n :].any() and not value[g, :, prompt_len + n :].any()
    # Sample 1 wrote nothing past the prompt: its copied block keeps the NaN tail of block 1.
    assert torch.isnan(cache[3, :, prompt_len - block_size :].float()).all()


# --------------------------------------------------------------------------- gather_kv


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_gather_kv_matches_reference(device, dtype, block_size):
    gen = torch.Generator().manual_seed(100 + block_size)
    heads, dim = 2, 8
    lengths = torch.tensor([block_size, 0, 2 * block_size + 3, 5], device=device)
    cols = (int(lengths.max()) + block_size - 1) // block_size
    num_blocks = 4 * cols + 1
    cache = _rand(gen, (num_blocks, 2, block_size, heads, dim), dtype, device)
    tables = torch.randperm(num_blocks, generator=gen)[: 4 * cols].view(4, cols).int().to(device)
    tables[1] = -1  # a zero-length sequence with no blocks
    for max_len in (None, int(lengths.max()) + 7):
        key, value = ops.gather_kv(cache, tables, lengths, max_len)
        ref_k, ref_v = torch_kv.gather_kv(cache, tables, lengths, max_len or int(lengths.max()))
        _assert_same_bits(key, ref_k)
        _assert_same_bits(value, ref_v)
        assert key.dtype == dtype and key.device.type == device
        for b in range(4):
            n = int(lengths[b])
            for p in range(n):
                blk, off = int(tables[b, p // block_size]), p % block_size
                _assert_same_bits(key[b, :, p], cache[blk, 0, off])
                _assert_same_bits(value[b, :, p], cache[blk, 1, off])
            assert (_bits(key[b, :, n:]) == 0).all() and (_bits(value[b, :, n:]) == 0).all()


@pytest.mark.parametrize("device", DEVICES)
def test_gather_kv_empty_batch_and_int64_table(device):
    cache = torch.randn(3, 2, 4, 1, 8, device=device)
    k, v = ops.gather_kv(
        cache, torch.empty(0, 2, dtype=torch.int32, device=device), torch.empty(0, dtype=torch.long, device=device)
    )
    assert k.shape == (0, 1, 0, 8) and v.shape == (0, 1, 0, 8)
    tables = torch.tensor([[2, 0]], device=device)
    k, v = torch.ops.spec_rl.gather_kv(cache, tables, torch.tensor([6], dtype=torch.int32, device=device), 6)
    ref_k, ref_v = torch_kv.gather_kv(cache, tables, torch.tensor([6], device=device), 6)
    _assert_same_bits(k, ref_k)
    _assert_same_bits(v, ref_v)


@pytest.mark.parametrize("device", DEVICES)
def test_ops_split_across_threads(device):
    """Shapes large enough that at::parallel_for splits the work (chunks start mid-sequence)."""
    gen = torch.Generator().manual_seed(5)
    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        block_size, heads, dim = 16, 4, 32  # 512-byte token rows: several 256 KiB tasks per op
        num_blocks = 200
        cache = _poisoned(num_blocks, block_size, heads, dim, torch.float32, device)
        expected = cache.clone()
        tokens = 1500
        slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens].to(device)
        slots[::7] = -1
        key = _rand(gen, (tokens, heads, dim), torch.float32, device)
        value = _rand(gen, (tokens, heads, dim), torch.float32, device)
        ops.write_kv(cache, key, value, slots)
        torch_kv.write_kv(expected, key, value, slots)
        _assert_same_bits(cache, expected)

        lengths = torch.tensor([300, 0, 517, 64, 411], device=device)
        seq = int(lengths.max())
        cols = (seq + block_size - 1) // block_size
        tables = torch.randperm(num_blocks, generator=gen)[: 5 * cols].view(5, cols).int().to(device)
        for b, n in enumerate(lengths.tolist()):
            rows = (
                _rand(gen, (heads, n, dim), torch.float32, device),
                _rand(gen, (heads, n, dim), torch.float32, device),
            )
            _write_positions(cache, *rows, tables[b], 0)
            _write_positions(expected, *rows, tables[b], 0, ref=True)
        _assert_same_bits(cache, expected)

        k, v = ops.gather_kv(cache, tables, lengths, seq + 3)
        ref_k, ref_v = torch_kv.gather_kv(cache, tables, lengths, seq + 3)
        _assert_same_bits(k, ref_k)
        _assert_same_bits(v, ref_v)

        perm = torch.randperm(num_blocks, generator=gen).to(device)
        mapping = torch.stack([perm[:100], perm[50:150]], dim=1)  # half the sources are also destinations
        ops.copy_blocks(cache, mapping)
        torch_kv.copy_blocks(expected, mapping)
        _assert_same_bits(cache, expected)
    finally:
        torch.set_num_threads(threads)


# --------------------------------------------------------------------------- bad arguments (wrappers)


def _valid(device):
    cache = _poisoned(4, 8, 2, 4, torch.float32, device)
    key = torch.zeros(3, 2, 4, device=device)
    slots = torch.tensor([0, 5, -1], device=device)
    tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=device)
    idx = lambda xs: torch.tensor(xs, device=device)  # noqa: E731
    return cache, key, slots, tables, idx


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "case,match",
    [
        ("slot_too_big", r"slot_mapping\[1\] = 32 is >= the cache capacity 32"),
        ("slot_huge", r"slot_mapping\[0\] = 4294967296"),
        ("cache_4d", "kv_cache must have shape"),
        ("cache_int", "kv_cache dtype must be"),
        ("cache_noncontig", "kv_cache must be contiguous"),
        ("cache_block0", "block_size"),
        ("key_dtype", "key dtype"),
        ("value_dims", "value must be 3-D"),
        ("key_shape", r"must both be \[T, 2, 4\]"),
        ("slot_float", "slot_mapping must be int32 or int64"),
    ],
)
def test_native_write_kv_raises_instead_of_writing_out_of_bounds(device, case, match):
    cache, key, slots, _, _ = _valid(device)
    args = [cache, key, key.clone(), slots]
    bad = {
        "slot_too_big": (3, torch.tensor([0, 32, 1], device=device)),
        "slot_huge": (3, torch.tensor([2**32, 0, 1], device=device)),
        "cache_4d": (0, cache[:, 0]),
        "cache_int": (0, cache.int()),
        "cache_noncontig": (0, cache.transpose(3, 4).contiguous().transpose(3, 4)),
        "cache_block0": (0, cache[:, :, :0].contiguous()),
        "key_dtype": (1, key.double()),
        "value_dims": (2, key[0]),
        "key_shape": (1, torch.zeros(3, 2, 5, device=device)),
        "slot_float": (3, slots.float()),
    }[case]
    before = cache.clone()
    args[bad[0]] = bad[1]
    with pytest.raises(RuntimeError, match=match):
        torch.ops.spec_rl.write_kv(*args)
    _assert_same_bits(cache, before)


@pytest.mark.parametrize("device", DEVICES)
def test_native_copy_blocks_and_gather_raise(device):
    cache, _, _, tables, idx = _valid(device)
    before = cache.clone()
    for mapping, match in [
        (idx([[0, 4]]), r"block_mapping\[0, 1\] = 4 is out of range \[0, 4\)"),
        (idx([[-1, 1]]), r"block_mapping\[0, 0\] = -1 is out of range"),
        (idx([[0, 2], [1, 2]]), "lists destination block 2 twice"),
        (idx([[0, 1, 2]]), r"block_mapping must be \[M, 2\]"),
        (idx([0, 1]), "block_mapping must be 2-D"),
    ]:
        with pytest.raises(RuntimeError, match=match):
            torch.ops.spec_rl.copy_blocks(cache, mapping)
    _assert_same_bits(cache, before)
    for args, match in [
        ((tables, idx([3, 17]), 20), "sequence 1 needs 3 blocks"),
        ((tables, idx([3, 1]), 2), r"lengths\[0\] = 3 exceeds max_len = 2"),
        ((tables, idx([-3, 1]), 2), r"lengths\[0\] = -3 must be >= 0"),
        ((tables, idx([3, 1]), -1), "max_len must be >= 0"),
        ((tables, idx([3]), 4), "lengths has 1 entries"),
        (
            (torch.tensor([[0, 7], [1, 2]], dtype=torch.int32, device=device), idx([9, 1]), 9),
            r"block_tables\[0, 1\] = 7 is out of range",
        ),
    ]:
        with pytest.raises(RuntimeError, match=match):
            torch.ops.spec_rl.gather_kv(cache, *args)


# --------------------------------------------------------------------------- schema / fake tensors


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_schemas_and_fake_impls(device):
    """torch.library.opcheck: mutation annotations (Tensor(a!)) and fake implementations are consistent."""
    assert ops.native_available()
    cache, key, slots, tables, idx = _valid(device)
    cache = torch.randn_like(cache)
    checks = ("test_schema", "test_faketensor")
    torch.library.opcheck(torch.ops.spec_rl.write_kv, (cache, key, key.clone(), slots), test_utils=checks)
    torch.library.opcheck(torch.ops.spec_rl.copy_blocks, (cache, idx([[0, 1], [1, 2]])), test_utils=checks)
    torch.library.opcheck(torch.ops.spec_rl.gather_kv, (cache, tables, idx([3, 9]), 12), test_utils=checks)


# --------------------------------------------------------------------------- CUDA graphs


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_write_kv_under_cuda_graph_capture():
    """Captured write_kv replays with new slots; an out-of-range slot is skipped (no host check in a graph)."""
    device = "cuda"
    cache = _poisoned(4, 16, 2, 8, torch.bfloat16, device)
    key = torch.randn(5, 2, 8, device=device).bfloat16()
    value = torch.randn(5, 2, 8, device=device).bfloat16()
    slots = torch.tensor([0, 1, 2, 3, 4], device=device)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        torch.ops.spec_rl.write_kv(cache, key, value, slots)  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.ops.spec_rl.write_kv(cache, key, value, slots)
    cache.fill_(float("nan"))
    slots.copy_(torch.tensor([63, -1, 17, 10_000, 40], device=device))
    graph.replay()
    torch.cuda.synchronize()
    expected = _poisoned(4, 16, 2, 8, torch.bfloat16, device)
    torch_kv.write_kv(expected, key[[0, 2, 4]], value[[0, 2, 4]], torch.tensor([63, 17, 40], device=device))
    _assert_same_bits(cache, expected)


# --------------------------------------------------------------------------- write_kv(max_slot=...)


@pytest.mark.parametrize("device", DEVICES)
def test_write_kv_with_host_known_max_slot(device):
    # The engine passes the max slot it computed on the host (no sync on CUDA): same result.
    gen = torch.Generator().manual_seed(7)
    key, value = _rand(gen, (5, 2, 8), torch.float32, device), _rand(gen, (5, 2, 8), torch.float32, device)
    slots = torch.tensor([3, -1, 17, 0, 9], device=device)
    got, want = _poisoned(4, 8, 2, 8, torch.float32, device), _poisoned(4, 8, 2, 8, torch.float32, device)
    ops.write_kv(got, key, value, slots, max_slot=17)
    torch_kv.write_kv(want, key, value, slots)
    _assert_same_bits(got, want)


@pytest.mark.parametrize("device", DEVICES)
def test_write_kv_with_a_wrong_max_slot_never_writes_out_of_bounds(device):
    # A caller that under-reports max_slot skips the host range check; the native op must
    # still never write outside the cache (CPU: checks anyway and raises; CUDA: the kernel skips it).
    gen = torch.Generator().manual_seed(8)
    big = _poisoned(3, 4, 1, 4, torch.float32, device)
    cache = big[:2]  # a view: block 2 of `big` lies right after the cache in memory
    key = _rand(gen, (2, 1, 4), torch.float32, device)
    slots = torch.tensor([1, 8], device=device)  # 8 == capacity: out of range
    try:
        ops.write_kv(cache, key, key, slots, max_slot=1)
    except RuntimeError as err:
        assert "slot_mapping" in str(err)
    assert torch.isnan(big[2]).all(), "a slot past the cache was written"
