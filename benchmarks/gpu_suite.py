"""GPU suite: our verification kernels against their floors and the fused-loss libraries.

One command (also run by ``benchmarks/gpu_check.sh``):

    python benchmarks/gpu_suite.py [--n 16384] [--vocab 151936] [--d 2048 4096] [--json PATH] [--sweep]

At N tokens, vocabulary V, hidden sizes d, bf16 (issue #3 targets, H200):

* from logits [N, V]:   ours  vs  device-to-device copy of the logits (floor;
  target: ours reads the logits once at >= 85% of the copy's bandwidth,
  counting the copy's bytes read + written), eager torch (chunked
  log_softmax + gather).
* from hidden [N, d]:   ours (fused LM head)  vs  cuBLAS ``h @ W.T`` alone
  (floor; target <= 1.10x), eager torch (matmul + chunked log_softmax +
  gather), Liger-Kernel fused linear cross-entropy (reduction="none") and
  Cut Cross-Entropy (reduction="none") when importable (target: >= 1.15x
  faster than both, <= 64 MB extra memory).

Times are medians of ``triton.testing.do_bench`` (CUDA events; L2 flushed
between runs). "extra MB" is the peak allocated memory during one call
minus the memory allocated before it (inputs excluded, outputs included;
the matmul floor writes into a preallocated buffer). Our calls include the
decisions and the host sync that reads the NaN flag. Liger/CCE compute
-log p at temperature 1, so every method is timed at T = 1.

Prints a table and writes JSON to --json (default $OUT/gpu_suite.json when
OUT is set). Exits 0 with a message when no CUDA device is present.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import sys
import traceback

import torch
from _provenance import commit  # benchmarks/ is on sys.path when a script here runs


def _bench(fn, rep_ms: int) -> float:
    import triton

    return float(triton.testing.do_bench(fn, warmup=max(10, rep_ms // 4), rep=rep_ms, return_mode="median"))


def _peak_extra_mb(fn) -> float:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    del out
    return (peak - base) / 2**20


def _measure(name: str, fn, rep_ms: int, rows: list, **extra) -> dict | None:
    rec = {"name": name, **extra}
    try:
        fn()  # compile / first-call costs outside the timing
        torch.cuda.synchronize()
        rec["ms"] = _bench(fn, rep_ms)
        rec["extra_mb"] = _peak_extra_mb(fn)
    except Exception as exc:  # a competitor that fails is reported, not fatal
        rec["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        traceback.print_exc(limit=2)
    rows.append(rec)
    status = f"{rec['ms']:.3f} ms, extra {rec['extra_mb']:.1f} MB" if "ms" in rec else rec["error"]
    print(f"  {name:<44} {status}", flush=True)
    return rec


def _eager_from_logits(logits, ids, temperature=1.0, chunk=2048):
    out = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    for s in range(0, logits.shape[0], chunk):
        lp = torch.log_softmax(logits[s : s + chunk].float() / temperature, dim=-1)
        out[s : s + chunk] = lp.gather(1, ids[s : s + chunk].unsqueeze(1)).squeeze(1)
    return out


def _liger_fn():
    try:
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss
    except Exception as exc:
        return None, f"liger-kernel not importable ({type(exc).__name__})"
    loss = LigerFusedLinearCrossEntropyLoss(reduction="none")

    def run(h, w, ids):
        return loss(w, h, ids)

    return run, None


def _cce_fn():
    try:
        from cut_cross_entropy import linear_cross_entropy
    except Exception as exc:
        return None, f"cut-cross-entropy not importable ({type(exc).__name__})"

    def run(h, w, ids):
        return linear_cross_entropy(h, w, ids, reduction="none")

    return run, None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=16384, help="tokens (rows)")
    ap.add_argument("--vocab", type=int, default=151936, help="vocabulary size V (Qwen3: 151936)")
    ap.add_argument("--d", type=int, nargs="+", default=[2048, 4096], help="hidden sizes for the fused kernel")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    ap.add_argument("--tokens-per-sample", type=int, default=512)
    ap.add_argument("--rep-ms", type=int, default=150, help="do_bench time budget per measurement (ms)")
    ap.add_argument("--sweep", action="store_true", help="also time every config of LOGITS_SWEEP / LM_HEAD_SWEEP")
    ap.add_argument("--skip-competitors", action="store_true", help="time only our kernels and the floors")
    default_json = os.path.join(os.environ["OUT"], "gpu_suite.json") if os.environ.get("OUT") else None
    ap.add_argument("--json", default=default_json, help="write results here (default $OUT/gpu_suite.json)")
    args = ap.parse_args(argv)

    if not torch.cuda.is_available():
        print("gpu_suite: no CUDA device available; nothing was measured (run this on a GPU machine).")
        return 0
    os.environ.pop("TRITON_INTERPRET", None)
    import spec_rl.kernels as K
    import triton
    from spec_rl.kernels import configs

    if K.INTERPRET:
        print("gpu_suite: spec_rl.kernels was imported in interpreter mode (TRITON_INTERPRET set); unset it.")
        return 2

    dev = torch.device("cuda")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    props = torch.cuda.get_device_properties(dev)
    meta = {
        "device": props.name,
        "sm_count": props.multi_processor_count,
        "capability": f"{props.major}.{props.minor}",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "commit": commit(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "n": args.n,
        "vocab": args.vocab,
        "dtype": args.dtype,
    }
    print(
        f"gpu_suite on {meta['device']} ({meta['sm_count']} SMs), torch {meta['torch']}, triton {meta['triton']}, "
        f"commit {meta['commit']}",
        flush=True,
    )

    n, vocab = args.n, args.vocab
    gen = torch.Generator(device=dev).manual_seed(0)
    ids = torch.randint(0, vocab, (n,), device=dev, generator=gen)
    old = -torch.rand(n, device=dev, generator=gen) * 5
    tps = max(1, min(args.tokens_per_sample, n))
    cu = torch.arange(0, n + 1, tps, device=dev)
    if int(cu[-1]) != n:
        cu = torch.cat([cu, torch.tensor([n], device=dev)])
    row_sample, row_token, lengths = K.rows_from_cu_seqlens(cu)
    uids = torch.arange(lengths.numel(), device=dev, dtype=torch.int64)
    tags = {
        "row_sample": row_sample,
        "row_token": row_token,
        "lengths": lengths,
        "uids": uids,
        "seed": 1234,
        "log_lenience": 0.5,
    }

    rows: list[dict] = []
    checks: dict = {}
    results = {"meta": meta, "rows": rows, "checks": checks}

    _section_logits(args, K, configs, dev, dtype, gen, ids, old, tags, rows, checks)
    torch.cuda.empty_cache()
    liger, liger_err = (None, "skipped") if args.skip_competitors else _liger_fn()
    cce, cce_err = (None, "skipped") if args.skip_competitors else _cce_fn()
    for d in args.d:
        _section_hidden(
            args,
            K,
            configs,
            d,
            dev,
            dtype,
            gen,
            ids,
            old,
            tags,
            rows,
            checks,
            {"liger": (liger, liger_err), "cce": (cce, cce_err)},
        )
        torch.cuda.empty_cache()

    _print_table(results)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
        print(f"\nwrote {args.json}")
    return 0


def _section_logits(args, K, configs, dev, dtype, gen, ids, old, tags, rows, checks) -> None:
    """From materialised logits: ours vs the copy floor and eager torch."""
    n, vocab, d0 = args.n, args.vocab, args.d[0]
    h0 = torch.randn(n, d0, device=dev, dtype=dtype, generator=gen)
    w0 = (torch.randn(vocab, d0, device=dev, generator=gen) * (2.5 / math.sqrt(d0))).to(dtype)
    logits = h0 @ w0.T  # [N, V], realistic logit statistics
    del h0, w0
    logit_bytes = logits.numel() * logits.element_size()
    print(f"\nfrom logits: [{n}, {vocab}] {args.dtype} = {logit_bytes / 1e9:.2f} GB", flush=True)
    dst = torch.empty_like(logits)
    copy = _measure(
        "copy logits (floor, read+write)",
        lambda: dst.copy_(logits),
        args.rep_ms,
        rows,
        section="logits",
        bytes=2 * logit_bytes,
    )
    dst = None  # free the copy target
    ours = _measure(
        "ours: from-logits kernel",
        lambda: K.verify_packed_logits(logits, ids, old, **tags),
        args.rep_ms,
        rows,
        section="logits",
        bytes=logit_bytes,
    )
    eager = _measure(
        "eager torch: chunked log_softmax+gather",
        lambda: _eager_from_logits(logits, ids),
        args.rep_ms,
        rows,
        section="logits",
        bytes=logit_bytes,
    )
    lp_k = K.verify_packed_logits(logits, ids, old, **tags).new_logprobs
    lp_e = _eager_from_logits(logits, ids)
    checks["from_logits_max_abs_diff_vs_eager_fp32"] = float((lp_k - lp_e).abs().max())
    if args.sweep:
        for cfg in configs.LOGITS_SWEEP:

            def run(cfg=cfg):
                return K.verify_packed_logits(logits, ids, old, config=cfg, **tags)

            _measure(
                f"  sweep from-logits {cfg}",
                run,
                args.rep_ms,
                rows,
                section="logits-sweep",
                bytes=logit_bytes,
                config=str(cfg),
            )
    for rec in rows:
        if rec.get("section") in ("logits", "logits-sweep") and "ms" in rec:
            rec["gb_per_s"] = rec["bytes"] / rec["ms"] / 1e6
    if copy and "ms" in copy and ours and "ms" in ours:
        ours["fraction_of_copy_bandwidth"] = ours["gb_per_s"] / copy["gb_per_s"]
    if eager and "ms" in eager and ours and "ms" in ours:
        ours["speedup_vs_eager"] = eager["ms"] / ours["ms"]


def _section_hidden(args, K, configs, d, dev, dtype, gen, ids, old, tags, rows, checks, competitors) -> None:
    """Fused LM head at hidden size d: ours vs the matmul floor, eager torch, Liger and CCE."""
    n, vocab = args.n, args.vocab
    print(f"\nfused LM head: h [{n}, {d}] @ W[{vocab}, {d}]^T, {args.dtype}", flush=True)
    h = torch.randn(n, d, device=dev, dtype=dtype, generator=gen)
    w = (torch.randn(vocab, d, device=dev, generator=gen) * (2.5 / math.sqrt(d))).to(dtype)
    flops = 2.0 * n * vocab * d
    section = f"hidden-{d}"
    out_buf = torch.empty(n, vocab, device=dev, dtype=dtype)
    mm = _measure(
        f"cuBLAS h @ W.T (floor) d={d}",
        lambda: torch.mm(h, w.T, out=out_buf),
        args.rep_ms,
        rows,
        section=section,
        flops=flops,
    )
    out_buf = None  # free the 5 GB matmul output
    torch.cuda.empty_cache()
    ours = _measure(
        f"ours: fused LM-head kernel d={d}",
        lambda: K.verify_packed_hidden(h, w, ids, old, **tags),
        args.rep_ms,
        rows,
        section=section,
        flops=flops,
    )
    comps = {
        "eager": _measure(
            f"eager torch: matmul + chunked log_softmax d={d}",
            lambda: _eager_from_logits(h @ w.T, ids),
            args.rep_ms,
            rows,
            section=section,
            flops=flops,
        )
    }
    for label, (fn, err) in competitors.items():
        if fn is None:
            rows.append({"name": f"{label} d={d}", "section": section, "error": err})
            print(f"  {label:<44} {err}")
            continue

        def run(fn=fn):
            with torch.no_grad():
                return fn(h, w, ids)

        comps[label] = _measure(
            f"{label}: fused linear CE (reduction=none) d={d}", run, args.rep_ms, rows, section=section, flops=flops
        )
    lp_k = K.verify_packed_hidden(h, w, ids, old, **tags).new_logprobs
    w32 = w.float()
    lp_e = torch.cat(
        [_eager_from_logits(h[s : s + 2048].float() @ w32.T, ids[s : s + 2048]) for s in range(0, n, 2048)]
    )
    del w32
    checks[f"fused_d{d}_max_abs_diff_vs_fp32_torch"] = float((lp_k - lp_e).abs().max())
    if args.sweep:
        for cfg in configs.LM_HEAD_SWEEP:

            def run_cfg(cfg=cfg):
                return K.verify_packed_hidden(h, w, ids, old, config=cfg, **tags)

            _measure(
                f"  sweep fused {cfg}",
                run_cfg,
                args.rep_ms,
                rows,
                section=f"{section}-sweep",
                flops=flops,
                config=str(cfg),
            )
    for rec in rows:
        if rec.get("section", "").startswith(section) and "ms" in rec:
            rec["tflops"] = rec["flops"] / rec["ms"] / 1e9
    if ours and "ms" in ours:
        if mm and "ms" in mm:
            ours["ratio_to_matmul"] = ours["ms"] / mm["ms"]
        for label, rec in comps.items():
            if rec and "ms" in rec:
                ours[f"speedup_vs_{label}"] = rec["ms"] / ours["ms"]


def _print_table(results: dict) -> None:
    meta = results["meta"]
    print(
        f"\n=== spec-rl verification kernels: {meta['device']}, N={meta['n']}, V={meta['vocab']}, {meta['dtype']}, "
        f"commit {meta['commit']}, {meta['date']} ==="
    )
    print(f"{'method':<46} {'ms':>9} {'GB/s|TF/s':>10} {'vs floor':>9} {'extra MB':>9}  speedups / notes")
    floors = {}
    for rec in results["rows"]:
        if "(floor" in rec["name"] and "ms" in rec:
            floors[rec["section"]] = rec
    for rec in results["rows"]:
        if "ms" not in rec:
            print(f"{rec['name']:<46} {'-':>9} {'-':>10} {'-':>9} {'-':>9}  {rec.get('error', '')}")
            continue
        rate = rec.get("gb_per_s", rec.get("tflops", float("nan")))
        floor = floors.get(rec["section"].replace("-sweep", ""))
        if floor is None:
            vs = "-"
        elif rec["section"].startswith("logits"):
            vs = f"{rec['gb_per_s'] / floor['gb_per_s']:.2f}bw"
        else:
            vs = f"{rec['ms'] / floor['ms']:.2f}x"
        notes = ", ".join(
            f"{k.replace('speedup_vs_', '')} {v:.2f}x" for k, v in rec.items() if k.startswith("speedup_vs_")
        )
        print(f"{rec['name']:<46} {rec['ms']:>9.3f} {rate:>10.1f} {vs:>9} {rec['extra_mb']:>9.1f}  {notes}")
    print(
        "vs floor: from-logits = fraction of the copy's bandwidth (target >= 0.85); "
        "fused = time / matmul time (target <= 1.10)"
    )
    for k, v in results["checks"].items():
        print(f"check {k}: {v:.3g}")


if __name__ == "__main__":
    sys.exit(main())
