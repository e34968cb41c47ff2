"""pytest-benchmark micro-benchmarks of the paged KV-cache ops (spec_rl.ops / spec_rl._C).

    pytest benchmarks/bench_kv_ops.py                         # CPU (and CUDA when visible)
    pytest benchmarks/bench_kv_ops.py --benchmark-json out.json
    python benchmarks/bench_kv_ops.py [pytest args]           # the same, e.g. --help

Three implementations per op: ``native`` (torch.ops.spec_rl.*, the compiled
csrc/ kernels with their own argument checks), ``wrapper`` (spec_rl.ops: the
Python validation, then the native op) and ``reference`` (the pure-torch
semantics in spec_rl.ops.torch_kv). One layer of a Qwen3-0.6B-shaped model:
8 KV heads x head_dim 128, block size 16. Nothing is asserted about speed here;
correctness lives in tests/paged/test_ops_kv.py. Each timed call waits for the device
(``_harness.synced``); benchmarks/conftest.py adds the harness provenance to
the JSON's ``machine_info``.
"""

from __future__ import annotations

import sys

import pytest
import torch

pytest.importorskip("pytest_benchmark")

from _harness import run_pytest_file, synced  # benchmarks/ is on sys.path when a script here runs

import spec_rl.ops as ops
from spec_rl.ops import torch_kv

HEADS, DIM, BLOCK = 8, 128, 16
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
IMPLS = ["native", "wrapper", "reference"]


def _fn(impl: str, name: str):
    if impl == "native":
        if not ops.native_available():
            pytest.skip("spec_rl._C is not built")
        return getattr(torch.ops.spec_rl, name)
    return getattr(ops if impl == "wrapper" else torch_kv, name)


def _timed(benchmark, device, fn, *args):
    benchmark(synced(fn, device), *args)


def _dtype(device):
    return torch.bfloat16 if device == "cuda" else torch.float32


def _cache(num_blocks, device):
    return torch.zeros(num_blocks, 2, BLOCK, HEADS, DIM, dtype=_dtype(device), device=device)


def _batch(device, bsz=16, seq=512, seed=0):
    """bsz sequences of 256..512 tokens, left-padded dense K/V [B, H, S, D], one block table each."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(seq // 2, seq + 1, (bsz,), generator=gen)
    cols = (seq + BLOCK - 1) // BLOCK
    tables = torch.randperm(bsz * cols, generator=gen).view(bsz, cols).int()
    key = torch.randn(bsz, HEADS, seq, DIM, generator=gen).to(_dtype(device))
    value = torch.randn(bsz, HEADS, seq, DIM, generator=gen).to(_dtype(device))
    return (
        _cache(bsz * cols, device),
        key.to(device),
        value.to(device),
        tables.to(device),
        (seq - lengths).to(device),
        lengths.to(device),
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("tokens", [64, 4096], ids=["decode64", "prefill4096"])
def test_write_kv(benchmark, device, impl, tokens):
    fn = _fn(impl, "write_kv")
    gen = torch.Generator().manual_seed(1)
    num_blocks = 2 * tokens // BLOCK + 1
    cache = _cache(num_blocks, device)
    slots = torch.randperm(num_blocks * BLOCK, generator=gen)[:tokens].to(device)
    key = torch.randn(tokens, HEADS, DIM, generator=gen).to(_dtype(device)).to(device)
    value = torch.randn(tokens, HEADS, DIM, generator=gen).to(_dtype(device)).to(device)
    _timed(benchmark, device, fn, cache, key, value, slots)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
def test_splice_from_dense(benchmark, device, impl):
    fn = _fn(impl, "splice_from_dense")
    cache, key, value, tables, src, lengths = _batch(device)
    _timed(benchmark, device, fn, cache, key, value, tables, src, torch.zeros_like(src), lengths)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
def test_gather_kv(benchmark, device, impl):
    fn = _fn(impl, "gather_kv")
    cache, key, value, tables, src, lengths = _batch(device)
    ops.splice_from_dense(cache, key, value, tables, src, torch.zeros_like(src), lengths)
    _timed(benchmark, device, fn, cache, tables, lengths, int(lengths.max()))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
def test_copy_blocks(benchmark, device, impl):
    fn = _fn(impl, "copy_blocks")
    cache = _cache(256, device)
    mapping = torch.stack([torch.arange(0, 64), torch.arange(128, 192)], dim=1).to(device)  # 64 partial blocks
    _timed(benchmark, device, fn, cache, mapping)


if __name__ == "__main__":
    sys.exit(run_pytest_file(__file__))
