"""Run reports: summary.json, a markdown table and a PNG plot in the run directory.

What a reader compares is time, and rollout time follows the number of sequential decode steps
(the longest continuation of a batch), not the number of generated tokens. So every comparison
with plain vanilla shows three ratios side by side: generated tokens, decode steps and rollout
seconds, plus the split of rollout time into scoring, decode and other work.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..atomic import atomic_write, atomic_write_text

# Columns printed per epoch (key, header, format).
EPOCH_COLUMNS = (
    ("epoch", "epoch", "{:d}"),
    ("mean_reward", "reward", "{:.3f}"),
    ("generated_tokens", "gen tokens", "{:d}"),
    ("reused_tokens", "reused tokens", "{:d}"),
    ("full_reuse_ratio", "full reuse", "{:.2f}"),
    ("decode_steps", "decode steps", "{:d}"),
    ("longest_continuation", "longest", "{:d}"),
    ("rollout_seconds", "rollout s", "{:.1f}"),
    ("scoring_seconds", "scoring s", "{:.1f}"),
)
#: Summed over epochs for the run-level ratios.
_TOTALS = ("generated_tokens", "decode_steps", "rollout_seconds", "scoring_seconds", "generation_seconds", "other_seconds")


def _cell(rec: dict, key: str, fmt: str) -> str:
    value = rec.get(key, 0)
    return fmt.format(int(value) if fmt.endswith("d}") else value)


def format_row(mode: str, rec: dict) -> str:
    """One aligned text row for the console."""
    cells = [f"{mode:>8}"] + [_cell(rec, key, fmt).rjust(max(len(h), 8)) for key, h, fmt in EPOCH_COLUMNS]
    return " | ".join(cells)


def header_row() -> str:
    return " | ".join([f"{'mode':>8}"] + [h.rjust(max(len(h), 8)) for _, h, _ in EPOCH_COLUMNS])


def markdown_table(summary: dict[str, list[dict]]) -> str:
    lines = ["| mode | " + " | ".join(h for _, h, _ in EPOCH_COLUMNS) + " |", "|" + "---|" * (len(EPOCH_COLUMNS) + 1)]
    for mode, records in summary.items():
        for rec in records:
            lines.append("| " + mode + " | " + " | ".join(_cell(rec, k, fmt) for k, _, fmt in EPOCH_COLUMNS) + " |")
    return "\n".join(lines)


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def comparison(summary: dict[str, list[dict]]) -> list[dict]:
    """Per-epoch ratios of every other run to plain vanilla: tokens, decode steps, rollout time, reward gap."""
    if "vanilla" not in summary:
        return []
    base = {r["epoch"]: r for r in summary["vanilla"]}
    rows = []
    for mode, records in summary.items():
        for rec in records if mode != "vanilla" else []:
            v = base.get(rec["epoch"])
            if v is not None:
                rows.append({
                    "mode": mode,
                    "epoch": rec["epoch"],
                    "generated_tokens_ratio": _ratio(rec["generated_tokens"], v["generated_tokens"]),
                    "decode_steps_ratio": _ratio(rec.get("decode_steps", 0), v.get("decode_steps", 0)),
                    "rollout_seconds_ratio": _ratio(rec["rollout_seconds"], v["rollout_seconds"]),
                    "reward_minus_vanilla": rec["mean_reward"] - v["mean_reward"],
                })  # fmt: skip
    return rows


def run_ratios(summary: dict[str, list[dict]], from_epoch: int = 2) -> list[dict]:
    """Each run vs plain vanilla over epochs >= ``from_epoch`` summed (epoch 1 has no drafts).

    Returns one dict per run (vanilla included, ratios 1): summed ``generated_tokens``,
    ``decode_steps``, ``rollout_seconds`` and their ratios to vanilla; the rollout time split
    (scoring, decode, other seconds); ``scoring_share`` = scoring seconds / vanilla rollout
    seconds; ``final_reward_minus_vanilla`` at the last shared epoch.
    """
    if "vanilla" not in summary:
        return []
    epochs = {r["epoch"] for r in summary["vanilla"] if r["epoch"] >= from_epoch}

    def total(records: list[dict]) -> dict:
        return {k: sum(r.get(k, 0) for r in records if r["epoch"] in epochs) for k in _TOTALS}

    base = total(summary["vanilla"])
    last_v = {r["epoch"]: r["mean_reward"] for r in summary["vanilla"]}
    out = []
    for mode, records in summary.items():
        t = total(records)
        shared = [r for r in records if r["epoch"] in last_v]
        out.append({
            "mode": mode, **t,
            **{f"{k}_ratio": _ratio(t[k], base[k]) for k in ("generated_tokens", "decode_steps", "rollout_seconds")},
            "scoring_share": _ratio(t["scoring_seconds"], base["rollout_seconds"]),
            "final_reward_minus_vanilla": (shared[-1]["mean_reward"] - last_v[shared[-1]["epoch"]]) if shared else None,
            "epochs": sorted(epochs),
        })  # fmt: skip
    return out


def _fmt(x: float | None, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def closing_lines(summary: dict[str, list[dict]], from_epoch: int = 2) -> list[str]:
    """The console summary: every run vs plain vanilla, epochs >= ``from_epoch`` summed."""
    lines = []
    for r in run_ratios(summary, from_epoch):
        if r["mode"] == "vanilla":
            continue
        if not r["epochs"]:  # e.g. a one-epoch run: no drafts yet, nothing to compare
            lines.append(f"{r['mode']}/vanilla: no epoch >= {from_epoch} to compare (the first epoch has no drafts)")
            continue
        lines.append(
            f"{r['mode']}/vanilla, epochs {from_epoch}+: generated tokens {_fmt(r['generated_tokens_ratio'], '.2f')}x, "
            f"decode steps {_fmt(r['decode_steps_ratio'], '.2f')}x, rollout time {_fmt(r['rollout_seconds_ratio'], '.2f')}x "
            f"(scoring {_fmt(r['scoring_share'], '.0%')} of vanilla's rollout), final reward "
            f"{_fmt(r['final_reward_minus_vanilla'], '+.3f')}"
        )
    return lines


def _describe(rec: dict) -> str:
    """How a run rolled out, from its first epoch record: reuse rule and tail speculation."""
    reuse = "no draft reuse" if rec.get("mode") == "vanilla" or rec.get("strategy") == "off" else f"{rec.get('acceptance')} acceptance"
    return f"{reuse}, tail speculation {'on' if rec.get('history_spec') else 'off'}"


def _step_metrics(run_dir: Path, mode: str) -> list[dict]:
    path = run_dir / mode / "metrics.jsonl"
    if not path.is_file():
        return []
    steps = []
    for line in path.read_text().splitlines():
        try:
            steps.append(json.loads(line))
        except ValueError:
            continue  # the last line of a killed run may be cut short; resume rewrites the file
    return steps


def plot(run_dir: Path, modes: list[str]) -> Path | None:
    """PNG with reward, generated tokens, decode steps and rollout seconds per training step, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (("mean_reward", "mean reward"), ("tokens_generated", "tokens generated"),
              ("decode_steps", "decode steps"), ("rollout_seconds", "rollout seconds"))  # fmt: skip
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4))
    any_data = False
    for mode in modes:
        steps = _step_metrics(run_dir, mode)
        if not steps:
            continue
        any_data = True
        x = [s["step"] + 1 for s in steps]
        for ax, (key, _) in zip(axes, panels):
            ax.plot(x, [s.get(key, 0) for s in steps], marker="o", ms=3, label=mode)
    if not any_data:
        plt.close(fig)
        return None
    for ax, (_, title) in zip(axes, panels):
        ax.set_title(title + " per step")
        ax.set_xlabel("training step")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    out = atomic_write(run_dir / "report.png", lambda tmp: fig.savefig(tmp, dpi=110, format="png"), fsync=False)
    plt.close(fig)
    return out


def _comparison_markdown(summary: dict[str, list[dict]]) -> list[str]:
    lines = []
    totals = run_ratios(summary)
    if totals:
        lines += ["## Relative to plain vanilla, epochs 2+ summed", "",
                  "| run | tokens ratio | decode steps ratio | rollout time ratio | scoring s | decode s | other s | "
                  "scoring / vanilla rollout | final reward - vanilla |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for r in totals:
            lines.append(
                f"| {r['mode']} | {_fmt(r['generated_tokens_ratio'], '.3f')} | {_fmt(r['decode_steps_ratio'], '.3f')} | "
                f"{_fmt(r['rollout_seconds_ratio'], '.3f')} | {r['scoring_seconds']:.2f} | {r['generation_seconds']:.2f} | "
                f"{r['other_seconds']:.2f} | {_fmt(r['scoring_share'], '.1%')} | {_fmt(r['final_reward_minus_vanilla'], '+.3f')} |"
            )
        lines.append("")
    comp = comparison(summary)
    if comp:
        lines += ["## Per epoch, relative to plain vanilla", "",
                  "| run | epoch | tokens ratio | decode steps ratio | rollout time ratio | reward - vanilla |",
                  "|---|---|---|---|---|---|"]  # fmt: skip
        for c in comp:
            lines.append(
                f"| {c['mode']} | {c['epoch']} | {_fmt(c['generated_tokens_ratio'], '.3f')} | {_fmt(c['decode_steps_ratio'], '.3f')} | "
                f"{_fmt(c['rollout_seconds_ratio'], '.3f')} | {c['reward_minus_vanilla']:+.3f} |"
            )
        lines.append("")
    return lines


def write_report(
    run_dir: str | Path, summary: dict[str, list[dict]], info: dict, plot_png: bool = True
) -> dict[str, Path]:
    """Write summary.json, run_info.json, report.md and report.png into ``run_dir`` (each file atomically).

    ``summary`` maps each run label ("vanilla", "spec", "exact", ...) to its list of per-epoch
    records; ``info`` (config, model, device) goes to run_info.json. ``plot_png=False`` keeps the
    report.png already there (the plot is the slow part; the trainer redraws it when a run ends).
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(run_dir / "summary.json", json.dumps(summary, indent=2))
    atomic_write_text(run_dir / "run_info.json", json.dumps(info, indent=2, default=str))
    png = plot(run_dir, list(summary.keys())) if plot_png else None
    if png is None and not plot_png and (run_dir / "report.png").is_file():
        png = run_dir / "report.png"
    lines = ["# spec-rl run report", "", f"Model: `{info.get('model')}`; device: {info.get('device')}; "
             f"lenience l = {info.get('lenience'):.4g} (log l = {info.get('log_lenience'):.3g}); runs: "
             + ", ".join(f"{m} ({_describe(r[0]) if r else '?'})" for m, r in summary.items()) + ".", "",
             "## Per-epoch results", "", markdown_table(summary), ""]  # fmt: skip
    lines += _comparison_markdown(summary)
    if png is not None:
        lines += ["![reward, generated tokens, decode steps and rollout time per step](report.png)", ""]
    lines += ["Lenient acceptance (the paper's rule) samples the token at a rejection from the current policy, not from "
              "the residual of exact speculative sampling, so even l = 1 is not exactly on-policy; exact acceptance "
              "is (paper Sec. 3; docs/design.md, 'The rule' and 'Exact acceptance').", ""]
    md = atomic_write_text(run_dir / "report.md", "\n".join(lines))
    out = {"summary": run_dir / "summary.json", "report": md}
    if png is not None:
        out["plot"] = png
    return out
