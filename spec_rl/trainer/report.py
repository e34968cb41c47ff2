"""Run reports (summary.json, run_info.json, report.md, report.png): each run's cost and quality against vanilla.

Rollout time follows the sequential decode steps, so token and decode-step ratios are both shown. Runs are compared on
held-out numbers; the rollout reward, biased upward under reuse, is only shown split by response origin."""

from __future__ import annotations

import json
from pathlib import Path

from ..acceptance.mode import VANILLA, RolloutMode
from ..rollout.reward_split import ORIGINS
from ..util.atomic import atomic_write_text
from .correction import weight_stats
from .heldout import heldout_curve, start_point
from .records import mean_or_none
from .report_plot import plot

# Columns printed per epoch (key, header, format).
EPOCH_COLUMNS = (
    ("epoch", "epoch", "{:d}"),
    ("heldout_reward", "held-out", "{:.3f}"),
    ("heldout_greedy_accuracy", "greedy", "{:.3f}"),
    ("heldout_entropy", "entropy", "{:.3f}"),
    ("heldout_kl_to_init", "KL to init", "{:.4f}"),
    ("heldout_response_tokens", "resp len", "{:.1f}"),
    ("mean_reward", "rollout reward", "{:.3f}"),
    ("generated_tokens", "gen tokens", "{:d}"),
    ("reused_tokens", "reused tokens", "{:d}"),
    ("full_reuse_ratio", "full reuse", "{:.2f}"),
    ("decode_steps", "decode steps", "{:d}"),
    ("longest_continuation", "longest", "{:d}"),
    ("rollout_seconds", "rollout s", "{:.1f}"),
    ("scoring_seconds", "scoring s", "{:.1f}"),
    ("heldout_seconds", "eval s", "{:.1f}"),
)
#: The cost ratios to vanilla (``<key>_ratio``), per epoch and summed.
_RATIOS = ("generated_tokens", "decode_steps", "rollout_seconds")
#: Summed over epochs for the run-level ratios.
_TOTALS = (*_RATIOS, "scoring_seconds", "generation_seconds", "other_seconds", "reused_tokens", "draft_tokens")
#: Columns of the comparison tables (key, header, format); n/a where there is no value.
_RATIO_COLUMNS = (
    ("generated_tokens_ratio", "tokens ratio", ".3f"),
    ("decode_steps_ratio", "decode steps ratio", ".3f"),
    ("rollout_seconds_ratio", "rollout time ratio", ".3f"),
)
_TOTAL_COLUMNS = (
    *_RATIO_COLUMNS,
    ("scoring_seconds", "scoring s", ".2f"),
    ("generation_seconds", "decode s", ".2f"),
    ("other_seconds", "other s", ".2f"),
    ("scoring_share", "scoring / vanilla rollout", ".1%"),
    ("accepted_share", "accepted share of draft tokens", ".1%"),
    ("reused_drift", "drift of reused tokens (nats)", ".3g"),
    ("is_mean", "IS weight mean", ".3f"),
    ("is_ess", "IS ESS", ".3f"),
    ("is_corrected_share", "IS weights past threshold", ".2%"),
    ("final_heldout_reward_minus_vanilla", "final held-out reward - vanilla", "+.3f"),
    ("final_greedy_accuracy_minus_vanilla", "final greedy accuracy - vanilla", "+.3f"),
)
_EPOCH_VERSUS = (
    *_RATIO_COLUMNS,
    ("heldout_reward_minus_vanilla", "held-out reward - vanilla", "+.3f"),
    ("greedy_accuracy_minus_vanilla", "greedy accuracy - vanilla", "+.3f"),
)
#: The quality gaps to vanilla: (name, record key); the rollout reward's gap is biased under reuse.
_GAPS = (
    ("reward_minus_vanilla", "mean_reward"),
    ("heldout_reward_minus_vanilla", "heldout_reward"),
    ("greedy_accuracy_minus_vanilla", "heldout_greedy_accuracy"),
)


def _cell(rec: dict, key: str, fmt: str) -> str:
    value = rec.get(key)
    if value is None:  # not measured (no held-out set, the epoch-0 row)
        return "-"
    return fmt.format(int(value) if fmt.endswith("d}") else value)


def format_row(mode: str, rec: dict) -> str:
    """One aligned text row for the console."""
    cells = [f"{mode:>8}"] + [_cell(rec, key, fmt).rjust(max(len(h), 8)) for key, h, fmt in EPOCH_COLUMNS]
    return " | ".join(cells)


def header_row() -> str:
    return " | ".join([f"{'mode':>8}"] + [h.rjust(max(len(h), 8)) for _, h, _ in EPOCH_COLUMNS])


def _table(head: list[str], rows) -> list[str]:
    """A markdown table: the header, its separator and one line per row of cells."""
    lines = ["| " + " | ".join(cells) + " |" for cells in [head, *rows]]
    return [lines[0], "|" + "---|" * len(head), *lines[1:]]


def markdown_table(summary: dict[str, list[dict]]) -> str:
    """The per-epoch table of report.md, each run's warm-start evaluation as its epoch-0 row."""
    rows = [
        [mode] + [_cell(rec, k, fmt) for k, _, fmt in EPOCH_COLUMNS]
        for mode, records in summary.items()
        for rec in filter(None, [start_point(records), *records])
    ]
    return "\n".join(_table(["mode"] + [h for _, h, _ in EPOCH_COLUMNS], rows))


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def _minus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def _versus(rec: dict, v: dict, prefix: str = "") -> dict:
    """The gaps of :data:`_GAPS` between ``rec`` and vanilla's ``v`` (None where either lacks the number)."""
    return {prefix + name: _minus(rec.get(key), v.get(key)) for name, key in _GAPS}


def _ratios(rec: dict, base: dict) -> dict:
    """``<key>_ratio`` for each cost of :data:`_RATIOS`: ``rec``'s over vanilla's ``base`` (None where it is 0)."""
    return {f"{k}_ratio": _ratio(rec.get(k, 0), base.get(k, 0)) for k in _RATIOS}


def comparison(summary: dict[str, list[dict]]) -> list[dict]:
    """Per epoch, each run against plain vanilla: token, decode-step and rollout-time ratios and held-out gaps (None
    without evaluation); ``reward_minus_vanilla``, the rollout reward's gap, is biased under reuse."""
    base = {r["epoch"]: r for r in summary.get(VANILLA, [])}
    return [
        {
            "mode": mode,
            "epoch": rec["epoch"],
            "no_signal": bool(rec.get("no_signal")),
            **_ratios(rec, v),
            **_versus(rec, v),
        }
        for mode, records in summary.items()
        if mode != VANILLA
        for rec in records
        if (v := base.get(rec["epoch"])) is not None
    ]


def _final_quality(records: list[dict], vanilla: dict[int, dict]) -> dict:
    """Rollout and held-out numbers of the last epoch this run shares with vanilla, and their gaps (None: none)."""
    last = ([r for r in records if r["epoch"] in vanilla] or [{}])[-1]
    return {
        "final_epoch": last.get("epoch"),
        "final_heldout_reward": last.get("heldout_reward"),
        "final_heldout_greedy_accuracy": last.get("heldout_greedy_accuracy"),
        **_versus(last, vanilla.get(last.get("epoch"), {}), "final_"),
    }


def run_ratios(summary: dict[str, list[dict]], from_epoch: int = 2) -> list[dict]:
    """Each run (vanilla included) against vanilla over epochs >= ``from_epoch`` summed (epoch 1 has no drafts):
    totals, ``*_ratio``, ``scoring_share`` and the held-out gaps at ``final_epoch``; [] without vanilla."""
    if VANILLA not in summary:
        return []
    epochs = {r["epoch"] for r in summary[VANILLA] if r["epoch"] >= from_epoch}

    def total(records: list[dict]) -> dict:
        return {k: sum(r.get(k, 0) for r in records if r["epoch"] in epochs) for k in _TOTALS}

    base = total(summary[VANILLA])
    vanilla = {r["epoch"]: r for r in summary[VANILLA]}
    out = []
    for mode, records in summary.items():
        t = total(records)
        out.append(
            {
                "mode": mode,
                **t,
                **_ratios(t, base),
                "scoring_share": _ratio(t["scoring_seconds"], base["rollout_seconds"]),
                # the policy-change context of the ratios: the share of draft tokens accepted, and how far the policy
                # had moved on the tokens it reused (mean |lp_new - lp_old|, nats)
                "accepted_share": _ratio(t["reused_tokens"], t["draft_tokens"]),
                "reused_drift": mean_or_none([r.get("reused_drift") for r in records if r["epoch"] in epochs]),
                # importance weights pi_old / pi_behaviour of the response tokens (docs/design.md "Rollout correction")
                **weight_stats(r for r in records if r["epoch"] in epochs),
                "no_signal_epochs": [r["epoch"] for r in records if r.get("no_signal")],
                **_final_quality(records, vanilla),
                "epochs": sorted(epochs),
            }
        )
    return out


def _fmt(x: float | None, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def heldout_progress(mode: str, records: list[dict]) -> str | None:
    """ "<mode>: held-out reward a -> b, greedy accuracy c -> d (epochs 0 -> E, N prompts)", or None."""
    curve = heldout_curve(records)
    if not curve:
        return None
    first, last = curve[0], curve[-1]
    return (
        f"{mode}: held-out reward {first['heldout_reward']:.3f} -> {last['heldout_reward']:.3f}, greedy accuracy "
        f"{first['heldout_greedy_accuracy']:.3f} -> {last['heldout_greedy_accuracy']:.3f} (epochs {first['epoch']} -> "
        f"{last['epoch']}, {last.get('heldout_prompts', '?')} held-out prompts)"
    )


def _final_heldout_text(r: dict) -> str:
    if r["final_heldout_reward"] is None:
        return "held-out: not evaluated (--no-eval, or no held-out set)"
    return (
        f"final held-out reward {r['final_heldout_reward']:.3f} "
        f"({_fmt(r['final_heldout_reward_minus_vanilla'], '+.3f')} "
        f"vs vanilla), greedy accuracy {r['final_heldout_greedy_accuracy']:.3f} "
        f"({_fmt(r['final_greedy_accuracy_minus_vanilla'], '+.3f')})"
    )


def closing_lines(summary: dict[str, list[dict]], from_epoch: int = 2) -> list[str]:
    """Console summary: vanilla's held-out progress, then each run against vanilla (held-out numbers, rollout cost)."""
    shown = {VANILLA: summary[VANILLA]} if VANILLA in summary else summary  # without vanilla: no ratios
    lines = [line for mode, recs in shown.items() if (line := heldout_progress(mode, recs)) is not None]
    for r in run_ratios(summary, from_epoch):
        if r["mode"] == VANILLA:
            continue
        flat = _flat_epochs(r)
        if not r["epochs"]:  # e.g. a one-epoch run: no drafts yet, nothing to compare
            cost = f"{r['mode']}/vanilla: no epoch >= {from_epoch} to compare (the first epoch has no drafts)"
        elif len(flat) == len(r["epochs"]):  # an unchanged policy reuses everything: no speed-up to report
            cost = (
                f"{r['mode']}/vanilla, epochs {from_epoch}+: ratios withheld: no learning signal in epoch(s) "
                f"{', '.join(map(str, flat))}, so the policy did not change and its drafts were reused under the "
                "policy that made them"
            )
        else:
            cost = (
                f"{r['mode']}/vanilla, epochs {from_epoch}+{_no_signal_mark(flat)}: "
                f"generated tokens {_fmt(r['generated_tokens_ratio'], '.2f')}x, "
                f"decode steps {_fmt(r['decode_steps_ratio'], '.2f')}x, "
                f"rollout time {_fmt(r['rollout_seconds_ratio'], '.2f')}x "
                f"(scoring {_fmt(r['scoring_share'], '.0%')} of vanilla's rollout) {_context_text(r)}"
            )
        lines.append(f"{cost}; {_final_heldout_text(r)}")
    return no_signal_lines(summary) + lines


def _flat_epochs(r: dict) -> list[int]:
    """The compared epochs of a :func:`run_ratios` row that had no learning signal."""
    return [e for e in r["epochs"] if e in r["no_signal_epochs"]]


def _no_signal_mark(epochs: list[int]) -> str:
    """The mark of rows and lines whose epochs include some without learning signal."""
    return f" (no learning signal in epoch(s) {', '.join(map(str, epochs))})" if epochs else ""


def _context_text(r: dict) -> str:
    """The policy change behind a run's ratios: accepted share of draft tokens and drift of the reused ones."""
    if r["accepted_share"] is None:
        return "at no draft reuse"
    if r["reused_drift"] is None:
        return f"at {r['accepted_share']:.0%} of draft tokens accepted (drift not measured by this rule)"
    return (
        f"at {r['accepted_share']:.0%} of draft tokens accepted, policy drift "
        f"{_fmt(r['reused_drift'], '.2g')} nats/token on the reused ones"
    )


def no_signal_lines(summary: dict[str, list[dict]]) -> list[str]:
    """A warning per run with epochs whose groups all had equal rewards (no learning signal; the policy did not
    change, so reuse ratios there describe an unchanged policy)."""
    return [
        f"WARNING: {mode}: no learning signal in epoch(s) {', '.join(map(str, flat))} of {len(records)}: "
        "every group's rewards were equal, every advantage 0, and the policy did not change; "
        "ratios over such epochs measure reuse under an unchanged policy"
        for mode, records in summary.items()
        if (flat := [r["epoch"] for r in records if r.get("no_signal")])
    ]


def _origin_markdown(summary: dict[str, list[dict]]) -> list[str]:
    """The rollout reward of each epoch split by response origin, beside the held-out reward."""
    heads = [f"{o.replace('_', ' ')} (n)" for o in ORIGINS]
    rows = [
        [
            mode,
            str(rec["epoch"]),
            f"{rec['mean_reward']:.3f}",
            *(f"{_fmt(rec.get(f'reward_{o}'), '.3f')} ({rec.get(f'count_{o}', 0)})" for o in ORIGINS),
            _fmt(rec.get("heldout_reward"), ".3f"),
        ]
        for mode, records in summary.items()
        for rec in records
    ]
    return [
        "## Rollout reward by response origin",
        "",
        "With lenient acceptance the rollout reward is biased upward: a draft survives the test when the policy "
        "still likes it, and it likes responses that were rewarded, so responses reused whole lean towards ones "
        "that were already correct. With exact acceptance every response is a fresh sample of the policy, so the "
        "total is unbiased although the origins differ in reward. Compare runs on the held-out reward.",
        "",
        *_table(["run", "epoch", "rollout reward", *heads, "held-out reward"], rows),
        "",
    ]


def _cells(row: dict, columns) -> list[str]:
    return [_fmt(row[key], spec) for key, _, spec in columns]


def _comparison_markdown(summary: dict[str, list[dict]]) -> list[str]:
    """Each run against vanilla: the costs and final gaps over epochs 2+ summed, then the ratios and gaps per epoch."""
    lines = []
    totals = run_ratios(summary)
    if totals:
        rows = [[r["mode"] + _no_signal_mark(_flat_epochs(r)), *_cells(r, _TOTAL_COLUMNS)] for r in totals]
        table = _table(["run", *(h for _, h, _ in _TOTAL_COLUMNS)], rows)
        lines += ["## Relative to plain vanilla, epochs 2+ summed", "", *table, ""]
    per_epoch = comparison(summary)
    if per_epoch:
        rows = [
            [c["mode"], f"{c['epoch']}{' (no learning signal)' if c['no_signal'] else ''}", *_cells(c, _EPOCH_VERSUS)]
            for c in per_epoch
        ]
        table = _table(["run", "epoch", *(h for _, h, _ in _EPOCH_VERSUS)], rows)
        lines += ["## Per epoch, relative to plain vanilla", "", *table, ""]
    return lines


def _evaluated_after(records: list[dict], epochs) -> str:
    """When a run was evaluated: "the last epoch", or e.g. "epochs 3 and 5" after a resume extended it."""
    done = [r["epoch"] for r in records if r.get("heldout_reward") is not None]
    if not done or done == [epochs]:
        return "the last epoch"
    return f"epoch {done[0]}" if len(done) == 1 else f"epochs {', '.join(map(str, done[:-1]))} and {done[-1]}"


def _heldout_note(info: dict, summary: dict | None = None) -> list[str]:
    prompts = info.get("eval_prompts") or 0
    if not prompts:
        return [
            "No held-out evaluation (--no-eval, or no held-out set): "
            "the rollout reward above is biased under reuse and does not compare runs.",
            "",
        ]
    # the lossless runs beside vanilla have eval_every = epochs (run_configs)
    configs = list((info.get("runs") or {}).values())
    samples = configs[0].get("eval_samples", "?") if configs else "?"
    every = min((c.get("eval_every", 1) for c in configs), default=1)
    epochs = max((c.get("epochs", 0) for c in configs), default=0) or None
    when = "every epoch" if every == 1 else f"every {every} epochs and after the last"
    changes = [c for c in info.get("config_changes") or [] if c.get("field") == "eval_every"]
    if changes:  # a resume under --allow-config-change: the schedule above holds only from then on
        steps = ", then ".join(f"{c.get('old')} -> {c.get('new')}" for c in changes)
        when += f" (eval_every changed on resume: {steps}; the tables show which epochs were evaluated)"
    last_only = [m for m, c in (info.get("runs") or {}).items() if epochs and c.get("eval_every", 1) >= epochs > every]
    produce, are = ("produce", "are") if len(last_only) > 1 else ("produces", "is")
    after = sorted({_evaluated_after((summary or {}).get(m, []), epochs) for m in last_only})
    lossless = ""
    if last_only:
        lossless = (
            f" {' and '.join(last_only)} {produce} vanilla's responses token for token and, beside vanilla, {are} "
            f"evaluated at the warm start and after {' / '.join(after)} only."
        )
    return [
        f"Held-out evaluation: {prompts} prompts not trained on, {samples} fresh sample(s) each with the training "
        f"sampling settings (`held-out`) and one greedy response (`greedy`), before training (epoch 0) and after "
        f"{when}, with the same seed in every run; never from the rollout cache.{lossless}",
        "",
    ]


def _rule_notes(info: dict) -> list[str]:
    """What the rules of the runs say about themselves in a report (e.g. the lenient rule's draw at a rejection)."""
    modes = [RolloutMode.from_dict(c.get("mode", {})) for c in info.get("runs", {}).values()]
    return list(dict.fromkeys(n for m in modes if m.rule is not None and (n := m.rule.note()) is not None))


def write_report(
    run_dir: str | Path, summary: dict[str, list[dict]], info: dict, plot_png: bool = True
) -> dict[str, Path]:
    """Write summary.json, run_info.json, report.md and report.png (each atomically) into ``run_dir``;
    ``plot_png=False`` keeps the report.png already there (the plot is the slow part)."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    versions = info.get("versions", {})
    stored = {"versions": versions, "warnings": no_signal_lines(summary), "runs": summary}
    atomic_write_text(run_dir / "summary.json", json.dumps(stored, indent=2))
    atomic_write_text(run_dir / "run_info.json", json.dumps(info, indent=2, default=str))
    png = plot(run_dir, summary) if plot_png else None
    if png is None and not plot_png and (run_dir / "report.png").is_file():
        png = run_dir / "report.png"
    lines = [
        "# spec-rl run report",
        "",
        f"Model: `{info.get('model')}`; device: {info.get('device')}; runs: "
        + ", ".join(f"{m} ({RolloutMode.from_dict(r[0]).describe() if r else '?'})" for m, r in summary.items())
        + ".",
        "",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()) + ".",
        "",
        *[f"**{line}**\n" for line in no_signal_lines(summary)],
        *_heldout_note(info, summary),
        "## Per-epoch results",
        "",
        markdown_table(summary),
        "",
    ]
    lines += _comparison_markdown(summary)
    lines += _origin_markdown(summary)
    if png is not None:
        lines += [
            "![held-out reward per epoch; reward, generated tokens, decode steps and rollout time per step]"
            "(report.png)",
            "",
        ]
    for note in _rule_notes(info):
        lines += [note, ""]
    md = atomic_write_text(run_dir / "report.md", "\n".join(lines))
    out = {"summary": run_dir / "summary.json", "report": md}
    if png is not None:
        out["plot"] = png
    return out
