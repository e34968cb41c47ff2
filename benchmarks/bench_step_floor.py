"""What the trainer's rollouts would take if every decode step cost only its bare forward: a floor per mode.

    python benchmarks/bench_step_floor.py [--keep DIR] [--json FILE] [spec-rl train arguments ...]

Runs ``spec-rl train`` (default: the offline demo, held-out evaluation off) with every decode step of the
transformers backend's loop (:class:`~spec_rl.backends.hf_decode.SpeculativeDecoder`) timed: live rows, fed
tokens per row, cached columns, seconds (proposals, forward, keyed samples, rollback and compaction). Each
step is then priced by the backend's step-cost table (:mod:`spec_rl.backends.step_cost`: a bare forward and
its keyed samples on a prefilled batch, fastest of three rounds). Per mode, over epochs ``--from-epoch``+
(default 2, as the trainer's report), it prints

- ``time x``: rollout seconds over vanilla's, as the trainer's report;
- ``floor x``: (scoring seconds + the table price of the mode's decode steps) / vanilla's measured rollout
  seconds: the mode with a decode loop and bookkeeping that cost nothing, against vanilla as it runs;
- ``table x``: (scoring + table price) / vanilla's table price: both modes at bare-forward prices.

A target ratio below ``floor x`` cannot be met by any saving in the decode loop, the bookkeeping or the
planner's overhead on this device (the planner already picks each step's width by this table); it needs
cheaper forwards of wide steps, i.e. a cost curve where verifying k tokens costs little more than decoding
one (memory-bound decoding, as on a GPU). ``loop x`` is the steps' measured seconds over their table price.

The step log is checked against the trainer's own counters (the rows and positions of the loop's steps, per
rollout, must agree; ``steps`` counts the loop's forwards, not the prefills the trainer's decode steps include); a mismatch fails the run. Steps outside a rollout (held-out evaluation) are not logged.
JSON: ``--json`` (default ``$OUT/step_floor.json``). ``--keep DIR`` (a new folder) keeps the run directory (else a
temporary one is removed). The PagedEngine has its own loop: this script times the transformers backend only.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from _harness import Column, RunRecord, Table, default_json_path, provenance, run_recorded  # benchmarks/ on sys.path

from spec_rl.backends.hf_decode import SpeculativeDecoder
from spec_rl.cli import main as spec_rl_main
from spec_rl.rollout.speculative import SpeculativeRollout
from spec_rl.trainer.records import read_step_metrics
from spec_rl.trainer.rundir import read_summary

#: ``spec-rl train`` arguments this script decides itself.
OWN_TRAIN_ARGS = ("--out", "--resume", "--backend")
#: Counters of the decode loop that the step log must reproduce exactly (trainer metrics name -> log field); the
#: trainer's ``decode_steps`` also counts each prefill forward, which is not a step of the loop.
COUNTERS = {"decode_rows": "rows", "decode_positions": "positions"}


class StepLog:
    """Every decode step run inside :meth:`SpeculativeRollout.run`, in order: (rollout call, rows, width,
    cached columns, seconds); ``calls`` holds one (strategy, acceptance) per rollout call."""

    def __init__(self):
        self.calls: list[tuple[str, str]] = []
        self.steps: list[tuple[int, int, int, int, float]] = []
        self.step_cost = None  # the last decoder's table getter (the backend's step_cost)
        self._inside = False

    @contextlib.contextmanager
    def installed(self):
        """Wrap the decode step and the rollout call for the duration (restored on exit, also on errors)."""
        step, run, log = SpeculativeDecoder._step, SpeculativeRollout.run, self

        def timed_step(decoder, kv, rows):
            context, live, start = kv.width, len(rows), time.perf_counter()
            width = step(decoder, kv, rows)
            if log._inside:
                log.steps.append((len(log.calls) - 1, live, width, context, time.perf_counter() - start))
                log.step_cost = decoder.step_cost
            return width

        def logged_run(rollout, *args, **kwargs):
            log.calls.append((rollout.strategy, rollout.acceptance))
            log._inside = True
            try:
                return run(rollout, *args, **kwargs)
            finally:
                log._inside = False

        SpeculativeDecoder._step, SpeculativeRollout.run = timed_step, logged_run
        try:
            yield self
        finally:
            SpeculativeDecoder._step, SpeculativeRollout.run = step, run


def train_arguments(extra: list[str], out: Path) -> list[str]:
    """``spec-rl train`` argv: evaluation and progress bars off, ``out`` as the run directory, the transformers
    backend (the loop this script times), then ``extra``; ``extra`` may not name (or abbreviate, as argparse
    allows) ``--out``, ``--resume`` or ``--backend``, except ``--backend transformers``."""
    for i, arg in enumerate(extra):
        name = arg.split("=")[0]
        own = [flag for flag in OWN_TRAIN_ARGS if len(name) >= 3 and flag.startswith(name)]
        if not own:
            continue
        value = arg.split("=", 1)[1] if "=" in arg else (extra[i + 1] if i + 1 < len(extra) else "")
        if own == ["--backend"] and value == "transformers":
            continue
        raise SystemExit(f"bench_step_floor: {name} is managed by this script (it times the transformers backend's "
                         f"loop in a fresh run directory); use --keep DIR to keep the run")
    return ["train", "--no-eval", "--no-progress", "--backend", "transformers", "--out", str(out), *extra]


def metric_lines(out: Path) -> list[dict]:
    """Every mode's per-step metrics in training order (modes in the order they ran: summary.json's keys)."""
    return [line for mode in read_summary(out) for line in read_step_metrics(out, mode)]


def per_mode(log: StepLog, lines: list[dict], first_epoch: int, rec: RunRecord) -> dict[str, dict]:
    """Sum, per mode over epochs >= ``first_epoch`` (0-based, as in metrics.jsonl), the trainer's seconds and
    the step log's seconds and table prices; fails ``rec`` where the log and the trainer's counters disagree."""
    if len(lines) != len(log.calls):
        raise RuntimeError(f"{len(log.calls)} rollout calls logged but {len(lines)} metrics lines written")
    if not any(line["epoch"] >= first_epoch for line in lines):
        raise RuntimeError(f"no rollout in epoch {first_epoch + 1} or later: train more epochs or lower --from-epoch")
    table = log.step_cost() if log.step_cost is not None else None
    logged = defaultdict(lambda: {"steps": 0, "rows": 0, "positions": 0, "step_s": 0.0, "table_s": 0.0})
    for call, rows, width, context, seconds in log.steps:
        entry = logged[call]
        entry["steps"] += 1
        entry["rows"] += rows
        entry["positions"] += rows * width
        entry["step_s"] += seconds
        entry["table_s"] += table(rows, rows * width, context)
    modes: dict[str, dict] = {}
    for call, (line, strategy) in enumerate(zip(lines, log.calls)):
        if (line["strategy"], line["acceptance"]) != strategy:
            raise RuntimeError(f"rollout call {call} was {strategy}, its metrics line says {(line['strategy'], line['acceptance'])}")
        entry = logged[call]
        for counter, field in COUNTERS.items():
            if line[counter] != entry[field]:
                rec.fail(f"{line['mode']} step {line['step']}: trainer {counter} {line[counter]} != logged {entry[field]}")
        if line["epoch"] < first_epoch:
            continue
        row = modes.setdefault(line["mode"], {"rollouts": 0, "rollout_s": 0.0, "scoring_s": 0.0, **logged.default_factory()})
        row["rollouts"] += 1
        row["rollout_s"] += line["rollout_seconds"]
        row["scoring_s"] += line["scoring_seconds"]
        for key, value in entry.items():
            row[key] += value
    return modes


def add_ratios(modes: dict[str, dict]) -> None:
    """Per mode: loop x, other seconds, and time / floor / table ratios to vanilla (when vanilla ran)."""
    base = modes.get("vanilla")
    for row in modes.values():
        row["loop_x"] = row["step_s"] / row["table_s"] if row["table_s"] else None
        row["other_s"] = row["rollout_s"] - row["scoring_s"] - row["step_s"]
        floor = row["scoring_s"] + row["table_s"]
        row["time_x"] = row["rollout_s"] / base["rollout_s"] if base and base["rollout_s"] else None
        row["floor_x"] = floor / base["rollout_s"] if base and base["rollout_s"] else None
        row["table_x"] = floor / base["table_s"] if base and base["table_s"] else None


TABLE = Table(
    Column("mode", 9, "<"), Column("steps", 6), Column("rows/step", 9, fmt="{:.1f}"), Column("rollout s", 9, fmt="{:.2f}"),
    Column("scoring s", 9, fmt="{:.2f}"), Column("steps s", 8, fmt="{:.2f}"), Column("table s", 8, fmt="{:.2f}"),
    Column("loop x", 6, fmt="{:.2f}"), Column("other s", 7, fmt="{:.2f}"), Column("time x", 6, fmt="{:.3f}"),
    Column("floor x", 7, fmt="{:.3f}"), Column("table x", 7, fmt="{:.3f}"),
)


def report(record: dict) -> None:
    print(f"bench_step_floor: spec-rl {' '.join(record['train_args'])}; epochs {record['from_epoch']}+; commit {record['commit']}")
    print(TABLE.header())
    for mode, r in record["rows"].items():
        print(TABLE.row(mode, r["steps"], r["rows"] / r["steps"] if r["steps"] else None, r["rollout_s"], r["scoring_s"],
                        r["step_s"], r["table_s"], r["loop_x"], r["other_s"], r["time_x"], r["floor_x"], r["table_x"]))  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="Other arguments go to spec-rl train.")
    ap.add_argument("--keep", type=Path, help="run directory to keep (default: a temporary one, removed afterwards)")
    ap.add_argument("--from-epoch", type=int, default=2, help="first epoch (1-based) summed (default 2)")
    ap.add_argument("--json", default=default_json_path("step_floor.json"))
    args, extra = ap.parse_known_args(argv)
    if args.from_epoch < 1:
        ap.error(f"--from-epoch must be >= 1, got {args.from_epoch}")
    if args.keep is not None and args.keep.exists() and (not args.keep.is_dir() or any(args.keep.iterdir())):
        ap.error(f"--keep {args.keep} already exists and is not an empty folder; name a new one")
    with contextlib.ExitStack() as stack:
        out = args.keep or Path(stack.enter_context(tempfile.TemporaryDirectory())) / "run"
        train_args = train_arguments(extra, out)
        rec = RunRecord(args.json, {**provenance(), "train_args": train_args, "from_epoch": args.from_epoch, "rows": {}})

        def work() -> None:
            log = StepLog()
            try:
                with log.installed():
                    code = spec_rl_main(train_args)
            except SystemExit as exc:  # spec-rl's usage errors (printed above): a failed run, not a running one
                code = exc.code
            if code != 0:
                raise RuntimeError(f"spec-rl train exited with {code}")
            modes = per_mode(log, metric_lines(out), args.from_epoch - 1, rec)
            add_ratios(modes)
            rec.record["rows"] = modes
            rec.save()

        code = run_recorded(rec, work, report)
        if args.keep is None:
            print("(the run directory named above was temporary and is removed now; --keep DIR keeps it)")
        return code


if __name__ == "__main__":
    sys.exit(main())
