"""Tabulate verl CPU runs in verl's own terms: one row per run and step, then totals from step 2 on.

    SPEC_RL_REQUIRE=1 .venv-vllm/bin/pytest -q tests/integrations/test_verl_e2e.py --e2e-exact --e2e-out runs/verl-e2e
    .venv-vllm/bin/python benchmarks/verl_e2e_table.py runs/verl-e2e

Reads ``<dir>/<run>/metrics.jsonl`` (verl's "file" logger: one line per training step) for the runs
``off``, ``lenient`` and ``exact`` that exist, and prints markdown: per step verl's ``timing_s/gen``
(rollout), ``timing_s/step``, response tokens and our ``timing_s/spec_rl/*`` entries (tokens
generated, reused, draft-found and full-reuse ratios); then the sums over steps 2.. (step 1 has no
drafts and carries the engines' warm-up) with each run's ratio to ``off``. Exits 1 when no run is found.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

RUNS = ("off", "lenient", "exact")
COLUMNS = (
    ("gen s", "timing_s/gen", "{:.2f}"),
    ("step s", "timing_s/step", "{:.2f}"),
    ("response tokens", "timing_s/spec_rl/response_tokens", "{:.0f}"),
    ("generated", "timing_s/spec_rl/tokens_generated", "{:.0f}"),
    ("reused", "timing_s/spec_rl/reused_tokens", "{:.0f}"),
    ("draft found", "timing_s/spec_rl/draft_found_ratio", "{:.2f}"),
    ("full reuse", "timing_s/spec_rl/full_reuse_ratio", "{:.2f}"),
    ("score", "critic/score/mean", "{:.3f}"),
)
SUMMED = (
    ("gen s", "timing_s/gen", "{:.2f}"),
    ("step s", "timing_s/step", "{:.2f}"),
    ("generated", "timing_s/spec_rl/tokens_generated", "{:.0f}"),
    ("reused", "timing_s/spec_rl/reused_tokens", "{:.0f}"),
)


def load(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["data"] for line in lines if line.strip()]


def table(runs: dict[str, list[dict]]) -> str:
    head = "| run | step | " + " | ".join(c[0] for c in COLUMNS) + " |"
    out = [head, "|" + " --- |" * (len(COLUMNS) + 2)]
    for name, steps in runs.items():
        for s in steps:
            cells = [fmt.format(s.get(key, float("nan"))) for _, key, fmt in COLUMNS]
            out.append(f"| {name} | {s['training/global_step']} | " + " | ".join(cells) + " |")
    out += ["", "Steps 2 and later, summed (ratio to off):", ""]
    out += ["| run | " + " | ".join(c[0] for c in SUMMED) + " |", "|" + " --- |" * (len(SUMMED) + 1)]
    base = {key: sum(s[key] for s in runs["off"][1:]) for _, key, _ in SUMMED} if "off" in runs else {}
    for name, steps in runs.items():
        cells = []
        for _, key, fmt in SUMMED:
            total = sum(s[key] for s in steps[1:])
            ratio = f" ({total / base[key]:.2f}x)" if base.get(key) else ""
            cells.append(fmt.format(total) + ratio)
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    root = Path(argv[0])
    runs = {name: load(root / name) for name in RUNS if (root / name / "metrics.jsonl").is_file()}
    if not runs:
        print(f"no run folder with metrics.jsonl under {root} (expected {', '.join(RUNS)})", file=sys.stderr)
        return 1
    print(table(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
