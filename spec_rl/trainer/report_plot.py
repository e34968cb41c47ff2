"""report.png: the held-out reward per epoch and the rollout cost per training step, one line per run."""

from __future__ import annotations

from pathlib import Path

from ..util.atomic import atomic_write
from .heldout import heldout_curve
from .records import read_step_metrics

# Per-step panels (metrics.jsonl key, title).
_STEP_PANELS = (
    ("mean_reward", "rollout reward"),
    ("tokens_generated", "tokens generated"),
    ("decode_steps", "decode steps"),
    ("rollout_seconds", "rollout seconds"),
)


def _heldout_panel(ax, summary: dict[str, list[dict]]) -> None:
    """Held-out reward (solid) and greedy accuracy (dashed) per epoch, from 0 (the warm start)."""
    for mode, records in summary.items():
        curve = heldout_curve(records)
        if not curve:
            continue
        x = [p["epoch"] for p in curve]
        (line,) = ax.plot(x, [p["heldout_reward"] for p in curve], marker="o", ms=4, label=f"{mode} sampled")
        greedy = [p["heldout_greedy_accuracy"] for p in curve]
        ax.plot(x, greedy, ls="--", marker="x", ms=4, color=line.get_color(), label=f"{mode} greedy")
    ax.set_title("held-out reward per epoch (0 = warm start)")
    ax.set_xlabel("epoch")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def plot(run_dir: Path, summary: dict[str, list[dict]]) -> Path | None:
    """Write ``run_dir/report.png`` (atomically): held-out reward per epoch, rollout cost per step; None if empty."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = {mode: read_step_metrics(run_dir, mode) for mode in summary}
    evaluated = any(heldout_curve(records) for records in summary.values())
    if not any(steps.values()) and not evaluated:
        return None
    n_panels = len(_STEP_PANELS) + int(evaluated)
    fig, axes = plt.subplots(1, n_panels, figsize=(5 * n_panels, 4))
    if evaluated:
        _heldout_panel(axes[0], summary)
    step_axes = axes[int(evaluated) :]
    for mode, rows in steps.items():
        if not rows:
            continue
        x = [s["step"] + 1 for s in rows]
        for ax, (key, _) in zip(step_axes, _STEP_PANELS):
            ax.plot(x, [s.get(key, 0) for s in rows], marker="o", ms=3, label=mode)
    for ax, (_, title) in zip(step_axes, _STEP_PANELS):
        ax.set_title(title + " per step")
        ax.set_xlabel("training step")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend()
    fig.tight_layout()
    out = atomic_write(run_dir / "report.png", lambda tmp: fig.savefig(tmp, dpi=110, format="png"), fsync=False)
    plt.close(fig)
    return out
