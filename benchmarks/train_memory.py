"""Resident memory of ``spec-rl train`` on a GSM8K-size dataset (benchmarks/RESULTS.md "Training memory").

Runs ``spec-rl train --model DIR --data <--size distinct problems cycled from --data> --no-eval`` with the flags
after ``--`` (none: the default recipe), samples the resident memory of its process tree every half second and
stops it after ``--steps`` steps: the peak RSS (the samples' and the kernel's high-water mark), the RSS after the
first and the last step, the seconds per step (``--json``, default ``$OUT/train_memory.json``). Exit 1 when the run
fails or ends early. ``--stores-of N``: epoch 2 holding the stores of N prompts (epoch 1 trained, then the drafts and
history of the prompts beyond ``--size`` added to its checkpoint: :func:`grow_stores`). ``--history EPOCHS``: only
tail speculation's history index over ``--size`` prompts x 8 responses of 468 tokens (in-process, no model).
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _harness as H  # benchmarks/ on sys.path


def gsm8k_size(source: Path, size: int, out: Path) -> Path:
    """``size`` GSM8K-format lines cycled from ``source``; the k-th repeat's questions end with " (k)"."""
    rows = [json.loads(line) for line in source.read_text().splitlines() if line.strip()]
    with open(out, "w") as f:
        for i in range(size):
            row = dict(rows[i % len(rows)])
            if i >= len(rows):
                row["question"] = f"{row['question']} ({i // len(rows)})"
            f.write(json.dumps(row) + "\n")
    return out


def tree_rss(proc) -> int:
    """Resident bytes of ``proc`` and its children (0 once it is gone)."""
    import psutil

    try:
        procs = [proc, *proc.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            continue
    return total


def measure(argv: list[str], out: Path, steps: int) -> dict:
    """Run ``spec-rl train`` (``argv``) into ``out`` until ``steps`` steps are logged; its memory and timing."""
    import psutil

    cmd = [sys.executable, "-m", "spec_rl.cli", "train", *argv, "--out", str(out), "--no-progress"]
    if "--resume" in argv:  # this script's own entry: the added prompts' automata are built at load
        cmd[1:4] = [__file__, "--resume-with-automata"]

    def steps_done() -> int:
        return sum(len(p.read_text().splitlines()) for p in out.glob("*/metrics.jsonl"))

    already = steps_done()  # a resumed run's steps before its checkpoint
    log = open(out.parent / f"{out.name}.log", "a")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    watch = psutil.Process(proc.pid)
    peak, at_step, t0, stamps = 0, {}, time.perf_counter(), []
    earlier = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # KiB: the largest of the children waited for
    high_water = 0
    while proc.poll() is None:
        peak = max(peak, rss := tree_rss(watch))
        high_water = max(high_water, H.proc_status_kib("VmHWM", proc.pid) * 1024)
        done = steps_done()
        if done > already and done not in at_step:
            at_step[done] = rss
            stamps.append(time.perf_counter())
            print(f"step {done}: RSS {rss / 1e9:.2f} GB (peak {peak / 1e9:.2f} GB)", flush=True)
        if done >= steps:
            proc.kill()
            break
        time.sleep(0.5)
    proc.wait()
    log.close()
    # The kernel's high-water mark of the train process: a spike between two samples counts too. After its exit the
    # children's mark is its own only where it passed every earlier child's.
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    high_water = max(high_water, children * 1024 if children > earlier else 0)
    done = max(at_step, default=0)
    per_step = (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else None
    return {
        "command": cmd,
        "steps": done,
        "peak_rss_gb": max(peak, high_water) / 1e9,
        "peak_rss_sampled_gb": peak / 1e9,
        "rss_after_first_step_gb": at_step.get(min(at_step, default=0), 0) / 1e9,
        "rss_after_last_step_gb": at_step.get(done, 0) / 1e9,
        "seconds_per_step": per_step,
        "wall_seconds": time.perf_counter() - t0,
        "exit_code": proc.returncode,
    }


def synthetic_key(prompt: int, slot: int | None = None) -> bytes:
    """A 16-byte key of an added prompt (its history) or of one of its slots (its draft)."""
    import hashlib

    return hashlib.blake2b(f"added prompt {prompt} slot {slot}".encode(), digest_size=16).digest()


def grow_stores(run: Path, prompts: int, group: int = 8, epochs: int = 2) -> dict:
    """Add ``prompts`` prompts to the committed checkpoint of ``run`` (a run dir holding one mode): ``group`` drafts
    each and ``epochs`` x ``group`` history responses, copies of its own drafts (so their lengths are real)."""
    from spec_rl.drafts.cache import CacheKey, RolloutCache
    from spec_rl.drafts.history import HistoryIndex
    from spec_rl.trainer.checkpoint import CACHE_FILE, HISTORY_FILE, MARKER, latest_checkpoint

    (mode,) = [d for d in run.iterdir() if d.is_dir()]
    ckpt = latest_checkpoint(mode).path
    cache = RolloutCache.load(ckpt / CACHE_FILE)
    history = HistoryIndex.load(ckpt / HISTORY_FILE) if (ckpt / HISTORY_FILE).is_file() else None  # tail off
    real = cache.drafts()
    for p in range(prompts):
        for slot in range(group):
            d = real[(group * p + slot) % len(real)]
            cache.store(
                CacheKey(synthetic_key(p, slot)),
                d.token_ids,
                d.logprobs,
                d.finish_reason,
                d.version,
                d.settings,
                d.age,
                d.behaviour_logprobs,
            )
        for r in range(epochs * group if history is not None else 0):
            history.add(synthetic_key(p), real[(epochs * group * p + r) % len(real)].token_ids.tolist())
    cache.save(ckpt / CACHE_FILE)
    if history is not None:
        history.save(ckpt / HISTORY_FILE)
    marker = json.loads((ckpt / MARKER).read_text())  # the files' sizes changed
    marker["files"] = {name: (ckpt / name).stat().st_size for name in marker["files"]}
    (ckpt / MARKER).write_text(json.dumps(marker))
    return {
        "drafts": len(cache),
        "draft_tokens": sum(len(d) for d in cache.drafts()),
        "history_tokens": history.num_tokens() if history is not None else 0,
    }


def resume_with_automata(train: list[str]) -> int:
    """``spec-rl train *train`` whose history builds the added prompts' automata up to its bound once the checkpoint
    is loaded: a run over that many prompts builds them as it drafts from them (the least recently used dropped)."""
    from spec_rl.cli import main as cli
    from spec_rl.trainer.grpo import GRPOTrainer

    resume = GRPOTrainer.resume

    def filled(self) -> bool:
        out, built, p = resume(self), 0, 0
        while self.history is not None and built < self.history.max_automaton_tokens:
            automaton = self.history.automaton(synthetic_key(p))
            built, p = built + (len(automaton) if automaton is not None else self.history.max_automaton_tokens), p + 1
        return out

    GRPOTrainer.resume = filled
    return cli(["train", *train])


def history_growth(size: int, epochs: int, max_automaton_tokens: int, group: int = 8, length: int = 468) -> dict:
    """Resident memory of the tail speculation's HistoryIndex as the trainer uses it on ``size`` prompts: each epoch
    every prompt is drafted from (its automaton built from epoch 2 on) and gains ``group`` responses of ``length``
    tokens (synthetic ids, 70% equal to the slot's previous response, as reused drafts are)."""
    import psutil
    import torch

    from spec_rl.drafts.history import HistoryIndex

    rss = psutil.Process().memory_info
    gen = torch.Generator().manual_seed(0)
    index, base = HistoryIndex(max_automaton_tokens=max_automaton_tokens), rss().rss
    previous = torch.randint(0, 49152, (size, group, length), generator=gen, dtype=torch.int32)
    out = {"prompts": size, "group": group, "length": length, "max_automaton_tokens": max_automaton_tokens}
    out.update(rss_gb_after_epoch=[], automaton_tokens=[])
    peak = 0
    for epoch in range(epochs):
        for i in range(size):
            key = i.to_bytes(4, "little")
            if epoch:
                index.proposer(key)
            fresh = torch.randint(0, 49152, (group, length), generator=gen, dtype=torch.int32)
            keep = torch.rand(group, length, generator=gen) < 0.7
            previous[i] = torch.where(keep, previous[i], fresh)
            for r in previous[i]:
                index.add(key, r)
            if i % 500 == 0:
                peak = max(peak, rss().rss)
        peak = max(peak, rss().rss)
        out["rss_gb_after_epoch"].append((rss().rss - base) / 1e9)
        out["automaton_tokens"].append(index.automaton_tokens())
        print(f"epoch {epoch + 1}: +{out['rss_gb_after_epoch'][-1]:.2f} GB", flush=True)
    out.update(indexed_tokens=index.num_tokens(), peak_extra_rss_gb=(peak - base) / 1e9)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--resume-with-automata"]:
        return resume_with_automata(argv[1:])
    ours, train = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    p = H.arguments(__doc__, "train_memory.json")
    p.set_defaults(json=H.default_json_path("train_memory.json") or "train_memory.json")
    p.add_argument("--model", required=True, help="the policy checkpoint (e.g. benchmarks/real_model.py's)")
    p.add_argument("--data", required=True, type=Path, help="a GSM8K-format .jsonl to cycle")
    p.add_argument("--size", type=int, default=7473, help="problems in the dataset (GSM8K's train split: 7473)")
    p.add_argument("--steps", type=int, default=50, help="training steps to measure")
    p.add_argument("--stores-of", type=int, metavar="N", help="measure epoch 2 holding the stores of N prompts")
    p.add_argument("--history", type=int, metavar="EPOCHS", help="measure only the history index over EPOCHS epochs")
    p.add_argument("--automaton-tokens", type=int, default=2**19, help="with --history: the index's automaton bound")
    args = p.parse_args(ours)
    H.positive(p, args, "size", "steps")
    if args.stores_of is not None and args.stores_of <= args.size:
        p.error(f"--stores-of {args.stores_of} must exceed --size {args.size}: it adds the prompts a larger run holds")
    if args.stores_of is not None and args.history:
        p.error("--history measures the history index alone: pass --stores-of or --history, not both")
    if not args.history and not args.data.is_file():
        p.error(f"--data {args.data} is not a file (a GSM8K-format .jsonl)")
    if args.history:
        result = history_growth(args.size, args.history, args.automaton_tokens)
        print(json.dumps(result, indent=2))
        return 0
    # The run's checkpoints take GBs: they go with the measurement.
    with tempfile.TemporaryDirectory(prefix="train-memory-") as tmp:
        work = Path(tmp)
        data = gsm8k_size(args.data, args.size, work / "data.jsonl")
        run = ["--model", args.model, "--data", str(data), "--no-eval", *train]
        grown = None
        if args.stores_of is not None:
            epoch1 = measure([*run, "--epochs", "1"], work / "run", 10**9)  # until it exits after its checkpoint
            grown = grow_stores(work / "run", args.stores_of - args.size)
            result = measure([*run, "--resume"], work / "run", args.steps)
            result.update(epoch_1=epoch1, stores=grown, stores_of=args.stores_of)
        else:
            result = measure(run, work / "run", args.steps)
    result.update(size=args.size, flags=train)
    print(json.dumps(result, indent=2))
    H.write_json(args.json, result)
    return 0 if result["steps"] >= args.steps else 1


if __name__ == "__main__":
    sys.exit(main())
