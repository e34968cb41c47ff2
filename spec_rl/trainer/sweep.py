"""``spec-rl sweep``: the speed/learning trade-off per run mode, on the demo task or any model (docs/api.md "Sweep").

Every setting (a run by name: vanilla, exact, l=1-res, spec-age2, spec+tis, ...) trains the same recipe from the same
start over the same seeds, so setting and vanilla pair seed by seed and held-out problem by problem. A finished
``<out>/<setting>/seed<k>/`` run is skipped and an unfinished one resumes from its checkpoint: rerun to continue."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..acceptance.mode import VANILLA
from ..util.atomic import atomic_write_text, remove_leftovers
from .correction import weight_stats
from .heldout import start_point
from .rundir import RunDirError, read_summary, run_contents

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
#: The demo's default settings: the paper's ablations (Tables 2-3), exact and the without-draft draw.
DEMO_SETTINGS = ("vanilla", "random", *(f"l={x}" for x in _GRID), "exact", *(f"l={x}-excl" for x in _GRID[:3]))
#: A user's model's default settings: the lossless rules, the paper's lenience, and one draft age bound.
MODEL_SETTINGS = ("vanilla", "coupled", "exact", "l=1-res", "spec", "spec+tis")

#: name: (train prompts, epochs, held-out prompts, fresh samples per held-out prompt) of the demo task.
PRESETS = {"small": (256, 4, 640, 1), "full": (256, 5, 640, 1)}
#: Bootstrap resamples of the paired intervals, and their fixed seed (the same table from the same runs).
_RESAMPLES, _BOOT_SEED = 2000, 0


@dataclass
class Sweep:
    """What a sweep trains: the policy at ``model_path``, the examples, the reward, the base config (each seed k runs
    ``config.seed + k``), the settings ({name: RunSetting}, the name also its run's label), ``seeds`` per setting, the
    output folder, and ``info`` recorded with it."""

    model_path: str | Path
    train_examples: Sequence
    eval_examples: Sequence
    reward_fn: Callable[[str, str], float]
    config: object
    settings: dict
    seeds: int
    out_dir: str | Path
    info: dict = dataclasses.field(default_factory=dict)


def chosen_settings(spec: str | None, default: Sequence[str] = DEMO_SETTINGS) -> dict:
    """The settings named in ``--settings`` (comma-separated runs, :func:`run_settings`; None: ``default``) as
    {name: RunSetting}, vanilla first. ValueError for a name that names no run, a name twice, or no name."""
    from .config import run_settings

    names = list(default) if spec is None else [x.strip() for x in spec.split(",") if x.strip()]
    if names and VANILLA not in names:  # every ratio and gap is to vanilla
        names.insert(0, VANILLA)
    return run_settings(names, "--settings")


def run_totals(records: list[dict]) -> dict:
    """One run's numbers: per-epoch costs, epochs >= 2 summed, the last evaluation for quality."""
    later = [r for r in records if r["epoch"] >= 2]
    last = [r for r in records if "heldout_reward" in r][-1]
    spent, curve = 0, []
    if "start_heldout_reward" in records[0]:
        curve.append((0, records[0]["start_heldout_reward"]))
    for r in records:
        spent += r["generated_tokens"]
        if "heldout_reward" in r:
            curve.append((spent, r["heldout_reward"]))
    later_draft = sum(r.get("draft_tokens", 0) for r in later)
    drift = [r["reused_drift"] for r in later if r.get("reused_drift") is not None]
    weights = weight_stats(later)
    return {
        "epoch_generated_tokens": [r["generated_tokens"] for r in records],
        "epoch_decode_steps": [r.get("decode_steps", 0) for r in records],
        "generated_tokens": sum(r["generated_tokens"] for r in later),
        "decode_steps": sum(r.get("decode_steps", 0) for r in later),
        "rollout_seconds": sum(r["rollout_seconds"] for r in later),
        "accepted_share": sum(r.get("reused_tokens", 0) for r in later) / later_draft if later_draft else 0.0,
        "drift": statistics.fmean(drift) if drift else None,
        "wall_seconds": sum(r["rollout_seconds"] + r["train_seconds"] + r.get("heldout_seconds", 0) for r in records),
        "heldout_reward": last["heldout_reward"],
        "heldout_greedy_accuracy": last["heldout_greedy_accuracy"],
        "prompt_rewards": last.get("heldout_prompt_rewards"),
        "greedy_rewards": last.get("heldout_greedy_rewards"),
        "curve": curve,
        # every epoch's groups had equal rewards: the policy never changed, its gap to vanilla measures nothing
        "no_signal": all(r.get("no_signal") for r in records),
        "is_mean": weights["is_mean"],
        "is_ess": weights["is_ess"],
    }


def paired_interval(runs: list[dict], vanilla: list[dict], key: str) -> tuple[float, float, float]:
    """(mean, low, high): the paired difference to vanilla of per-problem ``key`` (seed k against vanilla's seed k,
    problem by problem) and its 95% bootstrap interval over seeds and problems; nan without per-problem values."""
    pairs = [(r[key], v[key]) for r, v in zip(runs, vanilla) if r.get(key) and v.get(key)]
    if not pairs:
        return math.nan, math.nan, math.nan
    diff = torch.tensor([a for a, _ in pairs], dtype=torch.float64) - torch.tensor([b for _, b in pairs])
    seeds, problems = diff.shape
    gen = torch.Generator().manual_seed(_BOOT_SEED)
    rows = torch.randint(seeds, (_RESAMPLES, seeds, 1), generator=gen)
    cols = torch.randint(problems, (_RESAMPLES, 1, problems), generator=gen)
    means = diff[rows, cols].mean(dim=(1, 2))  # every resample's seeds x problems grid at once
    low, high = torch.quantile(means, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return float(diff.mean()), low, high


def aggregate(results: dict[str, list[dict]]) -> list[dict]:
    """Per setting: means over seeds, costs as ratios to vanilla's, held-out gaps with paired 95% intervals."""
    vanilla = results[VANILLA]

    def mean(runs, key):
        values = [r[key] for r in runs if r.get(key) is not None]
        return statistics.fmean(values) if values else math.nan

    rows = []
    for name, runs in results.items():
        row = {"setting": name, "seeds": len(runs)}
        keys = ("generated_tokens", "decode_steps", "rollout_seconds", "accepted_share", "drift", "wall_seconds")
        keys += ("is_mean", "is_ess")
        for key in (*keys, "heldout_reward", "heldout_greedy_accuracy"):
            row[key] = mean(runs, key)
        for key in ("generated_tokens", "decode_steps", "rollout_seconds"):
            base = mean(vanilla, key)
            row[f"{key}_ratio"] = row[key] / base if base else math.nan
        for key in ("epoch_generated_tokens", "epoch_decode_steps"):
            row[key] = [statistics.fmean(x) for x in zip(*(r[key] for r in runs))]
        for short, key in (("heldout", "prompt_rewards"), ("greedy", "greedy_rewards")):
            row[f"{short}_gap"], row[f"{short}_low"], row[f"{short}_high"] = paired_interval(runs, vanilla, key)
        row["no_signal_seeds"] = sum(bool(r.get("no_signal")) for r in runs)
        # a gap where this setting or vanilla never learnt compares two unchanged policies: it measures nothing
        row["no_signal"] = row["no_signal_seeds"] == len(runs) or all(r.get("no_signal") for r in vanilla)
        rows.append(row)
    return rows


def _num(x, fmt: str = ".3f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def _gap(row: dict, short: str) -> str:
    if row.get("no_signal"):
        return "no learning signal"
    gap, low, high = (_num(row[f"{short}_{k}"], "+.3f") for k in ("gap", "low", "high"))
    return f"{gap} [{low}, {high}]"


def markdown(rows: list[dict], info: dict) -> str:
    """The sweep's report: the trade-off table (the paper's numbers beside the settings it ran) and per-epoch costs."""
    lines = [
        f"Sweep: {info.get('task', '?')}, {info.get('seeds')} seed(s), commit {info.get('commit')}, "
        f"{info.get('date')}, device {info.get('device')}. Costs over epochs 2+; held-out after the last epoch; gaps "
        "are paired with vanilla (same seeds, same problems) with 95% bootstrap intervals over seeds and problems.",
        "",
        *(f"**WARNING: {w}**\n" for w in warnings(rows)),
        "| setting | gen tokens | vs vanilla | decode steps vs vanilla | accepted share | drift (nats) | IS mean / "
        "ESS | held-out reward | vs vanilla [95%] | greedy acc. | vs vanilla [95%] | wall s | paper speed-up | paper "
        "AVG |",
        "|" + "---|" * 14,
    ]
    for r in rows:
        p = PAPER.get(r["setting"], {})
        lines.append(
            f"| {r['setting']} | {r['generated_tokens']:.0f} | {r['generated_tokens_ratio']:.3f} | "
            f"{r['decode_steps_ratio']:.3f} | {_num(r['accepted_share'])} | {_num(r['drift'])} | "
            f"{_num(r['is_mean'])} / {_num(r['is_ess'])} | "
            f"{r['heldout_reward']:.3f} | {_gap(r, 'heldout')} | {r['heldout_greedy_accuracy']:.3f} | "
            f"{_gap(r, 'greedy')} | {r['wall_seconds']:.0f} | {(str(p['speedup']) + 'x') if p.get('speedup') else '-'} "
            f"| {p.get('avg', '-')} |"
        )
    epochs = len(rows[0]["epoch_generated_tokens"])
    lines += [
        "",
        "Generated tokens / decode steps per epoch (mean over seeds):",
        "",
        "| setting | " + " | ".join(f"epoch {e + 1}" for e in range(epochs)) + " |",
        "|" + "---|" * (epochs + 1),
    ]
    for r in rows:
        cells = [f"{t:.0f} / {s:.0f}" for t, s in zip(r["epoch_generated_tokens"], r["epoch_decode_steps"])]
        lines.append(f"| {r['setting']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def warnings(rows: list[dict]) -> list[str]:
    """The settings whose runs had no learning signal in some seeds (every group's rewards equal in every epoch)."""
    return [
        f"{r['setting']}: {r['no_signal_seeds']} of {r['seeds']} seed(s) had no learning signal (every group's "
        "rewards equal in every epoch, so the policy never changed)"
        + ("; its gaps are not shown" if r["no_signal"] else "")
        for r in rows
        if r["no_signal_seeds"]
    ]


def plot(results: dict[str, list[dict]], rows: list[dict], path: Path) -> Path:
    """Held-out reward against cumulative generated tokens, one curve per setting (means over seeds); the bar at a
    curve's end is its paired 95% interval, placed on vanilla's final reward."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    base = rows[0]["heldout_reward"]  # vanilla's
    for row, (name, runs) in zip(rows, results.items()):
        points = list(zip(*(r["curve"] for r in runs)))  # per evaluation, one (tokens, reward) per seed
        xs = [statistics.fmean(t for t, _ in p) for p in points]
        ys = [statistics.fmean(v for _, v in p) for p in points]
        (line,) = ax.plot(xs, ys, marker="o", label=name)
        if not math.isnan(row["heldout_low"]):
            bar = [[row["heldout_gap"] - row["heldout_low"]], [row["heldout_high"] - row["heldout_gap"]]]
            ax.errorbar([xs[-1]], [base + row["heldout_gap"]], yerr=bar, color=line.get_color(), capsize=4)
    ax.set_xlabel("cumulative generated tokens")
    ax.set_ylabel("held-out reward")
    ax.set_title("held-out reward against generation spent (mean over seeds; bars: paired 95%)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run_sweep(sweep: Sweep, progress: bool = True) -> list[dict]:
    """Train every (setting, seed) not finished yet, then write sweep.json, report.md and sweep.png into the output
    folder; returns the table's rows. A killed sweep rerun continues: finished runs are read, an unfinished run
    resumes from its last checkpoint."""
    from tqdm.auto import tqdm

    from .run import run_modes

    out = Path(sweep.out_dir)
    epochs = sweep.config.epochs
    todo = [(name, k) for k in range(sweep.seeds) for name in sweep.settings]  # seed-major: pairs finish together
    bar = tqdm(total=len(todo), desc="sweep runs", unit="run", disable=not progress)
    results: dict[str, list[dict]] = {name: [None] * sweep.seeds for name in sweep.settings}
    warm_start: dict[int, dict] = {}  # per seed: the epoch-0 evaluation, the same for every setting
    for name, k in todo:
        run_dir = out / name / f"seed{k}"
        bar.set_postfix_str(f"{name} seed {k}")
        if _finished(run_dir, name, epochs):
            remove_leftovers(run_dir)  # a writer killed after the summary was committed
        else:
            cfg = dataclasses.replace(sweep.config, seed=sweep.config.seed + k)
            with contextlib.redirect_stdout(io.StringIO()):  # the per-epoch rows of each run
                run_modes(
                    sweep.model_path,
                    sweep.train_examples,
                    sweep.reward_fn,
                    cfg,
                    {name: sweep.settings[name]},
                    run_dir,
                    sweep.eval_examples,
                    resume=bool(run_contents(run_dir)),
                    progress=False,
                    warm_start_eval=warm_start.get(k),
                )
        records = read_summary(run_dir)[name]
        start = start_point(records)
        if start is not None:
            warm_start.setdefault(k, {f: v for f, v in start.items() if f != "epoch"})
        results[name][k] = run_totals(records)
        bar.update(1)
    bar.close()
    rows = aggregate(results)
    info = {**_info(sweep.config), **sweep.info, "seeds": sweep.seeds, "warnings": warnings(rows)}
    payload = {"info": info, "rows": rows, "runs": results}
    atomic_write_text(out / "sweep.json", json.dumps(_null_nan(payload), indent=2, default=str, allow_nan=False))
    atomic_write_text(out / "report.md", markdown(rows, info))
    plot(results, rows, out / "sweep.png")
    return rows


def _null_nan(value):
    """``value`` with every NaN (not measured) or infinity as None: strict JSON, which has neither."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _null_nan(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_null_nan(v) for v in value]
    return value


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


def _info(config) -> dict:
    import platform

    from .run import package_versions

    return {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "commit": _commit(),
        "device": f"{config.device} ({platform.machine()}, {torch.get_num_threads()} threads)",
        "versions": package_versions(),
        "config": config.to_dict(),
    }
