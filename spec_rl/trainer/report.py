"""Run reports: summary.json, a markdown table and a PNG plot in the run directory."""

from __future__ import annotations

import json
from pathlib import Path

# Columns printed per epoch (key, header, format).
EPOCH_COLUMNS = (
    ("epoch", "epoch", "{:d}"),
    ("mean_reward", "reward", "{:.3f}"),
    ("generated_tokens", "gen tokens", "{:d}"),
    ("reused_tokens", "reused tokens", "{:d}"),
    ("full_reuse_ratio", "full reuse", "{:.2f}"),
    ("mean_verified_prefix", "mean prefix", "{:.1f}"),
    ("rollout_seconds", "rollout s", "{:.1f}"),
    ("scoring_seconds", "scoring s", "{:.1f}"),
)


def format_row(mode: str, rec: dict) -> str:
    """One aligned text row for the console."""
    cells = [f"{mode:>8}"] + [fmt.format(rec[key]).rjust(max(len(h), 8)) for key, h, fmt in EPOCH_COLUMNS]
    return " | ".join(cells)


def header_row() -> str:
    return " | ".join([f"{'mode':>8}"] + [h.rjust(max(len(h), 8)) for _, h, _ in EPOCH_COLUMNS])


def markdown_table(summary: dict[str, list[dict]]) -> str:
    lines = ["| mode | " + " | ".join(h for _, h, _ in EPOCH_COLUMNS) + " |", "|" + "---|" * (len(EPOCH_COLUMNS) + 1)]
    for mode, records in summary.items():
        for rec in records:
            lines.append("| " + mode + " | " + " | ".join(fmt.format(rec[k]) for k, _, fmt in EPOCH_COLUMNS) + " |")
    return "\n".join(lines)


def comparison(summary: dict[str, list[dict]]) -> list[dict]:
    """Per-epoch ratios of each speculative mode to vanilla (tokens, rollout time, reward gap)."""
    if "vanilla" not in summary:
        return []
    base = {r["epoch"]: r for r in summary["vanilla"]}
    rows = []
    for mode, records in summary.items():
        if mode == "vanilla":
            continue
        for rec in records:
            v = base.get(rec["epoch"])
            if v is None:
                continue
            rows.append(
                {
                    "mode": mode,
                    "epoch": rec["epoch"],
                    "generated_tokens_ratio": rec["generated_tokens"] / v["generated_tokens"] if v["generated_tokens"] else None,
                    "rollout_seconds_ratio": rec["rollout_seconds"] / v["rollout_seconds"] if v["rollout_seconds"] else None,
                    "reward_minus_vanilla": rec["mean_reward"] - v["mean_reward"],
                }
            )
    return rows


def _step_metrics(run_dir: Path, mode: str) -> list[dict]:
    path = run_dir / mode / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot(run_dir: Path, modes: list[str]) -> Path | None:
    """PNG with reward and generated tokens per training step, one line per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    any_data = False
    for mode in modes:
        steps = _step_metrics(run_dir, mode)
        if not steps:
            continue
        any_data = True
        x = [s["step"] + 1 for s in steps]
        axes[0].plot(x, [s["mean_reward"] for s in steps], marker="o", ms=3, label=mode)
        axes[1].plot(x, [s["tokens_generated"] for s in steps], marker="o", ms=3, label=mode)
        axes[2].plot(x, [s["rollout_seconds"] for s in steps], marker="o", ms=3, label=mode)
    if not any_data:
        plt.close(fig)
        return None
    for ax, title in zip(axes, ("mean reward", "tokens generated", "rollout seconds")):
        ax.set_title(title + " per step")
        ax.set_xlabel("training step")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    out = run_dir / "report.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def write_report(run_dir: str | Path, summary: dict[str, list[dict]], info: dict) -> dict[str, Path]:
    """Write summary.json, report.md and report.png into ``run_dir``.

    ``summary`` maps each mode ("vanilla", "spec", "random") to its list of
    per-epoch records; ``info`` (config, model, device) goes to run_info.json.
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    (run_dir / "run_info.json").write_text(json.dumps(info, indent=2, default=str))
    png = plot(run_dir, list(summary.keys()))
    lines = ["# spec-rl run report", "", f"Model: `{info.get('model')}`; device: {info.get('device')}; "
             f"lenience l = {info.get('lenience'):.4g} (log l = {info.get('log_lenience'):.3g}).", "",
             "## Per-epoch results", "", markdown_table(summary), ""]
    comp = comparison(summary)
    if comp:
        lines += ["## Relative to vanilla", "", "| mode | epoch | generated tokens ratio | rollout time ratio | reward - vanilla |",
                  "|---|---|---|---|---|"]
        for c in comp:
            g = "n/a" if c["generated_tokens_ratio"] is None else f"{c['generated_tokens_ratio']:.3f}"
            r = "n/a" if c["rollout_seconds_ratio"] is None else f"{c['rollout_seconds_ratio']:.3f}"
            lines.append(f"| {c['mode']} | {c['epoch']} | {g} | {r} | {c['reward_minus_vanilla']:+.3f} |")
        lines.append("")
    if png is not None:
        lines += ["![reward, generated tokens and rollout time per step](report.png)", ""]
    lines += ["At the rejection point SPEC-RL samples from the current policy, not from the residual distribution of "
              "exact speculative sampling, so even l = 1 is not exactly on-policy (paper Sec. 3; docs/design.md, 'The rule').", ""]
    md = run_dir / "report.md"
    md.write_text("\n".join(lines))
    out = {"summary": run_dir / "summary.json", "report": md}
    if png is not None:
        out["plot"] = png
    return out
