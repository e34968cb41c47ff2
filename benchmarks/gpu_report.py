"""summary.md of a GPU check, and the markdown tables every benchmark prints (benchmarks/RESULTS.md's format).

gpu_check.sh calls it after every stage (and every 30 s while one runs); its ``--work`` folder holds what the stages
wrote: ``meta.tsv`` (key, value), ``stages.tsv`` (one line per finished stage: number, name, status, wall seconds,
H200 budget seconds, timeout seconds, note), ``current.tsv`` (the stage running now, if any), ``json/*.json`` (the
benchmarks' records, each with its own markdown under ``report``, rewritten with every row: a stage cut short still
shows its finished rows) and ``logs/*.log``. Standard library only: it must run even where the package does not.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

#: The records of the stages, in the summary's order.
RECORDS = [
    "env.json",
    "gpu_suite.json",
    "paged_attention.json",
    "engine.json",
    "rollout.json",
    "decode_cache.json",
    "compile_check.json",
    "real_model_rollout-continuous.json",
    "real_model_rollout-full-batch.json",
    "real_model_rollout-headline.json",
]


def cell(value, fmt: str = "{}") -> str:
    """One markdown cell: None is "-", strings as they are (pipes escaped), numbers through ``fmt``."""
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
    """Markdown table lines; cells that are not strings yet go through :func:`cell`."""
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return out + ["| " + " | ".join(c if isinstance(c, str) else cell(c) for c in row) + " |" for row in rows]


def rows_table(columns: list[tuple], rows: list[dict], keep: int = 1) -> list[str]:
    """A table of result rows: ``columns`` are (header, key or function of the row, format). A row that raised or
    was skipped keeps its first ``keep`` cells and shows its error (or skip reason) after them."""
    lines = []
    for r in rows:
        cells = [cell(key(r) if callable(key) else r.get(key), fmt) for _, key, fmt in columns]
        if "ms" not in r and ("error" in r or "skipped" in r):
            cells = cells[:keep] + [cell(r.get("error") or r.get("skipped"))] + ["-"] * (len(cells) - keep - 1)
        lines.append(cells)
    return table([c[0] for c in columns], lines)


def speedups(row: dict) -> str:
    """ "label 1.23x, ..." from a row's ``speedup_vs_<label>`` entries."""
    return ", ".join(f"{k[11:]} {v:.2f}x" for k, v in row.items() if k.startswith("speedup_vs_")) or "-"


def section(title: str, record: dict, body: list[str]) -> list[str]:
    """A benchmark's markdown: its title, status and provenance, ``body`` (its tables), then checks and failures."""
    where = {**record.get("provenance", {}), **record.get("meta", {}), **record}
    keys = ("device", "commit", "date", "torch", "triton")
    head = ", ".join([f"status **{record.get('status', '?')}**"] + [f"{k} {where[k]}" for k in keys if k in where])
    out = [f"## {title}", "", head, "", *body, ""]
    out += [f"- check `{k}`: {v:.3g}" for k, v in record.get("checks", {}).items()]
    return out + [f"- **FAILED**: {cell(f)}" for f in record.get("failures", [])]


def _tsv(path: str) -> list[list[str]]:
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [line.rstrip("\n").split("\t") for line in f if line.strip()]


def stage_table(work: str) -> list[str]:
    """The stage table: status, wall time and the H200 budget beside it, and the totals."""
    rows, wall, budget = [], 0.0, 0.0
    for r in _tsv(os.path.join(work, "stages.tsv")) + _tsv(os.path.join(work, "current.tsv")):
        num, name, status, secs, bud, limit, note = r + [""] * (7 - len(r))
        rows.append([num, name, cell(status), f"{float(secs):.1f}" if secs else "-", bud or "-", limit or "-"])
        rows[-1].append(cell(note) or "-")
        wall += float(secs or 0)
        budget += float(bud or 0)
    rows.append(["", "**total**", "", f"{wall:.1f}", f"{budget:.0f}", "", ""])
    return table(["#", "stage", "status", "wall s", "H200 budget s", "timeout s", "notes"], rows)


def _log_tails(work: str, lines: int = 25) -> list[str]:
    out = []
    for num, name, status, *_ in _tsv(os.path.join(work, "stages.tsv")):
        if status.startswith(("FAIL", "TIMEOUT", "killed")):
            try:
                with open(os.path.join(work, "logs", f"{num}-{name}.log"), errors="replace") as f:
                    tail = f.read().splitlines()[-lines:]
            except OSError:
                tail = ["(no log)"]
            out += [f"### stage {num} {name}: {status} (last {lines} lines of logs/{num}-{name}.log)", ""]
            out += ["```", *tail, "```", ""]
    return out


def render(work: str) -> str:
    """The whole summary.md text."""
    meta = dict((r + [""])[:2] for r in _tsv(os.path.join(work, "meta.tsv")))
    mode = meta.get("mode", "?")
    out = [f"# spec-rl GPU check ({mode})", ""] + [f"- {k}: {v}" for k, v in meta.items() if k != "mode"] + [""]
    if mode.startswith("smoke"):
        out += [
            "> Smoke run: CPU, Triton interpreter, tiny shapes. It runs every stage's code; "
            "its times are **not** measurements and must not go into RESULTS.md.",
            "",
        ]
    out += ["## Stages", ""] + stage_table(work) + [""]
    for name in RECORDS:
        try:
            with open(os.path.join(work, "json", name)) as f:
                out += json.load(f).get("report", [f"({name} has no report)"]) + [""]
        except (OSError, ValueError, AttributeError):  # absent or half-written: the next snapshot has it
            continue
    tails = _log_tails(work)
    return "\n".join(out + (["## Failed stages", ""] + tails if tails else [])) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", required=True, help="the GPU check's work folder")
    ap.add_argument("--stages-only", action="store_true", help="print the stage table instead")
    args = ap.parse_args(argv)
    if not os.path.isfile(os.path.join(args.work, "stages.tsv")):
        ap.error(f"--work {args.work} is not a GPU check's work folder (no stages.tsv)")
    if args.stages_only:
        print("\n".join(stage_table(args.work)))
        return 0
    out = os.path.join(args.work, "summary.md")
    tmp = f"{out}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(render(args.work))
    os.replace(tmp, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
