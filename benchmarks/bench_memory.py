"""Memory benchmark: peak extra bytes of verification on the hidden-state path, against the full logits.

    python benchmarks/bench_memory.py [--tokens 2048] [--vocab 16384] [--hidden 64] [--device cpu|cuda]

The hidden-state path hands ``verify_hidden`` the final hidden states [N, d] and the LM head [V, d] so
that the [N, V] logits are never built whole (paper Sec. 3; docs/design.md "Data flow of one step").
Two calls are measured, each with the caller's grad mode ON and the LM head an
``nn.Parameter`` (requires_grad), as in a training loop:

* ``verify``: :func:`spec_rl.acceptance.dispatch.verify_hidden` on N draft tokens (l = e^0.5);
* ``rollout``: :meth:`SpeculativeRollout.run` over the same N draft tokens (B drafts of R = N / B
  tokens from a stub backend that scores with hidden states), the whole step (SPEC-RL's rule, no tail
  speculation).

Printed per row: peak memory allocated during the call beyond what was allocated before it
(MiB), the size of the full [N, V] float32 logits (MiB) and their ratio. An autograd graph kept
over the chunked logits would push the ratio past 1 (it did: 1.75 before the rollout ran under
``no_grad``); ``--check`` exits with status 1 when a ratio is >= 1 (tests/benchmarks/test_bench_memory_smoke.py
runs it on CPU). Memory is counted by ``torch.cuda.max_memory_allocated`` on CUDA
(``_harness.peak_extra_mb``) and, on the CPU, from the allocation events of ``torch.profiler``
(every tensor allocation and free, in order). JSON (with provenance) goes to ``--json``
(default ``$OUT/memory.json``).
"""

from __future__ import annotations

import argparse
import math
import sys

import torch
from _harness import Column, Table, default_json_path, device_arg, peak_extra_mb, provenance, random_lm_head, write_json

from spec_rl.acceptance.dispatch import VerifyOptions, verify_hidden
from spec_rl.acceptance.mode import RolloutMode
from spec_rl.acceptance.rules import Lenient
from spec_rl.acceptance.scores import DraftScores
from spec_rl.backends.base import BackendStats, Continuation, Scored
from spec_rl.backends.reprefill import ReprefillBackend
from spec_rl.drafts.cache import CacheKey, RolloutCache
from spec_rl.rollout.speculative import RolloutRequest, SpeculativeRollout
from spec_rl.sampling.distribution import SamplingSettings

MIB = 2**20


def cpu_peak_extra_bytes(fn) -> int:
    """Peak bytes of CPU tensor memory allocated during ``fn()`` beyond the start, from profiler events."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    events = sorted(
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.device_type().name == "CPU"
    )
    del out
    current = peak = 0
    for _, nbytes in events:
        current += nbytes
        peak = max(peak, current)
    return peak


def peak_extra_bytes(fn, device: torch.device) -> int:
    return int(peak_extra_mb(fn) * MIB) if device.type == "cuda" else cpu_peak_extra_bytes(fn)


class HiddenStateBackend(ReprefillBackend):
    """A stub policy: scores are fixed hidden states with a Parameter LM head; generation emits token 0."""

    def __init__(self, hidden: torch.Tensor, head: torch.nn.Parameter):
        self.hidden, self.head = hidden, head
        self.stats = BackendStats()

    @property
    def device(self) -> torch.device:
        return self.head.device

    @property
    def vocab_size(self) -> int:
        return self.head.shape[0]

    def score(self, prompts, drafts, logprobs=None) -> Scored:
        return Scored(DraftScores(hidden_states=self.hidden, lm_head_weight=self.head), prompts, drafts)

    def generate(self, jobs, settings, seed):
        return [Continuation([0] * int(j.budget), [-1.0] * int(j.budget), "length") for j in jobs]


def inputs(args, device: torch.device) -> dict:
    """Hidden states [B, R, d], a Parameter LM head [V, d], draft ids and old logprobs [B, R]."""
    gen = torch.Generator().manual_seed(0)
    bsz, max_len = args.batch, args.tokens // args.batch
    hidden = torch.randn(bsz, max_len, args.hidden, generator=gen).to(device)
    head = torch.nn.Parameter(random_lm_head(args.vocab, args.hidden, torch.float32, "cpu", gen).to(device))
    ids = torch.randint(0, args.vocab - 1, (bsz, max_len), generator=gen).to(device)  # V - 1 is the EOS
    old = (-torch.rand(bsz, max_len, generator=gen) * 4).to(device)
    return dict(hidden=hidden, head=head, ids=ids, old=old)


def measure_verify(x: dict, device: torch.device) -> int:
    bsz, max_len = x["ids"].shape
    lengths = torch.full((bsz,), max_len, dtype=torch.long, device=device)
    uids = torch.arange(bsz, device=device)

    options = VerifyOptions(mode=Lenient(math.exp(0.5)))

    def call():
        return verify_hidden(x["ids"], x["old"], x["hidden"], x["head"], lengths, seed=1, uids=uids, options=options)

    call()  # first-call allocations (kernels, caches) are not the call's working memory
    return peak_extra_bytes(call, device)


def measure_rollout(x: dict, device: torch.device) -> int:
    bsz, max_len = x["ids"].shape
    vocab = x["head"].shape[0]
    settings = SamplingSettings(max_tokens=max_len)
    requests = [RolloutRequest([1, 2, 3], slot=b) for b in range(bsz)]

    def call():
        cache = RolloutCache()
        for b, r in enumerate(requests):
            cache.store(
                CacheKey.make(r.prompt_ids, r.slot), x["ids"][b].tolist(), x["old"][b].tolist(), "length", 0, settings
            )
        rollout = SpeculativeRollout(
            HiddenStateBackend(x["hidden"], x["head"]),
            cache,
            settings,
            eos_ids=[vocab - 1],
            max_model_len=3 + max_len,
            mode=RolloutMode(Lenient(), tail=0),
            seed=0,
        )
        return rollout.run(requests, step=1)

    call()
    return peak_extra_bytes(call, device)


def run(args, device: torch.device) -> dict:
    if args.tokens % args.batch:
        raise SystemExit(f"--tokens ({args.tokens}) must be a multiple of --batch ({args.batch})")
    x = inputs(args, device)
    full = args.tokens * args.vocab * 4
    assert torch.is_grad_enabled() and x["head"].requires_grad  # the case of a training loop
    rows = {}
    for name, fn in (("verify", measure_verify), ("rollout", measure_rollout)):
        extra = fn(x, device)
        rows[name] = {"peak_extra_mib": extra / MIB, "full_logits_mib": full / MIB, "ratio": extra / full}
    shape = {"tokens": args.tokens, "vocab": args.vocab, "hidden": args.hidden, "batch": args.batch}
    return {"shape": shape, "rows": rows, **provenance(device)}


def print_table(record: dict) -> None:
    s = record["shape"]
    print(
        f"bench_memory: N={s['tokens']} draft tokens, V={s['vocab']}, d={s['hidden']}, B={s['batch']}, "
        f"device {record.get('device')}, commit {record.get('commit')}"
    )
    table = Table(
        Column("call", 8, "<"),
        Column("peak extra MiB", 14, fmt="{:.1f}", gap="  "),
        Column("full logits MiB", 15, fmt="{:.1f}", gap="  "),
        Column("ratio", 6, fmt="{:.3f}", gap="  "),
    )
    print(table.header())
    for name, r in record["rows"].items():
        print(table.row(name, r["peak_extra_mib"], r["full_logits_mib"], r["ratio"]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2048, help="N: draft tokens verified")
    ap.add_argument("--vocab", type=int, default=16384, help="V")
    ap.add_argument("--hidden", type=int, default=64, help="d: hidden size")
    ap.add_argument("--batch", type=int, default=16, help="B: drafts (each of N / B tokens)")
    ap.add_argument("--device", help="default: cuda if available, else cpu")
    ap.add_argument("--check", action="store_true", help="exit 1 when a peak reaches the size of the full logits")
    ap.add_argument("--json", default=default_json_path("memory.json"))
    args = ap.parse_args(argv)
    record = run(args, device_arg(ap, args.device))
    print_table(record)
    if args.json:
        write_json(args.json, record)
    over = [name for name, r in record["rows"].items() if r["ratio"] >= 1.0]
    if args.check and over:
        print(f"bench_memory: peak extra memory reached the full logits in {over}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
