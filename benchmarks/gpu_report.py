"""summary.md of a GPU check: the stage table and every measured table in benchmarks/RESULTS.md's format.

    python benchmarks/gpu_report.py --work DIR [--out DIR/summary.md]

``benchmarks/gpu_check.sh`` calls this after every stage (and every 30 s while
a stage runs). DIR holds what the stages wrote: ``meta.tsv`` (key, value),
``stages.tsv`` (one line per finished stage: number, name, status, wall seconds,
H200 budget seconds, timeout seconds, note), ``current.tsv`` (the stage running
now, if any), ``json/*.json`` (the benchmarks' records) and ``logs/*.log``.
Tables come from the JSON records as far as they got (a stage cut short still
shows its finished rows); the markdown rows can be pasted into RESULTS.md as
they are. Standard library only: it must run even where the package does not.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def _cell(value, fmt: str = "{}") -> str:
    if value is None:
        return "-"
    if isinstance(value, str):
        return value.replace("|", "\\|").replace("\n", " ")
    if isinstance(value, bool):
        return str(value)
    try:
        return fmt.format(value)
    except (TypeError, ValueError):
        return str(value)


def table(header: list[str], rows: list[list]) -> list[str]:
    """Markdown table lines; cells already formatted or formatted by :func:`_cell`."""
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(c if isinstance(c, str) else _cell(c) for c in row) + " |" for row in rows]
    return out


def _tsv(path: str) -> list[list[str]]:
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [line.rstrip("\n").split("\t") for line in f if line.strip()]


def _json(work: str, name: str) -> dict | None:
    path = os.path.join(work, "json", name)
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _status_line(rec: dict) -> str:
    where = rec.get("meta", rec)
    bits = [
        f"status **{rec.get('status', '?')}**",
        f"device {where.get('device')}",
        f"commit `{where.get('commit')}`",
        f"date {where.get('date')}",
        f"torch {where.get('torch')}",
        f"triton {where.get('triton')}",
    ]
    return ", ".join(bits)


def _checks_and_failures(rec: dict) -> list[str]:
    out = [f"- check `{k}`: {v:.3g}" for k, v in rec.get("checks", {}).items()]
    out += [f"- **FAILED**: {_cell(f)}" for f in rec.get("failures", [])]
    return out


def _result(r: dict, cells: list) -> list:
    """``cells`` for a measured row; the error (or skip reason) in the second column otherwise."""
    if "ms" in r or "error" not in r and "skipped" not in r:
        return cells
    return [cells[0], _cell(r.get("error") or r.get("skipped"))] + ["-"] * (len(cells) - 2)


def _speedups(r: dict) -> str:
    return ", ".join(f"{k[len('speedup_vs_') :]} {v:.2f}x" for k, v in r.items() if k.startswith("speedup_vs_")) or "-"


def section_suite(rec: dict) -> list[str]:
    """Stage 3: the from-logits and fused LM-head tables of RESULTS.md "Verification kernels: GPU results"."""
    meta = rec["meta"]
    out = [
        "## Verification kernels (stage 3, gpu_suite.py)",
        "",
        _status_line(rec),
        "",
        f"Shapes: N = {meta.get('n')} tokens, V = {meta.get('vocab')}, {meta.get('dtype')}.",
        "",
    ]
    rows = rec.get("rows", [])
    logits = [r for r in rows if r.get("section", "").startswith("logits")]
    out += table(
        ["method", "ms", "GB/s", "fraction of copy bandwidth", "extra MB", "speedup of ours"],
        [
            _result(
                r,
                [
                    r["name"],
                    _cell(r.get("ms"), "{:.3f}"),
                    _cell(r.get("gb_per_s"), "{:.0f}"),
                    _cell(r.get("fraction_of_copy_bandwidth"), "{:.2f}"),
                    _cell(r.get("extra_mb"), "{:.1f}"),
                    _speedups(r),
                ],
            )
            for r in logits
        ],
    )
    out.append("")
    hidden = [r for r in rows if r.get("section", "").startswith("hidden")]
    out += table(
        ["d", "method", "ms", "TFLOP/s", "time / matmul", "extra MB", "speedup of ours"],
        [
            [r["section"].split("-")[1]]
            + _result(
                r,
                [
                    r["name"],
                    _cell(r.get("ms"), "{:.3f}"),
                    _cell(r.get("tflops"), "{:.0f}"),
                    _cell(r.get("ratio_to_matmul"), "{:.2f}"),
                    _cell(r.get("extra_mb"), "{:.1f}"),
                    _speedups(r),
                ],
            )
            for r in hidden
        ],
    )
    return out + [""] + _checks_and_failures(rec)


def section_paged(rec: dict) -> list[str]:
    """Stage 4: paged decode attention per shape (K/V bandwidth, fraction of the copy's, speedups)."""
    meta = rec["meta"]
    out = [
        "## Paged decode attention (stage 4, bench_paged_attention.py)",
        "",
        _status_line(rec),
        "",
        f"Hq = {meta.get('q_heads')}, kv heads = {meta.get('kv_heads')}, D = {meta.get('head_dim')}, "
        f"block size {meta.get('block_size')}, {meta.get('dtype')}.",
        "",
    ]
    rows = [
        [r.get("section")]
        + _result(
            r,
            [
                r["name"],
                _cell(r.get("ms") and r["ms"] * 1e3, "{:.1f}"),
                _cell(r.get("gb_per_s"), "{:.0f}"),
                _cell(r.get("fraction_of_copy_bandwidth"), "{:.2f}"),
                _speedups(r),
            ],
        )
        for r in rec.get("rows", [])
    ]
    out += table(["shape", "method", "us", "K/V GB/s", "fraction of copy bandwidth", "speedup of ours"], rows)
    return out + [""] + _checks_and_failures(rec)


def section_engine(rec: dict) -> list[str]:
    """Stage 5: decode throughput and splice vs re-prefill (RESULTS.md "Paged KV cache and engine")."""
    out = [
        "## Paged engine (stage 5, bench_engine.py)",
        "",
        _status_line(rec),
        "",
        f"Preset {rec.get('preset')}: decode batches {rec.get('decode_batches', [rec.get('batch')])}, prompt "
        f"{rec.get('prompt_len')} tokens, {rec.get('new_tokens')} new tokens (temperature 1); engine = the first "
        "PagedEngine row (the static step in CUDA graphs; graph steps 0: it ran eagerly).",
        "",
    ]
    decode = [
        _result(
            r,
            [
                f"b={r.get('batch', rec.get('batch'))} {r['name']}",
                _cell(r.get("tokens_per_s"), "{:.0f}"),
                _cell(r.get("ms_per_step"), "{:.2f}"),
                _cell(r.get("engine_speedup_vs_this"), "{:.2f}x"),
                _cell(r.get("graph_steps")),
                _cell(r.get("tokens_identical_to_eager")),
            ],
        )
        for r in rec.get("decode", [])
    ]
    heads = ["decode", "tokens/s", "ms/step", "engine / this", "graph steps", "tokens = eager"]
    out += table(heads, decode) + [""]
    splice = [
        _result(
            r,
            [
                r["name"],
                _cell(r.get("seconds"), "{:.2f}"),
                _cell(r.get("accepted_tokens")),
                _cell(r.get("generated_tokens")),
                _cell(r.get("reprefill_tokens")),
            ],
        )
        for r in rec.get("splice", [])
    ]
    out += table(["path", "rollout s", "accepted", "generated", "prefill beyond the scoring pass (tokens)"], splice)
    return out + [""] + _checks_and_failures(rec)


def section_rollout(rec: dict) -> list[str]:
    """Stage 6: one rollout step per mode at fixed drafts (RESULTS.md's bench_rollout table)."""
    out = [
        "## Rollout (stage 6, bench_rollout.py)",
        "",
        _status_line(rec),
        "",
        f"Preset {rec.get('preset')}: {rec.get('prompts')} prompts x G={rec.get('group')}, "
        f"{rec.get('max_tokens')} tokens, {rec.get('backend')}, perturb {rec.get('perturb')}, "
        f"{rec.get('history_epochs')} history epochs.",
        "",
    ]
    rows = []
    for name, r in rec.get("rows", {}).items():
        r = {"name": name, **r}
        rows.append(
            _result(
                r,
                [
                    name,
                    _cell(r.get("generated_tokens")),
                    _cell(r.get("decode_steps")),
                    _cell(r.get("rollout_s"), "{:.3f}"),
                    _cell(r.get("scoring_s"), "{:.3f}"),
                    _cell(r.get("decode_s"), "{:.3f}"),
                    _cell(r.get("generated_tokens_ratio"), "{:.3f}"),
                    _cell(r.get("decode_steps_ratio"), "{:.3f}"),
                    _cell(r.get("rollout_s_ratio"), "{:.3f}"),
                    _cell(r.get("tail_accept"), "{:.2f}"),
                ],
            )
        )
    out += table(
        [
            "mode",
            "generated tokens",
            "decode steps",
            "rollout s",
            "scoring s",
            "decode s",
            "tokens x",
            "steps x",
            "time x",
            "tail acceptance",
        ],
        rows,
    )
    return out + [""] + _checks_and_failures(rec)


def section_decode_cache(rec: dict) -> list[str]:
    """Stage 6, second part: one decode step with transformers' concatenating KV cache vs spec-rl's in-place one."""
    out = [
        "## Decode cache (stage 6, bench_decode_cache.py)",
        "",
        f"Preset {rec.get('preset')}, {rec.get('device')}, commit `{rec.get('commit')}`; median of the steps, "
        "the two caches timed in turn.",
        "",
    ]
    rows = [
        [
            _cell(r.get("width")),
            _cell(r.get("rows")),
            _cell(r.get("context")),
            _cell(r.get("concatenating_s") and r["concatenating_s"] * 1e3, "{:.2f}"),
            _cell(r.get("in_place_s") and r["in_place_s"] * 1e3, "{:.2f}"),
            _cell(r.get("ratio"), "{:.3f}"),
            _cell(r.get("max_logit_diff"), "{:.1e}"),
        ]
        for r in rec.get("results", [])
    ]
    return out + table(
        ["fed tokens per row", "rows", "context", "concatenating ms", "in-place ms", "ratio", "max logit difference"],
        rows,
    )


def section_real_model(rec: dict) -> list[str]:
    """Stage 8: bench_real_model on the given checkpoint (epochs 2+, ratios to vanilla on the same engine)."""
    args = rec.get("args", {})
    out = [
        "## Real-model rollouts (stage 8, bench_real_model.py)",
        "",
        f"Model {rec.get('model')} ({rec.get('dtype')}), {args.get('prompts')} prompts x G={args.get('group')}, "
        f"{args.get('max_tokens')} tokens, {args.get('epochs')} epochs, lr {args.get('lr')}, paged engine rows "
        f"{args.get('max_batch')}; engine starts (s): "
        + ", ".join(
            f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}"
            for k, v in rec.get("engine_start_seconds", {}).items()
        ),
        "",
    ]
    rows = [
        [
            s.get("engine"),
            s.get("row"),
            _cell(s.get("generated_tokens_ratio"), "{:.3f}"),
            _cell(s.get("decode_steps_ratio"), "{:.3f}"),
            _cell(s.get("rollout_seconds_ratio"), "{:.3f}"),
            _cell(s.get("full_step_seconds_ratio"), "{:.3f}"),
            _cell(s.get("accepted_share") and 100 * s["accepted_share"], "{:.1f}"),
            _cell(s.get("over_no_waste_bound"), "{:.3f}"),
            _cell((s.get("nll") or [None])[0], "{:.3f}"),
        ]
        for s in rec.get("summary", [])
    ]
    heads = ["engine", "row", "tokens x", "steps x", "time x", "full step x", "accepted %", "over bound", "NLL"]
    out += table(heads, rows)
    targets = rec.get("targets", {})
    return out + ([""] + [f"- {k}: {v:.3f}" for k, v in targets.items()] if targets else [])


def section_compile(rec: dict) -> list[str]:
    """Stage 7: registers / spills / shared memory per kernel from ptxas."""
    prov = rec.get("provenance", {})
    out = [
        "## Compile check (stage 7, compile_check.py)",
        "",
        f"sm_{rec.get('arch')}, triton {prov.get('triton')} (its own ptxas), commit `{prov.get('commit')}`.",
        "",
    ]
    rows = [
        [
            r["kernel"],
            "FAIL" if r.get("error") or r.get("ptxas_rc") else "ok",
            _cell(r.get("registers")),
            _cell(r.get("spill_stores")),
            _cell(r.get("spill_loads")),
            _cell(r.get("shared")),
            _cell(r.get("uses_wgmma")),
            _cell(r.get("vector_loads")),
        ]
        for r in rec.get("results", [])
    ]
    return out + table(
        ["kernel", "status", "registers", "spill stores", "spill loads", "shared bytes", "wgmma", "v4 loads"], rows
    )


def section_env(rec: dict) -> list[str]:
    """Stage 1: versions, device, native ops, kernels, optional packages (benchmarks/gpu_env.py)."""
    out = ["## Environment (stage 1, gpu_env.py)", ""]
    out += [f"- {k}: {_cell(v)}" for k, v in rec.items() if k != "problems"]
    return out + [f"- **PROBLEM**: {_cell(p)}" for p in rec.get("problems", [])]


SECTIONS = [
    ("env.json", section_env),
    ("gpu_suite.json", section_suite),
    ("paged_attention.json", section_paged),
    ("engine.json", section_engine),
    ("rollout.json", section_rollout),
    ("decode_cache.json", section_decode_cache),
    ("compile_check.json", section_compile),
    ("real_model_rollout-continuous.json", section_real_model),
    ("real_model_rollout-full-batch.json", section_real_model),
]


def stage_table(work: str) -> list[str]:
    """The stage table: status, wall time and the H200 budget beside it, and the totals."""
    done = _tsv(os.path.join(work, "stages.tsv"))
    running = _tsv(os.path.join(work, "current.tsv"))
    rows, wall, budget = [], 0.0, 0.0
    for num, name, status, secs, bud, limit, note in (r + [""] * (7 - len(r)) for r in done + running):
        rows.append(
            [
                num,
                name,
                _cell(status),
                f"{float(secs):.1f}" if secs else "-",
                bud or "-",
                limit or "-",
                _cell(note) or "-",
            ]
        )
        wall += float(secs or 0)
        budget += float(bud or 0)
    rows.append(["", "**total**", "", f"{wall:.1f}", f"{budget:.0f}", "", ""])
    return table(["#", "stage", "status", "wall s", "H200 budget s", "timeout s", "notes"], rows)


def _log_tails(work: str, lines: int = 25) -> list[str]:
    out = []
    for num, name, status, *_ in _tsv(os.path.join(work, "stages.tsv")):
        if status.startswith(("FAIL", "TIMEOUT", "killed")):
            path = os.path.join(work, "logs", f"{num}-{name}.log")
            try:
                with open(path, errors="replace") as f:
                    tail = f.read().splitlines()[-lines:]
            except OSError:
                tail = ["(no log)"]
            out += [
                f"### stage {num} {name}: {status} (last {lines} lines of logs/{num}-{name}.log)",
                "",
                "```",
                *tail,
                "```",
                "",
            ]
    return out


def render(work: str) -> str:
    """The whole summary.md text."""
    meta = dict((r + [""])[:2] for r in _tsv(os.path.join(work, "meta.tsv")))
    mode = meta.get("mode", "?")
    out = [f"# spec-rl GPU check ({mode})", ""]
    out += [f"- {k}: {v}" for k, v in meta.items() if k != "mode"] + [""]
    if mode.startswith("smoke"):
        out += [
            "> Smoke run: CPU, Triton interpreter, tiny shapes. It runs every stage's code; "
            "its times are **not** measurements and must not go into RESULTS.md.",
            "",
        ]
    out += ["## Stages", ""] + stage_table(work) + [""]
    for name, section in SECTIONS:
        rec = _json(work, name)
        if rec is not None:
            try:
                out += section(rec) + [""]
            except Exception as exc:  # noqa: BLE001  a half-written record must not cost the summary
                out += [f"(could not render {name}: {type(exc).__name__}: {exc})", ""]
    tails = _log_tails(work)
    if tails:
        out += ["## Failed stages", ""] + tails
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", required=True, help="the GPU check's work folder")
    ap.add_argument("--out", default=None, help="default: WORK/summary.md")
    ap.add_argument("--stages-only", action="store_true", help="print the stage table instead")
    args = ap.parse_args(argv)
    if args.stages_only:
        print("\n".join(stage_table(args.work)))
        return 0
    out = args.out or os.path.join(args.work, "summary.md")
    tmp = f"{out}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(render(args.work))
    os.replace(tmp, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
