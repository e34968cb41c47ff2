"""Stage 6 of the GPU check (docs/gpu-check.md), its second part: one decode step with transformers'
concatenating KV cache (``DynamicCache``: ``torch.cat`` of the whole cache per layer per step) against spec-rl's
in-place one (:mod:`spec_rl.backends.kv_buffer`: new columns written into spare ones).

A forward feeding ``--widths`` tokens per row over ``--rows`` rows of ``--context`` cached positions, then the
cache cut back, with both caches holding the same keys and values, timed in turn ``--repeats`` times each (a slow
spell of the machine hits both): the median step of each, their ratio, and a check that both give the same logits.
Presets: ``demo`` (the CPU demo policy's shape, random weights, float32), ``qwen3-0.6b`` (bf16; GPU only), ``tiny``.
"""

from __future__ import annotations

import sys
import time

import _harness as H  # benchmarks/ on sys.path
import torch
from _harness import sync

from spec_rl.backends.hf_decode import cache_argument
from spec_rl.backends.kv_buffer import in_place_cache

# name: (hidden, intermediate, layers, heads, kv heads, head dim, vocab, dtype)
PRESETS = {
    "demo": (128, 512, 2, 4, 4, 32, 510, torch.float32),
    "qwen3-0.6b": (1024, 3072, 28, 16, 8, 128, 151936, torch.bfloat16),
    "tiny": (32, 64, 2, 2, 2, 16, 64, torch.float32),
}


def _model(preset: str, device: torch.device):
    """Random weights of the preset's shape (Qwen3 layers for qwen3-0.6b, Qwen2 otherwise), built on ``device``."""
    hidden, inter, layers, heads, kv_heads, head_dim, vocab, dtype = PRESETS[preset]
    shape = dict(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads)
    model = H.random_model(
        vocab, device, dtype, qwen3=preset == "qwen3-0.6b", num_key_value_heads=kv_heads, head_dim=head_dim, **shape
    )
    model.config._attn_implementation = "sdpa"
    return model


def _concatenating_cache(layers):
    from transformers import DynamicCache

    cache = DynamicCache()
    for i, (k, v) in enumerate(layers):
        cache.update(k.clone(), v.clone(), i)
    return cache


@torch.no_grad()
def measure(preset: str, rows: int, context: int, width: int, repeats: int, device: torch.device) -> dict:
    """Median seconds of one decode step with each cache, their ratio and the largest logit difference."""
    model = _model(preset, device)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, vocab, (rows, context), generator=gen).to(device)
    first = model(input_ids=prompt, use_cache=True, logits_to_keep=1)  # [rows, 1, V]: no [rows, context, V] logits
    layers = [(layer.keys, layer.values) for layer in getattr(first, cache_argument(model), None).layers]
    caches = {"concatenating": _concatenating_cache(layers), "in-place": in_place_cache(layers)}
    ids = torch.randint(0, vocab, (rows, width), generator=gen).to(device)
    mask = torch.ones((rows, context + width), dtype=torch.long, device=device)
    pos = (context + torch.arange(width, device=device)).expand(rows, width)
    times: dict[str, list[float]] = {name: [] for name in caches}
    logits = {}
    for i in range(repeats + 1):  # the first round is a warm-up
        for name, cache in caches.items():
            sync(device)
            t0 = time.perf_counter()
            out = model(
                input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, **{cache_argument(model): cache}
            )
            sync(device)
            if i:
                times[name].append(time.perf_counter() - t0)
            logits[name] = out.logits.float()
            cache.crop(-width)
    med = {name: sorted(t)[len(t) // 2] for name, t in times.items()}
    diff = float((logits["in-place"] - logits["concatenating"]).abs().max())
    return {
        "rows": rows,
        "context": context,
        "width": width,
        "repeats": repeats,
        "concatenating_s": med["concatenating"],
        "in_place_s": med["in-place"],
        "ratio": med["in-place"] / med["concatenating"],
        "max_logit_diff": diff,
    }


def report(rec: dict) -> list[str]:
    """One decode step per width: both caches' median step, their ratio and the largest logit difference."""
    columns = [
        ("fed tokens per row", "width", "{}"),
        ("rows", "rows", "{}"),
        ("context", "context", "{}"),
        ("concatenating ms", lambda r: r["concatenating_s"] * 1e3, "{:.2f}"),
        ("in-place ms", lambda r: r["in_place_s"] * 1e3, "{:.2f}"),
        ("ratio", "ratio", "{:.3f}"),
        ("max logit difference", "max_logit_diff", "{:.1e}"),
    ]
    head = f"Preset {rec.get('preset')}; median of the steps, the two caches timed in turn."
    return H.section(
        "Decode cache (stage 6, bench_decode_cache.py)", rec, [head, ""] + H.rows_table(columns, rec["results"])
    )


def main(argv: list[str] | None = None) -> int:
    ap = H.arguments(__doc__, "decode_cache.json", "default: cuda if available, else cpu")
    ap.add_argument("--preset", choices=list(PRESETS), default="demo")
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--context", type=int, default=150)
    ap.add_argument("--widths", default="1,6", help="comma-separated fed tokens per row")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args(argv)
    widths = H.numbers(ap, "--widths", args.widths)
    H.positive(ap, args, "rows", "context", "repeats")
    device = H.device_arg(ap, args.device)
    if args.preset == "qwen3-0.6b" and device.type != "cuda":
        print("bench_decode_cache: the qwen3-0.6b preset needs a CUDA device")
        return 0
    rec = H.RunRecord(args.json, {"preset": args.preset, "results": [], **H.provenance(device)}, report)
    print(f"bench_decode_cache: preset {args.preset}, device {device}, {args.repeats} steps per cache, timed in turn")
    for width in widths:
        r = measure(args.preset, args.rows, args.context, width, args.repeats, device)
        rec.record["results"].append(r)
        print(f"  width {width}: in-place / concatenating {r['ratio']:.3f}, max |dlogit| {r['max_logit_diff']:.1e}")
        if r["max_logit_diff"] != 0.0:
            rec.fail(f"width {width}: the two caches' logits differ by {r['max_logit_diff']:.1e}")
        rec.save()
    return rec.finish()


if __name__ == "__main__":
    sys.exit(main())
