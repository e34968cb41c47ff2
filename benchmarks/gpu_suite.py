"""Stage 3 of the GPU check (docs/gpu-check.md): the verification kernels against their floors and the fused-loss
libraries (Liger-Kernel, Cut Cross-Entropy), at N tokens, vocabulary V, hidden sizes d, bf16, T = 1.

Ours, the floors and eager torch at every shape first, the peers after. "extra MB": peak allocated memory during
one call beyond what was allocated before it. Exit 1 when a row or check of ours fails (log-probs within
``FROM_LOGITS_TOL`` / ``FUSED_TOL`` nats of fp32 torch); a peer's failure is reported only.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import _harness as H  # benchmarks/ is on sys.path when a script here runs
import torch

EAGER_CHUNK = 2048  # rows per chunk of the eager baseline (bounds its fp32 log-softmax memory)
FROM_LOGITS_TOL = 1e-3  # nats: ours vs fp32 eager torch over the same logits
FUSED_TOL = 2e-2  # nats: ours (bf16 tensor-core dot, fp32 accumulate) vs fp32 torch over the same inputs


DTYPE = torch.bfloat16


def parse_args(argv=None):
    device = "default: cuda when visible; cpu = smoke run under the Triton interpreter (tiny shapes)"
    ap = H.arguments(__doc__, "gpu_suite.json", device)
    ap.add_argument("--n", type=int, default=16384, help="tokens (rows)")
    ap.add_argument("--vocab", type=int, default=151936, help="vocabulary size V (Qwen3: 151936)")
    ap.add_argument("--d", type=int, nargs="+", default=[2048, 4096], help="hidden sizes for the fused kernel")
    ap.add_argument("--tokens-per-sample", type=int, default=512)
    ap.add_argument("--rep-ms", type=int, default=150, help="do_bench time budget per measurement (ms)")
    ap.add_argument("--skip-competitors", action="store_true", help="time only our kernels and the floors")
    args = ap.parse_args(argv)
    H.positive(ap, args, "n", "vocab", "d", "tokens_per_sample", "rep_ms")
    return ap, args


@dataclass
class Suite:
    """One run's inputs (packed drafts of N tokens), its JSON record and the tensors kept for the competitors."""

    args: argparse.Namespace
    K: Any  # spec_rl.kernels
    dev: torch.device
    gen: torch.Generator
    ids: torch.Tensor  # [N] int64 draft tokens
    drafts: Any  # spec_rl.kernels.DraftRows of ids: old log-probs, (sample, token) tags, uids, seed, lenience
    rec: H.RunRecord
    hidden: dict = field(default_factory=dict)  # d -> (h [N, d], W [V, d], our row, section tag)

    @property
    def rows(self) -> list:
        return self.rec.record["rows"]

    def measure(self, name: str, fn: Callable[[], Any], **extra) -> dict:
        return H.measure(name, fn, self.rec, rep_ms=self.args.rep_ms, memory=True, device=self.dev, **extra)

    def free(self) -> None:
        if self.dev.type == "cuda":
            torch.cuda.empty_cache()


def build_suite(args, K, dev: torch.device, rec: H.RunRecord) -> Suite:
    """Packed drafts of ``--tokens-per-sample`` tokens per sample, seed 1234, lenience e^0.5."""
    n, vocab = args.n, args.vocab
    gen = torch.Generator(device=dev).manual_seed(0)
    ids = torch.randint(0, vocab, (n,), device=dev, generator=gen)
    old = -torch.rand(n, device=dev, generator=gen) * 5
    tps = max(1, min(args.tokens_per_sample, n))
    cu = torch.arange(0, n + 1, tps, device=dev)
    if int(cu[-1]) != n:
        cu = torch.cat([cu, torch.tensor([n], device=dev)])
    uids = torch.arange(cu.numel() - 1, device=dev, dtype=torch.int64)
    lengths = cu[1:] - cu[:-1]
    sample = torch.repeat_interleave(torch.arange(len(lengths), device=dev), lengths)
    token = torch.arange(n, device=dev) - cu[:-1][sample]
    drafts = K.DraftRows(ids, old, lengths, uids, sample.to(torch.int32), token.to(torch.int32), 1234, 0.5, 1.0, 0)
    return Suite(args, K, dev, gen, ids, drafts, rec)


def _eager_from_logits(logits, ids, temperature=1.0, chunk=EAGER_CHUNK):
    out = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    for s in range(0, logits.shape[0], chunk):
        lp = torch.log_softmax(logits[s : s + chunk].float() / temperature, dim=-1)
        out[s : s + chunk] = lp.gather(1, ids[s : s + chunk].unsqueeze(1)).squeeze(1)
    return out


def _competitors(skip: bool) -> dict:
    """{label: (run(h, w, ids), None) or (None, why it is skipped)}: Liger-Kernel and Cut Cross-Entropy."""
    if skip:
        return {label: (None, "skipped (--skip-competitors)") for label in ("liger", "cce")}
    out = {}
    try:
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

        loss = LigerFusedLinearCrossEntropyLoss(reduction="none")
        out["liger"] = (lambda h, w, ids: loss(w, h, ids)), None
    except Exception as exc:
        out["liger"] = None, f"skipped: liger-kernel not importable ({type(exc).__name__})"
    try:
        from cut_cross_entropy import linear_cross_entropy

        out["cce"] = (lambda h, w, ids: linear_cross_entropy(h, w, ids, reduction="none")), None
    except Exception as exc:
        out["cce"] = None, f"skipped: cut-cross-entropy not importable ({type(exc).__name__})"
    return out


def _has_ms(*recs) -> bool:
    return all(r is not None and "ms" in r for r in recs)


def _rates(s: Suite, section: str, key: str, per_ms: Callable[[dict], float]) -> None:
    for rec in s.rows:
        if rec.get("section", "").startswith(section) and "ms" in rec:
            rec[key] = per_ms(rec)


def section_logits(s: Suite) -> None:
    """From materialised logits: ours vs the copy floor and eager torch."""

    n, vocab, d0, K = s.args.n, s.args.vocab, s.args.d[0], s.K
    h0 = torch.randn(n, d0, device=s.dev, dtype=DTYPE, generator=s.gen)
    w0 = H.random_lm_head(vocab, d0, DTYPE, s.dev, s.gen)
    logits = h0 @ w0.T  # [N, V], realistic logit statistics
    del h0, w0
    logit_bytes = logits.numel() * logits.element_size()
    print(f"\nfrom logits: [{n}, {vocab}] bf16 = {logit_bytes / 1e9:.2f} GB", flush=True)
    tag = dict(section="logits", bytes=logit_bytes)
    dst = torch.empty_like(logits)
    copy = s.measure("copy logits (floor, read+write)", lambda: dst.copy_(logits), **{**tag, "bytes": 2 * logit_bytes})
    dst = None  # free the copy target
    ours = s.measure("ours: from-logits kernel", lambda: K.verify_logits(logits, s.drafts), **tag)
    eager = s.measure("eager torch: chunked log_softmax+gather", lambda: _eager_from_logits(logits, s.ids), **tag)
    if _has_ms(ours):
        lp_k = K.verify_logits(logits, s.drafts)[0]
        diff = (lp_k - _eager_from_logits(logits, s.ids)).abs().max()
        s.rec.check("from_logits_max_abs_diff_vs_eager_fp32", diff, FROM_LOGITS_TOL)
    _rates(s, "logits", "gb_per_s", lambda r: r["bytes"] / r["ms"] / 1e6)
    if _has_ms(copy, ours):
        copy["fraction_of_copy_bandwidth"] = 1.0
        ours["fraction_of_copy_bandwidth"] = ours["gb_per_s"] / copy["gb_per_s"]
    if _has_ms(eager, ours):
        ours["speedup_vs_eager"] = eager["ms"] / ours["ms"]
    s.rec.save()


def section_hidden(s: Suite, d: int, broken: bool = False) -> None:
    """Fused LM head at hidden size d: ours vs the matmul floor and eager torch.

    ``broken``: the weight gets d + 8 columns, a shape the kernel's launcher refuses (the smoke tests'
    deliberately failing shape).
    """

    n, vocab, K = s.args.n, s.args.vocab, s.K
    section = f"hidden-{d}" + ("-broken" if broken else "")
    print(f"\nfused LM head: h [{n}, {d}] @ W[{vocab}, {d}]^T, bf16{' (broken shape)' if broken else ''}", flush=True)
    h = torch.randn(n, d, device=s.dev, dtype=DTYPE, generator=s.gen)
    w = H.random_lm_head(vocab, d + (8 if broken else 0), DTYPE, s.dev, s.gen)
    tag = dict(section=section, flops=2.0 * n * vocab * d)
    out_buf = torch.empty(n, vocab, device=s.dev, dtype=DTYPE)
    mm = s.measure(f"cuBLAS h @ W.T (floor) d={d}", lambda: torch.mm(h, w.T, out=out_buf), **tag)
    out_buf = None  # free the 5 GB matmul output
    s.free()
    ours = s.measure(f"ours: fused LM-head kernel d={d}", lambda: K.verify_hidden(h, w, None, s.drafts), **tag)
    eager = s.measure(
        f"eager torch: matmul + chunked log_softmax d={d}", lambda: _eager_from_logits(h @ w.T, s.ids), **tag
    )
    if _has_ms(ours):
        lp_k = K.verify_hidden(h, w, None, s.drafts)[0]
        w32 = w.float()
        rows = [slice(c, c + EAGER_CHUNK) for c in range(0, n, EAGER_CHUNK)]
        lp_e = torch.cat([_eager_from_logits(h[r].float() @ w32.T, s.ids[r]) for r in rows])
        del w32
        s.rec.check(f"fused_d{d}_max_abs_diff_vs_fp32_torch", (lp_k - lp_e).abs().max(), FUSED_TOL)
    _rates(s, section, "tflops", lambda r: r["flops"] / r["ms"] / 1e9)
    if _has_ms(ours, mm):
        mm["ratio_to_matmul"] = 1.0
        ours["ratio_to_matmul"] = ours["ms"] / mm["ms"]
    if _has_ms(ours, eager):
        ours["speedup_vs_eager"] = eager["ms"] / ours["ms"]
    s.rec.save()
    if not broken:
        s.hidden[d] = (h, w, ours, tag)


def section_competitors(s: Suite, d: int, competitors: dict) -> None:
    """Liger / CCE at hidden size d on the inputs ours was timed on (an unavailable one is a skipped row)."""
    h, w, ours, tag = s.hidden[d]
    for label, (fn, why) in competitors.items():
        if fn is None:
            s.rows.append({"name": f"{label} d={d}", "section": tag["section"], "skipped": why, "optional": True})
            print(H.show(s.rows[-1]), flush=True)
            s.rec.save()
            continue

        def run(fn=fn):
            with torch.no_grad():
                return fn(h, w, s.ids)

        rec = s.measure(f"{label}: fused linear CE (reduction=none) d={d}", run, optional=True, **tag)
        if _has_ms(rec):
            rec["tflops"] = rec["flops"] / rec["ms"] / 1e9
            if _has_ms(ours):
                ours[f"speedup_vs_{label}"] = rec["ms"] / ours["ms"]
        s.rec.save()


def report(rec: dict) -> list[str]:
    """The from-logits and fused LM-head tables (benchmarks/RESULTS.md "GPU check on an H200")."""
    meta, rows, notes = rec["meta"], rec.get("rows", []), ("speedup of ours", H.speedups, "{}")
    logits = [
        ("method", "name", "{}"),
        ("ms", "ms", "{:.3f}"),
        ("GB/s", "gb_per_s", "{:.0f}"),
        ("fraction of copy bandwidth", "fraction_of_copy_bandwidth", "{:.2f}"),
        ("extra MB", "extra_mb", "{:.1f}"),
        notes,
    ]
    hidden = [
        ("d", lambda r: r["section"].split("-")[1], "{}"),
        ("method", "name", "{}"),
        ("ms", "ms", "{:.3f}"),
        ("TFLOP/s", "tflops", "{:.0f}"),
        ("time / matmul", "ratio_to_matmul", "{:.2f}"),
        ("extra MB", "extra_mb", "{:.1f}"),
        notes,
    ]
    body = [f"Shapes: N = {meta.get('n')} tokens, V = {meta.get('vocab')}, {meta.get('dtype')}.", ""]
    body += H.rows_table(logits, [r for r in rows if r.get("section", "").startswith("logits")]) + [""]
    return H.section(
        "Verification kernels (stage 3, gpu_suite.py)",
        rec,
        body + H.rows_table(hidden, [r for r in rows if r.get("section", "").startswith("hidden")], keep=2),
    )


def run_suite(args, K, dev: torch.device, rec: H.RunRecord) -> None:
    """Every section in order: ours and the floors at every shape, then the competitors."""
    suite = build_suite(args, K, dev, rec)
    section_logits(suite)
    suite.free()
    for d in args.d:
        section_hidden(suite, d)
        suite.free()
    if H.broken_shape_requested("gpu_suite"):
        section_hidden(suite, args.d[0], broken=True)
    competitors = _competitors(args.skip_competitors)
    for d in args.d:
        section_competitors(suite, d, competitors)
        suite.free()


def main(argv=None) -> int:
    ap, args = parse_args(argv)
    dev, K = H.kernels_for(ap, args.device, "gpu_suite")
    meta = {**H.provenance(dev), "n": args.n, "vocab": args.vocab, "dtype": "bf16"}
    print(f"gpu_suite on {meta['device']}, torch {meta['torch']}, triton {meta['triton']}, commit {meta['commit']}")
    rec = H.RunRecord(args.json, {"meta": meta, "rows": []}, report)
    H.guarded(rec, "suite stopped", lambda: run_suite(args, K, dev, rec))
    for what in H.failed_rows(rec.record["rows"]):
        rec.fail(what)
    return rec.finish()


if __name__ == "__main__":
    sys.exit(main())
