"""The step-cost model on this device: its table, the widths it picks, and what it buys against the alternatives.

    python benchmarks/bench_step_cost.py [--preset demo|qwen3-0.6b|tiny] [--backend auto|transformers|paged]

Tail speculation verifies drafted tokens in wider decode steps; :mod:`spec_rl.backends.step_cost` decides how
wide from a measured table of forward seconds t(rows, fed tokens per row). This script shows that table and
its decisions on one device, in three parts:

1. **the table**, measured fresh (not read from the disk cache) at a short and a long context (cached
   positions per row): seconds per step, and each width's cost relative to a plain one-token step at the same
   rows and context (near 1 where decoding is memory-bound, e.g. a GPU, or the context long; near the width
   where it is compute-bound, e.g. this project's 2-core CPU at short contexts);
2. **the plan**: the width :func:`~spec_rl.backends.step_cost.plan_proposals` chooses at each context and
   measured row count when every row offers ``max_k`` tokens, per per-token acceptance 0.3 / 0.5 / 0.7 / 0.9;
3. **rollouts under four policies**, one backend: ``plain`` (no speculation: width 1), ``flat``
   (:meth:`StepCost.flat`: verify every proposed token, the widest steps), ``measured`` (the table as measured)
   and ``corrected`` (the table corrected by the loop's own steps, :mod:`spec_rl.backends.step_correction`, off
   by default in a backend; a fresh correction each run, so it learns within one rollout), in
   two settings: ``e1-siblings`` (epoch 1, drafts only from the prompt and the group's samples in flight,
   where speculation often does not pay) and ``histspec`` (a history of ``--history-epochs`` vanilla epochs,
   the policy perturbed by ``--perturb``). The policies run in turn ``--repeats`` times; each row keeps its
   fastest run (the decisions are keyed: every repeat decodes the same tokens; the corrected policy's steps
   depend on the times it reads, so they may differ between repeats).

The measured and corrected policies should be at least as fast as the better of plain and flat in each
setting (they may only lose by the table's error); ``wide x`` is the corrected policy's learned price of a
wide step relative to the table's, per batch-size bucket; ``time x`` is the ratio to ``plain`` of the same setting. Tokens are identical
under every policy (the width changes the steps, never a token): ``same tokens`` checks it.
Stage 6b of ``benchmarks/gpu_check.sh`` runs this at the Qwen3-0.6B shape. JSON: ``--json`` (default
``$OUT/step_cost.json``), rewritten after every row.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile

import torch
from _harness import Column, RunRecord, Table, default_json_path, provenance, run_recorded  # benchmarks/ on sys.path
from bench_rollout import RESPONSES, add_rollout_arguments, perturb, rollout_device, rollout_setup, timed_step

from spec_rl.backends.step_cost import MEASURED_CONTEXTS, MEASURED_WIDTHS, StepCost, plan_proposals
from spec_rl.drafts.cache import RolloutCache
from spec_rl.drafts.history import HistoryIndex
from spec_rl.rollout.speculative import SpeculativeRollout

POLICIES = ("plain", "flat", "measured", "corrected")
ACCEPTANCES = (0.3, 0.5, 0.7, 0.9)


def measure_table(backend) -> StepCost:
    """The backend's step-cost table measured now: the disk cache is pointed at an empty folder meanwhile,
    and ``SPEC_RL_STEP_COST=flat`` (which skips measuring) is ignored."""
    saved = {k: os.environ.pop(k, None) for k in ("SPEC_RL_CACHE", "SPEC_RL_STEP_COST")}
    try:
        with tempfile.TemporaryDirectory() as folder:
            os.environ["SPEC_RL_CACHE"] = folder
            backend.set_step_cost(None)
            return backend.step_cost()
    finally:
        for key, value in saved.items():
            os.environ.pop(key, None)
            if value is not None:
                os.environ[key] = value


def table_contexts(cost: StepCost) -> tuple[int, ...]:
    """The cached positions per row the table is shown at: where it was measured (one or two contexts)."""
    return (cost.context, MEASURED_CONTEXTS[-1]) if cost.per_position else (cost.context,)


def table_rows(cost: StepCost) -> list[dict]:
    """Per context and measured row count: ms per step at each width, and each width's cost relative to width 1."""
    out = []
    for context in table_contexts(cost):
        for r in cost.rows:
            secs = [cost(r, r * w, context) for w in cost.widths]
            out.append({"context": context, "rows": r, "ms": [s * 1e3 for s in secs], "relative": [s / secs[0] for s in secs]})
    return out


def plan_rows(cost: StepCost, max_k: int, padded: bool) -> list[dict]:
    """The mean fed width the plan picks per (context, rows, acceptance) when every row offers ``max_k`` tokens."""
    out = []
    for context in table_contexts(cost):
        for rows in cost.rows:
            widths = []
            for a in ACCEPTANCES:
                plan = plan_proposals([[0] * max_k] * rows, [a] * rows, cost, padded=padded, context=context)
                widths.append(1 + sum(len(p) for p in plan) / rows)
            out.append({"context": context, "rows": rows, "width": widths})
    return out


def rollout_rows(args, backend, measured: StepCost, requests, settings, eos, max_len, rec: RunRecord) -> None:
    """Part 3 (module docstring): each setting under each policy, fastest of ``args.repeats``."""
    setups = {"e1-siblings": (RolloutCache(), HistoryIndex(), True, 0)}  # name: (cache, history, siblings, step)
    rows = rec.record["rows"]
    for name in ("e1-siblings", "histspec"):
        if name == "histspec":  # fill the drafts' history with vanilla epochs, then move the policy
            backend.set_step_cost(measured)
            cache, history = RolloutCache(), HistoryIndex()
            filler = SpeculativeRollout(backend, cache, settings, eos, max_len, strategy="off", seed=args.seed, history=history)
            for step in range(args.history_epochs):
                filler.run(requests, step)
            perturb(backend.model, args.perturb)
            setups[name] = (cache, history, False, args.history_epochs)
        base_cache, base_history, siblings, step = setups[name]
        tokens = {}
        for _ in range(args.repeats):
            for policy in POLICIES:
                backend.set_step_cost(StepCost.flat() if policy == "flat" else measured, corrected=policy == "corrected")
                ro = SpeculativeRollout(backend, copy.deepcopy(base_cache), settings, eos, max_len, strategy="off",
                                        seed=args.seed, history=None if policy == "plain" else copy.deepcopy(base_history),
                                        sibling_drafts=siblings and policy != "plain")  # fmt: skip
                row = timed_step(ro, requests, step, torch.device(rec.record["device_type"]))
                tokens[policy] = row.pop(RESPONSES)
                correction = backend.step_correction() if policy == "corrected" else None
                row["wide_factor"] = correction.factors() if correction is not None else {}
                key = f"{name}/{policy}"
                if key not in rows or row["rollout_s"] < rows[key]["rollout_s"]:
                    rows[key] = {k: row[k] for k in ("generated_tokens", "decode_steps", "rollout_s", "decode_s",
                                                      "positions", "accepted_per_step", "width", "wide_factor")}  # fmt: skip
                    rec.save()
        plain = rows[f"{name}/plain"]
        for policy in POLICIES:
            rows[f"{name}/{policy}"]["time_x"] = rows[f"{name}/{policy}"]["rollout_s"] / plain["rollout_s"]
            rows[f"{name}/{policy}"]["same_tokens"] = tokens[policy] == tokens["plain"]
            if tokens[policy] != tokens["plain"] and torch.finfo(next(backend.model.parameters()).dtype).bits == 64:
                rec.fail(f"{name}/{policy}: tokens differ from plain decoding in float64")
        rec.save()


def run(args, rec: RunRecord) -> None:
    backend, requests, settings, eos, max_len = rollout_setup(args, rec)
    measured = measure_table(backend)
    padded = rec.record["backend"] == "TransformersBackend"
    rec.record.update(widths=list(MEASURED_WIDTHS), acceptances=list(ACCEPTANCES), padded=padded,
                      table=table_rows(measured), plan=plan_rows(measured, int(backend.max_k), padded))  # fmt: skip
    rec.save()
    print_table_and_plan(rec.record)
    rollout_rows(args, backend, measured, requests, settings, eos, max_len, rec)


def print_table_and_plan(record: dict) -> None:
    widths = record["widths"]
    print(f"step cost ({record['backend']}, {record.get('device')}): ms per decode step [relative to width 1]")
    print("context rows  " + "  ".join(f"w={w:<12}" for w in widths))
    for r in record["table"]:
        print(f"{r['context']:<7} {r['rows']:<5} " + "  ".join(f"{m:7.2f} [{x:4.2f}]" for m, x in zip(r["ms"], r["relative"])))
    print(f"plan ({'padded' if record['padded'] else 'packed'}): mean fed width per row, every row offering max_k tokens")
    print("context rows  " + "  ".join(f"a={a:<5}" for a in record["acceptances"]))
    for r in record["plan"]:
        print(f"{r['context']:<7} {r['rows']:<5} " + "  ".join(f"{w:7.2f}" for w in r["width"]))


def _bucket_rows(bucket: int) -> str:
    """The live rows of a StepCorrection bucket (rows.bit_length() // 2 == bucket), as "lo-hi"."""
    return "1" if bucket == 0 else f"{2 ** (2 * bucket - 1)}-{2 ** (2 * bucket + 1) - 1}"


def print_rollouts(record: dict) -> None:
    spec = [("setting/policy", 20, "<", "{}"), ("gen tokens", 10, ">", "{:d}"), ("steps", 6, ">", "{:d}"),
            ("positions", 9, ">", "{:d}"), ("width", 5, ">", "{:.2f}"), ("acc/step", 8, ">", "{:.2f}"),
            ("rollout s", 9, ">", "{:.3f}"), ("decode s", 8, ">", "{:.3f}"), ("time x", 6, ">", "{:.3f}")]  # fmt: skip
    table = Table(*[Column(h, w, a, f, gap="  ") for h, w, a, f in spec])
    print(f"rollouts: preset {record['preset']} ({record['prompts']} prompts x G={record['group']}, "
          f"{record['max_tokens']} tokens), fastest of {record['repeats']}, commit {record.get('commit')}")
    print(table.header())
    for name, r in record["rows"].items():
        print(table.row(name, r["generated_tokens"], r["decode_steps"], r["positions"], r["width"],
                        r["accepted_per_step"], r["rollout_s"], r["decode_s"], r.get("time_x", float("nan"))))
    for name, r in record["rows"].items():
        if r.get("wide_factor"):
            buckets = ", ".join(f"{_bucket_rows(int(b))} rows {f:.2f}" for b, f in r["wide_factor"].items())
            print(f"{name}: wide x {buckets}")
    same = all(r.get("same_tokens", True) for r in record["rows"].values())
    print(f"same tokens under every policy: {same}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_rollout_arguments(ap)
    ap.add_argument("--repeats", type=int, default=3, help="runs per (setting, policy); the fastest is kept")
    ap.add_argument("--json", default=default_json_path("step_cost.json"))
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    device = rollout_device(ap, args, "bench_step_cost")
    if device is None:
        return 0
    record = {"preset": args.preset, "perturb": args.perturb, "history_epochs": args.history_epochs,
              "repeats": args.repeats, "device_type": device.type, "rows": {}, **provenance(device)}  # fmt: skip
    rec = RunRecord(args.json, record)
    return run_recorded(rec, lambda: run(args, rec), print_rollouts)


if __name__ == "__main__":
    sys.exit(main())
