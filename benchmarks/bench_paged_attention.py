"""Stage 4 of the GPU check (docs/gpu-check.md): Triton paged decode attention against gather + torch SDPA and the
copy floor, at Qwen3-0.6B's attention (16 query heads, 8 kv heads of 128), bf16, blocks of 16 tokens.

Shapes: ``--batch`` x ``--context`` and ``--long-batch`` x ``--long-context`` (where split-K matters), block ids
shuffled. Rows per shape: a copy of exactly the K/V bytes (floor), ours (auto, no split, forced split, with range
checks), gather + SDPA and SDPA alone on dense K/V. Exit 1 when a row, shape or check (every split within
``ACCURACY_TOL`` of fp32 SDPA) fails.
"""

from __future__ import annotations

import sys

import _harness as H  # benchmarks/ is on sys.path when a script here runs
import torch

NOMINAL_SMS = 132  # H100 SXM / H200: the split plan of the CPU smoke run
BLOCK_SIZE, DTYPE = 16, torch.bfloat16
ACCURACY_TOL = 2e-2  # max |ours - fp32 SDPA| over the output (bf16 inputs and output)


def parse_args(argv=None):
    ap = H.arguments(__doc__, "paged_attention.json", "default: cuda; cpu = smoke run under the Triton interpreter")
    ap.add_argument("--batch", type=int, default=64, help="sequences decoding one token each")
    ap.add_argument("--context", type=int, default=1024, help="cached tokens per sequence")
    ap.add_argument("--long-batch", type=int, default=4, help="batch of the long-context row (0: skip it)")
    ap.add_argument("--long-context", type=int, default=8192, help="context of the long-context row")
    ap.add_argument("--q-heads", type=int, default=16, help="query heads (Qwen3-0.6B: 16)")
    ap.add_argument("--kv-heads", type=int, default=8, help="kv heads (Qwen3-0.6B: 8)")
    ap.add_argument("--head-dim", type=int, default=128, help="head size (Qwen3-0.6B: 128)")
    ap.add_argument("--rep-ms", type=int, default=100, help="do_bench time budget per measurement (ms)")
    args = ap.parse_args(argv)
    H.positive(ap, args, "batch", "context", "long_context", "q_heads", "kv_heads", "head_dim", "rep_ms")
    H.positive(ap, args, "long_batch", low=0)
    if args.q_heads % args.kv_heads:
        ap.error("--q-heads must be a multiple of --kv-heads")
    return ap, args


def shapes(args) -> list[dict]:
    """The benchmarked shapes with their K/V byte counts (CPU-only logic)."""
    elt = torch.empty(0, dtype=DTYPE).element_size()
    out = [{"label": f"B={args.batch} ctx={args.context}", "batch": args.batch, "context": args.context}]
    if args.long_batch > 0:
        out.append(
            {
                "label": f"B={args.long_batch} ctx={args.long_context}",
                "batch": args.long_batch,
                "context": args.long_context,
            }
        )
    if H.broken_shape_requested("bench_paged_attention"):
        # q heads not a multiple of kv heads: the argument checks must reject it (smoke tests only).
        out.append({"label": "broken: Hq % Hkv != 0", "batch": 2, "context": 32, "q_heads": 2 * args.kv_heads + 1})
    for s in out:
        s["kv_bytes"] = 2 * s["batch"] * s["context"] * args.kv_heads * args.head_dim * elt
    return out


def plan(args, sm_count: int) -> list[dict]:
    """Default tiles and automatic split choice per shape."""
    from spec_rl.kernels import configs as C

    cfg = C.default_paged_attention_config(args.q_heads // args.kv_heads, args.head_dim, DTYPE)
    rows = []
    for s in shapes(args):
        splits, per = C.plan_splits(s["batch"], args.kv_heads, s["context"], cfg.block_n, sm_count)
        rows.append({**s, "config": str(cfg), "num_splits": splits, "tokens_per_split": per})
    return rows


def _inputs(args, shape, dev, gen):
    batch, context, q_heads = shape["batch"], shape["context"], shape.get("q_heads", args.q_heads)
    pages = -(-context // BLOCK_SIZE)
    num_blocks = batch * pages + 8
    kv = torch.randn(num_blocks, 2, BLOCK_SIZE, args.kv_heads, args.head_dim, device=dev, generator=gen).to(DTYPE)
    perm = torch.randperm(num_blocks, device=dev, generator=gen)[: batch * pages]
    bt = perm.view(batch, pages).to(torch.int32)
    sl = torch.full((batch,), context, dtype=torch.int32, device=dev)
    q = torch.randn(batch, q_heads, args.head_dim, device=dev, generator=gen).to(DTYPE)
    return q, kv, bt, sl


def _gather_dense(kv, bt, context):
    """[num_blocks, 2, bs, H, D] + [B, P] -> dense K, V [B, H, P * bs, D] (first `context` positions)."""
    g = kv[bt.long()]  # [B, P, 2, bs, H, D]
    b, p, _, bs, h, d = g.shape
    k = g[:, :, 0].reshape(b, p * bs, h, d)[:, :context].transpose(1, 2)
    v = g[:, :, 1].reshape(b, p * bs, h, d)[:, :context].transpose(1, 2)
    return k, v


def _sdpa(q, k, v, scale):
    f = torch.nn.functional.scaled_dot_product_attention
    return f(q.unsqueeze(2), k, v, scale=scale, enable_gqa=True).squeeze(2)


def run_shape(args, K, shape, dev, rec: H.RunRecord, sm_count: int) -> None:
    """Every row of one shape (floor, ours, baselines), then its accuracy checks."""
    from spec_rl.kernels import configs as C

    batch, context, kv_bytes = shape["batch"], shape["context"], shape["kv_bytes"]
    section = shape["label"]
    print(
        f"\n{section}: Hq={shape.get('q_heads', args.q_heads)} kv_heads={args.kv_heads} D={args.head_dim} "
        f"bf16, K/V {kv_bytes / 1e6:.1f} MB",
        flush=True,
    )
    gen = torch.Generator(device=dev).manual_seed(0)
    q, kv, bt, sl = _inputs(args, shape, dev, gen)
    scale = args.head_dim**-0.5

    def measure(name, fn, **extra):
        return H.measure(name, fn, rec, rep_ms=args.rep_ms, device=dev, section=section, kv_bytes=kv_bytes, **extra)

    src = torch.empty(kv_bytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    measure("copy K/V bytes (floor, read+write)", lambda: dst.copy_(src), floor=True)
    src = dst = None  # free the floor's buffers before the attention rows

    out = torch.empty_like(q)

    def ours(**kw):
        return lambda: K.paged_decode_attention(q, kv, bt, sl, scale, out=out, **kw)

    cfg = C.default_paged_attention_config(max(1, q.shape[1] // args.kv_heads), args.head_dim, kv.dtype)
    auto_splits, _ = C.plan_splits(batch, args.kv_heads, context, cfg.block_n, sm_count)
    measure(f"ours: paged decode (auto, splits={auto_splits})", ours(max_seq_len=context), ours=True)
    measure("ours: no split", ours(num_splits=1))
    if auto_splits == 1:
        forced = max(2, -(-2 * sm_count // (batch * args.kv_heads)))
        measure(f"ours: split-K (num_splits={forced})", ours(num_splits=forced, max_seq_len=context))
    measure("ours: auto, with range checks (1 host sync)", ours(max_seq_len=context))

    def gather_sdpa():
        return _sdpa(q, *_gather_dense(kv, bt, context), scale)

    measure("gather + SDPA (enable_gqa)", gather_sdpa, baseline="gather_sdpa")
    k_d, v_d = _gather_dense(kv, bt, context)
    k_d, v_d = k_d.contiguous(), v_d.contiguous()
    measure("SDPA alone on dense K/V", lambda: _sdpa(q, k_d, v_d, scale), baseline="sdpa_dense")

    # accuracy of every variant against fp32 SDPA over the same (bf16) inputs
    ref = _sdpa(q.float(), k_d.float(), v_d.float(), scale)
    for ns in (None, 1, 4):
        got = K.paged_decode_attention(q, kv, bt, sl, scale, num_splits=ns, max_seq_len=context)
        rec.check(f"{section} num_splits={ns} max_abs_diff_vs_fp32_sdpa", (got.float() - ref).abs().max(), ACCURACY_TOL)


def finish(rows) -> None:
    """Bandwidths and ratios (pure arithmetic; runs without CUDA on recorded rows)."""
    by_section: dict[str, list] = {}
    for r in rows:
        by_section.setdefault(r["section"], []).append(r)
    for recs in by_section.values():
        floor = next((r for r in recs if r.get("floor") and "ms" in r), None)
        base = {r["baseline"]: r for r in recs if r.get("baseline") and "ms" in r}
        for r in recs:
            if "ms" not in r:
                continue
            factor = 2 if r.get("floor") else 1  # the copy reads and writes
            r["gb_per_s"] = factor * r["kv_bytes"] / r["ms"] / 1e6
            if floor is not None and not r.get("floor"):
                r["fraction_of_copy_bandwidth"] = r["gb_per_s"] / floor["gb_per_s"]
            if not r.get("floor") and not r.get("baseline"):
                for label, b in base.items():
                    r[f"speedup_vs_{label}"] = b["ms"] / r["ms"]


def report(rec: dict) -> list[str]:
    """Paged decode attention per shape: us per call, K/V bandwidth, fraction of the copy's, speedups."""
    meta = rec["meta"]
    columns = [
        ("shape", "section", "{}"),
        ("method", "name", "{}"),
        ("us", lambda r: r.get("ms") and r["ms"] * 1e3, "{:.1f}"),
        ("K/V GB/s", "gb_per_s", "{:.0f}"),
        ("fraction of copy bandwidth", "fraction_of_copy_bandwidth", "{:.2f}"),
        ("speedup of ours", H.speedups, "{}"),
    ]
    head = (
        f"Hq = {meta.get('q_heads')}, kv heads = {meta.get('kv_heads')}, D = {meta.get('head_dim')}, "
        f"block size {BLOCK_SIZE}, bf16."
    )
    body = [head, ""] + H.rows_table(columns, rec.get("rows", []), keep=2)
    return H.section("Paged decode attention (stage 4, bench_paged_attention.py)", rec, body)


def main(argv=None) -> int:
    ap, args = parse_args(argv)
    dev, K = H.kernels_for(ap, args.device, "bench_paged_attention")
    sm_count = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else NOMINAL_SMS
    meta = {
        **H.provenance(dev),
        **{k: getattr(args, k) for k in ("q_heads", "kv_heads", "head_dim")},
        "plan": plan(args, sm_count),
    }
    print(f"bench_paged_attention on {meta['device']} ({sm_count} SMs), commit {meta['commit']}", flush=True)
    rec = H.RunRecord(args.json, {"meta": meta, "rows": []}, report)
    for shape in shapes(args):
        H.guarded(rec, shape["label"], lambda shape=shape: run_shape(args, K, shape, dev, rec, sm_count))
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    finish(rec.record["rows"])
    for what in H.failed_rows(rec.record["rows"]):
        rec.fail(what)
    return rec.finish()


if __name__ == "__main__":
    sys.exit(main())
