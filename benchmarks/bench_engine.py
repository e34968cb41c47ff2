"""Stage 5 of the GPU check (docs/gpu-check.md): paged-engine decode throughput, and splicing against re-prefill.

Decode: random prompts, T = 1, EOS suppressed, through each of ``ENGINE_STEPS``, ``TransformersBackend`` and
transformers ``generate``; one ``_harness.wall_time`` run per row after a warm-up, graph captures subtracted.
Splice: the same drafts and seed, after ``PERTURB`` nats of logit noise, through the engine (the scoring pass's K/V
kept) and PolicyScorer + TransformersBackend (prefills again). Exit 1 when a row raises, a graph row ran no graph
step on CUDA or sampled other tokens than the eager step, or the engine prefilled beyond the scoring pass.
"""

from __future__ import annotations

import copy
import sys

import _harness as H  # benchmarks/ on sys.path
import torch
from _harness import RunRecord, wall_time

from spec_rl.acceptance.mode import RolloutMode
from spec_rl.acceptance.rules import Lenient
from spec_rl.backends import fresh_jobs
from spec_rl.backends.paged import DecodeConfig, PagedEngine
from spec_rl.backends.transformers_backend import TransformersBackend
from spec_rl.drafts.cache import RolloutCache
from spec_rl.rollout.speculative import RolloutRequest, SpeculativeRollout
from spec_rl.sampling.distribution import SamplingSettings

PRESETS = {
    # name: (batch, prompt_len, new_tokens)
    "qwen3-0.6b": (64, 256, 512),
    "tiny": (8, 12, 24),
}
#: Std (nats) of the logit noise added through the LM head before the splice section.
PERTURB = 0.5


def build_model(preset: str, device: torch.device):
    """(model, vocab size) for a preset: random weights."""
    if preset == "qwen3-0.6b":
        model = H.random_model(
            151936, device, torch.bfloat16, qwen3=True, tie_word_embeddings=True, eos_token_id=151645
        )
    else:
        model = H.random_model(256, device, torch.float32, max_position_embeddings=512, eos_token_id=1)
    return model, model.config.vocab_size


def _time_generate(name, backend, contexts, new_tokens, settings, device) -> dict:
    """Tokens generated and wall seconds of one ``backend.generate`` over the whole batch."""
    # Warm-up over the full batch with a short budget: allocates the cache and touches its
    # pages (first-touch page faults cost ~1 s on CPU), compiles kernels, captures the CUDA graphs.
    backend.generate(fresh_jobs(contexts, [min(8, new_tokens)] * len(contexts)), settings, seed=0)
    jobs = fresh_jobs(contexts, [new_tokens] * len(contexts))
    stats = getattr(backend, "stats", None)
    before = stats.copy() if hasattr(stats, "graph_steps") else None
    outs, timing = wall_time(lambda: backend.generate(jobs, settings, seed=0), device)
    row = {"name": name, "tokens": sum(len(o.token_ids) for o in outs), "seconds": timing.median}
    if before is not None:  # a capture inside the timed call (a new bucket) is not decode time: taken out
        captured = backend.stats.capture_seconds - before.capture_seconds
        row.update(
            graph_steps=backend.stats.graph_steps - before.graph_steps,
            graph_fallbacks=backend.stats.graph_fallbacks,
            capture_seconds_excluded=captured,
            seconds=timing.median - captured,
        )
        if backend.static is not None and backend.static.capture_error:
            row["capture_error"] = backend.static.capture_error
    row["_outs"] = [o.token_ids for o in outs]
    return row


def _time_hf_generate(model, prompts, new_tokens, device) -> dict:
    """transformers ``generate`` with the same budget (``min_new_tokens`` = ``max_new_tokens``, no top-k/p)."""
    ids = prompts.to(device)
    mask = torch.ones_like(ids)
    kwargs = dict(
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        pad_token_id=0,
    )
    warm = {**kwargs, "max_new_tokens": 4, "min_new_tokens": 4}
    model.generate(input_ids=ids[:2, :8], attention_mask=mask[:2, :8], **warm)
    out, timing = wall_time(lambda: model.generate(input_ids=ids, attention_mask=mask, **kwargs), device)
    return {
        "name": "transformers generate",
        "tokens": int((out.shape[1] - prompts.shape[1]) * prompts.shape[0]),
        "seconds": timing.median,
    }


def _row(name: str, fn, rows: list, rec: RunRecord, show) -> dict:
    """``fn()`` as a row (an exception becomes an ``error`` row and a failure); printed and saved at once."""
    row = {"name": name, **H.guarded(rec, name, fn)}
    rows.append(row)
    print(show(row) if "error" not in row else H.show(row), flush=True)
    rec.save()
    return row


#: The paged engine's decode steps compared: the static-shape step captured per bucket (CUDA's default), the same
#: step run eagerly, and the packed step (the CPU's default; steps with proposals always take it).
ENGINE_STEPS = (
    ("spec-rl PagedEngine, static step + CUDA graphs", DecodeConfig(static=True)),
    ("spec-rl PagedEngine, static step, eager", DecodeConfig(static=True, cuda_graphs=False)),
    ("spec-rl PagedEngine, packed step", DecodeConfig(static=False)),
)


def bench_decode(model, vocab, batch, prompt_len, new_tokens, device, rec: RunRecord) -> list[dict]:
    gen = torch.Generator().manual_seed(1)
    # The EOS of the engine runs is the last id, which no prompt contains: a random model samples it with probability
    # about 1/V per step, so a row may rarely stop early (tokens/s counts the tokens generated).
    prompts = torch.randint(0, vocab - 1, (batch, prompt_len), generator=gen)
    settings = SamplingSettings(temperature=1.0, top_p=1.0, top_k=0, max_tokens=new_tokens)
    eos = [vocab - 1]
    contexts = prompts.tolist()
    rows = []

    def rate(r):
        r["batch"] = batch
        r["tokens_per_s"] = r["tokens"] / r["seconds"]
        r["ms_per_step"] = 1000 * r["seconds"] / new_tokens
        return r

    def show(r):
        return f"  {r['name']:<48} {r['tokens_per_s']:10.1f} tokens/s {r['ms_per_step']:8.2f} ms/step"

    todo = [(name, lambda cfg=cfg: PagedEngine(model, eos, pad_id=0, decode=cfg)) for name, cfg in ENGINE_STEPS]
    todo.append(("spec-rl TransformersBackend (HF KV cache)", lambda: TransformersBackend(model, eos, pad_id=0)))
    for name, make in todo:

        def measure(name=name, make=make):
            return rate(_time_generate(name, make(), contexts, new_tokens, settings, device))

        _row(name, measure, rows, rec, show)
    _row("transformers generate", lambda: rate(_time_hf_generate(model, prompts, new_tokens, device)), rows, rec, show)
    done = [r for r in rows if "error" not in r]
    graph_row = next((r for r in done if r["name"] == ENGINE_STEPS[0][0]), None)
    if graph_row is not None and device.type == "cuda" and not graph_row.get("graph_steps"):
        why = graph_row.get("capture_error", "no capture error recorded")
        rec.fail(f"batch {batch}: the CUDA-graph row ran no graph steps: its timing is the eager step's ({why})")
    outs = {r["name"]: r.pop("_outs") for r in done if "_outs" in r}
    graph, eager = (outs.get(name) for name, _ in ENGINE_STEPS[:2])
    if graph is not None and eager is not None:
        done[0]["tokens_identical_to_eager"] = graph == eager
        if graph != eager:
            rec.fail(f"batch {batch}: the CUDA-graph step sampled other tokens than the eager static step")
    base = next((r for r in done if r["name"] == "transformers generate"), done[-1] if done else None)
    engine = next((r for r in done if r["name"].startswith("spec-rl PagedEngine")), None)
    for r in done:
        if engine is not None:
            r["engine_speedup_vs_this"] = engine["tokens_per_s"] / r["tokens_per_s"]
        r["baseline"] = base["name"]
    rec.record["decode"] += rows
    rec.save()
    return rows


#: The splice comparison's rule: SPEC-RL's (e^0.5) without tail speculation, so only scoring and the continuation
#: from the verified prefix differ between the two paths.
SPLICE_MODE = RolloutMode(Lenient(), tail=0)


def _splice_row(name, backend, seed_cache, requests, settings, eos, max_len, device) -> dict:
    """One speculative rollout step (step 2) from a copy of the seeded cache, timed."""
    cache = copy.deepcopy(seed_cache)
    rollout = SpeculativeRollout(backend, cache, settings, eos, max_len, mode=SPLICE_MODE, seed=0)
    if isinstance(backend, PagedEngine):
        backend.runner.stats = type(backend.stats)()  # counters from here on
    res, timing = wall_time(lambda: rollout.run(requests, step=2), device)
    st = res.stats
    captured = backend.stats.capture_seconds if isinstance(backend, PagedEngine) else 0.0  # graph captures: not timed
    row = {
        "name": name,
        "seconds": timing.median - captured,
        "capture_seconds_excluded": captured,
        "draft_tokens": st.draft_tokens,
        "accepted_tokens": st.accepted_tokens,
        "generated_tokens": st.tokens_generated,
        "reprefill_tokens": st.reprefill_tokens,
        "full_reuse_ratio": st.full_reuse_ratio,
    }
    if isinstance(backend, PagedEngine):
        row["engine_stats"] = backend.stats.to_dict()
    return row


def bench_splice(model, vocab, batch, prompt_len, new_tokens, device, rec: RunRecord) -> list[dict]:
    gen = torch.Generator().manual_seed(2)
    prompts = torch.randint(0, vocab - 1, (batch, prompt_len), generator=gen).tolist()
    settings = SamplingSettings(temperature=1.0, top_p=1.0, top_k=0, max_tokens=new_tokens)
    eos = [vocab - 1]
    max_len = prompt_len + new_tokens + 1
    requests = [RolloutRequest(prompt_ids=p, slot=0) for p in prompts]
    engine = PagedEngine(model, eos, pad_id=0)
    seed_cache = RolloutCache()
    SpeculativeRollout(engine, seed_cache, settings, eos, max_len, mode=SPLICE_MODE, seed=0).run(requests, step=1)
    # Perturb the policy so drafts are cut at varied rejection indices.
    head = model.get_output_embeddings().weight
    saved = head.detach().clone()
    with torch.no_grad():
        # The final norm makes |h| ~ sqrt(d), so N(0, PERTURB^2 / d) weight noise adds ~N(0, PERTURB^2) to each logit.
        noise = torch.randn(head.shape, generator=torch.Generator().manual_seed(3)) * (PERTURB / head.shape[1] ** 0.5)
        head.add_(noise.to(device=head.device, dtype=head.dtype))
    rows = rec.record["splice"]

    def show(r):
        return (
            f"  {r['name']:<48} {r['seconds']:8.2f} s, accepted {r['accepted_tokens']}, "
            f"generated {r['generated_tokens']}, re-prefill tokens {r['reprefill_tokens']}"
        )

    try:
        for name, backend in (
            ("splice: PagedEngine (scoring K/V kept)", engine),
            ("re-prefill: PolicyScorer + TransformersBackend", TransformersBackend(model, eos, pad_id=0)),
        ):
            args = (name, backend, seed_cache, requests, settings, eos, max_len, device)
            _row(name, lambda args=args: _splice_row(*args), rows, rec, show)
    finally:
        with torch.no_grad():
            head.copy_(saved)
    splice = next((r for r in rows if r["name"].startswith("splice") and "error" not in r), None)
    if splice is not None and splice["reprefill_tokens"] != 0:
        rec.fail(f"the splice path prefilled {splice['reprefill_tokens']} tokens beyond the scoring pass (want 0)")
    return rows


def report(rec: dict) -> list[str]:
    """Decode throughput per batch and splice vs re-prefill (benchmarks/RESULTS.md "GPU check on an H200")."""
    decode = [
        ("decode", lambda r: f"b={r.get('batch', rec.get('batch'))} {r['name']}", "{}"),
        ("tokens/s", "tokens_per_s", "{:.0f}"),
        ("ms/step", "ms_per_step", "{:.2f}"),
        ("engine / this", "engine_speedup_vs_this", "{:.2f}x"),
        ("graph steps", "graph_steps", "{}"),
        ("tokens = eager", "tokens_identical_to_eager", "{}"),
    ]
    splice = [
        ("path", "name", "{}"),
        ("rollout s", "seconds", "{:.2f}"),
        ("accepted", "accepted_tokens", "{}"),
        ("generated", "generated_tokens", "{}"),
        ("prefill beyond the scoring pass (tokens)", "reprefill_tokens", "{}"),
    ]
    body = [
        f"Preset {rec.get('preset')}: decode batches {rec.get('decode_batches', [rec.get('batch')])}, prompt "
        f"{rec.get('prompt_len')} tokens, {rec.get('new_tokens')} new tokens (temperature 1); engine = the first "
        "PagedEngine row (the static step in CUDA graphs; graph steps 0: it ran eagerly).",
        "",
    ]
    body += H.rows_table(decode, rec.get("decode", [])) + [""] + H.rows_table(splice, rec.get("splice", []))
    return H.section("Paged engine (stage 5, bench_engine.py)", rec, body)


def main(argv=None) -> int:
    ap = H.arguments(__doc__, "engine.json", "default: cuda if available, else cpu")
    ap.add_argument("--preset", default=None, choices=sorted(PRESETS), help="default: qwen3-0.6b on CUDA, tiny on CPU")
    ap.add_argument("--batch", default=None, help="decode batch sizes, comma-separated (default: the preset's)")
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--skip-splice", action="store_true")
    args = ap.parse_args(argv)
    device = H.device_arg(ap, args.device)
    preset = args.preset or ("qwen3-0.6b" if device.type == "cuda" else "tiny")
    if preset == "qwen3-0.6b" and device.type != "cuda":
        print("bench_engine: no CUDA device; the qwen3-0.6b preset needs one (use --preset tiny on CPU)")
        return 0
    batch, prompt_len, new_tokens = PRESETS[preset]
    batches = H.numbers(ap, "--batch", args.batch) if args.batch is not None else [batch]
    batch = batches[len(batches) // 2]  # the splice section's batch
    H.positive(ap, args, "prompt_len", "new_tokens")
    prompt_len = args.prompt_len or prompt_len
    new_tokens = args.new_tokens or new_tokens
    model, vocab = build_model(preset, device)
    result = {
        **H.provenance(device),
        "preset": preset,
        "batch": batch,
        "decode_batches": batches,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "perturb": PERTURB,
        "decode": [],
        "splice": [],
    }
    print(
        f"bench_engine: preset {preset}, batches {batches}, prompt {prompt_len}, {new_tokens} new tokens, "
        f"device {result['device']}, commit {result['commit'][:12]}",
        flush=True,
    )
    rec = RunRecord(args.json, result, report)
    with torch.no_grad():
        for b in batches:
            bench_decode(model, vocab, b, prompt_len, new_tokens, device, rec)
    if not args.skip_splice:
        H.guarded(rec, "splice section", lambda: bench_splice(model, vocab, batch, prompt_len, new_tokens, device, rec))
    return rec.finish()


if __name__ == "__main__":
    sys.exit(main())
