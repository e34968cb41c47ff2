"""``spec-rl sweep``: the paper's lenience and random-reuse ablations (Tables 2-3) on the embedded task.

Every setting trains over several seeds from the demo policy; non-vanilla settings decode with tail speculation (it
changes no token). A finished ``<out>/<setting>/seed<k>/`` run is skipped, so a rerun continues the sweep."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..acceptance.mode import VANILLA, RolloutMode
from ..util.atomic import atomic_write_text, remove_leftovers
from ..util.validation import check_choice, check_int
from .rundir import RunDirError, read_summary

#: The paper's held-out accuracy AVG, generated tokens (millions) and rollout speed-up
#: (arXiv 2509.23232, Qwen3-1.7B GRPO; Table 3 lenience, Table 2 random reuse, Table 1 vanilla).
PAPER = {
    "vanilla": {"avg": 46.7, "tokens_m": None, "speedup": 1.0},
    "random": {"avg": 43.1, "tokens_m": 305, "speedup": 2.35},
    "l=1": {"avg": 46.6, "tokens_m": 419, "speedup": 1.22},
    "l=e^0.2": {"avg": 47.3, "tokens_m": 247, "speedup": 1.86},
    "l=e^0.5": {"avg": 48.0, "tokens_m": 183, "speedup": 2.29},
    "l=e^1": {"avg": 45.4, "tokens_m": 123, "speedup": 2.91},
    "l=e^2": {"avg": 41.5, "tokens_m": 114, "speedup": 3.05},
    "l=inf": {"avg": 40.1, "tokens_m": 40, "speedup": 14.86},
}


_GRID = ("1", "e^0.2", "e^0.5", "e^1", "e^2", "inf")


@dataclass(frozen=True)
class Setting:
    """One row of the sweep: its name (also its run's label) and its rollout mode."""

    name: str
    mode: RolloutMode


#: The rows, vanilla first; "-excl": the token at a rejection is drawn without the rejected draft token.
SETTINGS = tuple(
    Setting(name, RolloutMode.parse(name))
    for name in ("vanilla", "random", *(f"l={x}" for x in _GRID), "exact", *(f"l={x}-excl" for x in _GRID[:3]))
)

#: name: (train prompts, epochs, held-out prompts, fresh samples per held-out prompt); evaluated at the warm start
#: and after the last epoch only: the sweep compares final numbers.
PRESETS = {"small": (256, 4, 640, 1), "full": (256, 5, 640, 1)}


def _run_totals(records: list[dict]) -> dict:
    """One run's numbers: epochs >= 2 summed for the cost, the last epoch for quality."""
    later = [r for r in records if r["epoch"] >= 2]
    last = records[-1]
    return {
        "generated_tokens": sum(r["generated_tokens"] for r in later),
        "rollout_seconds": sum(r["rollout_seconds"] for r in later),
        "decode_steps": sum(r.get("decode_steps", 0) for r in later),
        "heldout_reward": last.get("heldout_reward"),
        "heldout_greedy_accuracy": last.get("heldout_greedy_accuracy"),
        "heldout_reward_start": records[0].get("start_heldout_reward"),
        "final_rollout_reward": last["mean_reward"],
        "log_lenience": [r.get("log_lenience") for r in records],
    }


#: The totals averaged over seeds: the costs (also as ratios to vanilla's) and the final quality (also as gaps).
_COSTS = ("generated_tokens", "rollout_seconds", "decode_steps")
_QUALITY = ("heldout_reward", "heldout_greedy_accuracy")


def _mean_std(values: list[float]) -> tuple[float, float]:
    values = [v for v in values if v is not None]
    if not values:
        return float("nan"), float("nan")
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def _paired_se(runs: list[dict], vanilla: list[dict], key: str = "heldout_reward") -> float:
    """Standard error of the mean gap to vanilla in ``key``, seed k against vanilla's seed k; nan with < 2 pairs."""
    gaps = [r[key] - v[key] for r, v in zip(runs, vanilla) if r.get(key) is not None and v.get(key) is not None]
    if len(gaps) < 2:
        return float("nan")
    return statistics.stdev(gaps) / math.sqrt(len(gaps))


def aggregate(results: dict[str, list[dict]]) -> list[dict]:
    """Per setting: mean/std over seeds of every total, and ratios to vanilla's means."""
    vanilla = results.get(VANILLA, [])
    base = {k: _mean_std([r[k] for r in vanilla])[0] for k in _COSTS + _QUALITY}
    rows = []
    for name, runs in results.items():
        row = {"setting": name, "seeds": len(runs)}
        for key in _COSTS + _QUALITY:
            row[key], row[f"{key}_std"] = _mean_std([r[key] for r in runs])
        for key in _COSTS:
            row[f"{key}_ratio"] = row[key] / base[key] if base.get(key) else float("nan")
        row["speedup"] = 1.0 / row["rollout_seconds_ratio"] if row["rollout_seconds_ratio"] else float("nan")
        for short, key in zip(("heldout", "greedy"), _QUALITY):
            row[f"{short}_minus_vanilla"] = row[key] - base[key]
            row[f"{short}_paired_se"] = _paired_se(runs, vanilla, key)
        rows.append(row)
    return rows


def _num(x: float) -> str:
    """Three decimals, or "-" where there is no value (a standard error over fewer than 2 seeds)."""
    return "-" if x is None or math.isnan(x) else f"{x:.3f}"


def markdown(rows: list[dict], info: dict) -> str:
    """The sweep table in the layout of the paper's Tables 2-3, the paper's numbers beside ours."""
    lines = [
        f"Sweep: preset {info['preset']}, seeds {info['seeds']}, commit {info.get('commit')}, {info.get('date')}, "
        f"device {info.get('device')}.",
        "",
        "| setting | gen tokens (epochs 2+) | tokens vs vanilla | rollout s | speed-up | decode steps vs vanilla | "
        "held-out reward (mean ± std) | vs vanilla (paired ± s.e.) | greedy acc. (vs vanilla, paired ± s.e.) | "
        "paper tokens (M) | paper speed-up | paper AVG |",
        "|" + "---|" * 12,
    ]
    for r in rows:
        p = PAPER.get(r["setting"], {})
        lines.append(
            f"| {r['setting']} | {r['generated_tokens']:.0f} | {r['generated_tokens_ratio']:.3f} | "
            f"{r['rollout_seconds']:.1f} | {r['speedup']:.2f}x | {r['decode_steps_ratio']:.3f} | "
            f"{r['heldout_reward']:.3f} ± {r['heldout_reward_std']:.3f} | "
            f"{r['heldout_minus_vanilla']:+.3f} ± {_num(r['heldout_paired_se'])} | {r['heldout_greedy_accuracy']:.3f} "
            f"({r['greedy_minus_vanilla']:+.3f} ± {_num(r['greedy_paired_se'])}) | {p.get('tokens_m') or '-'} | "
            f"{(str(p['speedup']) + 'x') if p.get('speedup') else '-'} | {p.get('avg', '-')} |"
        )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> Path:
    """Cost ratios to vanilla (left) and held-out reward and greedy accuracy minus vanilla's, paired over seeds
    with standard errors (right), per setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = range(len(rows))
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.5))
    for shift, key, label in ((-0.2, "generated_tokens", "generated tokens"), (0.2, "rollout_seconds", "rollout time")):
        a.bar([i + shift for i in x], [r[f"{key}_ratio"] for r in rows], width=0.4, label=f"{label} vs vanilla")
    for shift, key, label in ((-0.1, "heldout", "held-out reward"), (0.1, "greedy", "greedy accuracy")):
        gaps, errors = [r[f"{key}_minus_vanilla"] for r in rows], [r[f"{key}_paired_se"] for r in rows]
        b.errorbar([i + shift for i in x], gaps, yerr=errors, fmt="o", capsize=4, label=label)
    b.axhline(0.0, color="gray", ls="--", lw=1)
    titles = (
        "cost relative to vanilla (epochs 2+)",
        "after the last epoch, minus vanilla (paired mean ± s.e. over seeds)",
    )
    for ax, title in zip((a, b), titles):
        ax.set_xticks(list(x), [r["setting"] for r in rows], rotation=40, ha="right")
        ax.set_title(title)
        ax.legend()
    a.grid(alpha=0.3, axis="y")
    b.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run_sweep(
    model_path: str | Path,
    train_examples,
    eval_examples,
    reward_fn: Callable[[str, str], float],
    base_config,
    out_dir: str | Path,
    preset: str,
    seeds: int,
    settings=SETTINGS,
    progress: bool = True,
) -> list[dict]:
    """Train every (setting, seed) not finished yet, then write sweep.json, sweep.md and sweep.png. Raises ValueError
    for an unknown preset or ``seeds`` < 1."""
    from tqdm.auto import tqdm

    from .run import run_modes

    check_choice("preset", preset, tuple(PRESETS))
    check_int("seeds", seeds, low=1)
    out_dir = Path(out_dir)
    todo = [(s, k) for s in settings for k in range(int(seeds))]
    bar = tqdm(total=len(todo), desc="sweep runs", unit="run", disable=not progress)
    results: dict[str, list[dict]] = {s.name: [] for s in settings}
    for setting, k in todo:
        run_dir = out_dir / setting.name / f"seed{k}"
        if _finished(run_dir, setting.name, base_config.epochs):
            remove_leftovers(run_dir)  # a writer killed after the summary was committed
            bar.write(f"{setting.name} seed {k}: finished earlier, skipped")
        else:
            cfg = dataclasses.replace(base_config, seed=base_config.seed + k)
            with contextlib.redirect_stdout(io.StringIO()):  # the per-epoch rows of each run
                run_modes(
                    model_path,
                    train_examples,
                    reward_fn,
                    cfg,
                    {setting.name: setting.mode},
                    run_dir,
                    eval_examples,
                    resume=run_dir.is_dir() and any(run_dir.iterdir()),
                    progress=False,
                )
        results[setting.name].append(_run_totals(read_summary(run_dir)[setting.name]))
        bar.update(1)
    bar.close()
    rows = aggregate(results)
    info = _info(preset, seeds, base_config)
    atomic_write_text(
        out_dir / "sweep.json", json.dumps({"info": info, "rows": rows, "runs": results}, indent=2, default=str)
    )
    atomic_write_text(out_dir / "sweep.md", markdown(rows, info))
    plot(rows, out_dir / "sweep.png")
    return rows


def _finished(run_dir: Path, mode: str, epochs: int) -> bool:
    """Whether ``run_dir`` holds ``epochs`` epoch records of ``mode`` (a damaged summary: no)."""
    try:
        return len(read_summary(run_dir).get(mode, [])) >= epochs
    except RunDirError:
        return False


def _commit() -> str:
    """The checkout's git commit (with -dirty for uncommitted changes), or "unknown" outside a checkout."""
    import subprocess

    def git(*args: str, check: bool = True) -> str:
        here = Path(__file__).resolve().parent
        return subprocess.run(["git", *args], cwd=here, capture_output=True, text=True, check=check).stdout.strip()

    try:
        sha, dirty = git("rev-parse", "HEAD"), git("status", "--porcelain", check=False)
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return sha[:12] + ("-dirty" if dirty else "")


def _info(preset: str, seeds: int, config) -> dict:
    import platform

    import torch

    from .run import package_versions

    return {
        "preset": preset,
        "seeds": seeds,
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "commit": _commit(),
        "device": f"{config.device} ({platform.machine()}, {torch.get_num_threads()} threads)",
        "versions": package_versions(),
        "config": config.to_dict(),
    }


def chosen_settings(spec: str | None) -> tuple[Setting, ...]:
    """The settings named in ``--settings`` (comma-separated; None: all of :data:`SETTINGS`), vanilla first. Raises
    ValueError for an unknown name (listing the valid ones) or no name at all."""
    if spec is None:
        return SETTINGS
    names = [x.strip() for x in spec.split(",") if x.strip()]
    known = {x.name: x for x in SETTINGS}
    bad = [n for n in names if n not in known]
    if bad or not names:
        what = f"unknown name(s) {', '.join(bad)}" if bad else "no setting named"
        raise ValueError(f"--settings: {what} in {spec!r}; choose from {', '.join(known)}")
    settings = tuple(known[n] for n in names)
    return settings if VANILLA in names else (known[VANILLA],) + settings  # every ratio is to vanilla


def cmd_sweep(args) -> int:
    """Run the sweep from the parsed ``spec-rl sweep`` arguments; prints the table."""
    from ..tasks.arithmetic import arithmetic_reward
    from ..tasks.demo_data import demo_eval_set, demo_train_set
    from ..tasks.demo_policy import build_demo_policy
    from .config import demo_config

    settings = chosen_settings(args.settings)
    prompts, epochs, eval_prompts, eval_samples = PRESETS[args.preset]
    model_path = build_demo_policy(cache_dir=args.cache_dir, progress=not args.no_progress)
    base = demo_config(epochs=epochs, eval_samples=eval_samples, eval_every=epochs)
    out = Path(args.out)
    train, evals = demo_train_set()[:prompts], demo_eval_set()[:eval_prompts]
    run_sweep(
        model_path, train, evals, arithmetic_reward, base, out, args.preset, args.seeds, settings, not args.no_progress
    )
    print((out / "sweep.md").read_text())
    print(f"table: {out / 'sweep.md'}, plot: {out / 'sweep.png'}, data: {out / 'sweep.json'}")
    return 0
