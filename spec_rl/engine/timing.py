"""One timed decode step of the paged engine: the points of its :class:`~spec_rl.backends.step_cost.StepCost`."""

from __future__ import annotations

import time

import torch

from ..sampling.distribution import SamplingSettings, keyed_sample
from .model_runner import ModelRunner


def paged_capacity(runner: ModelRunner, context: int, width: int) -> int:
    """How many sequences of ``context + width`` tokens the free blocks hold (the rows a measurement may use)."""
    per_seq = -(-(context + width) // runner.blocks.block_size)
    return runner.blocks.num_free // per_seq


@torch.no_grad()
def time_paged_step(runner: ModelRunner, rows: int, width: int, context: int = 64, repeats: int = 5) -> float:
    """Fastest of ``repeats`` timed runs (after one untimed warm-up) of one packed decode forward (+ keyed samples at every fed position) over ``rows``
    sequences of ``context`` cached tokens feeding ``width`` tokens each. Random ids; the sequences are
    cut back after each run and freed at the end; the runner's counters are left as they were."""
    runner.allocate_cache()
    vocab = runner.model.get_output_embeddings().weight.shape[0]
    gen = torch.Generator().manual_seed(rows * 31 + width)
    stats = runner.stats.copy()
    seqs = [runner.new_sequence() for _ in range(rows)]
    settings, times = SamplingSettings(max_tokens=width), []
    try:
        runner.forward([(s, torch.randint(0, vocab, (context,), generator=gen).tolist(), 0) for s in seqs],
                       [[context - 1]] * rows, hidden=False)  # fmt: skip
        uids = torch.arange(rows * width, device=runner.device)
        positions = (context + torch.arange(width, device=runner.device)).repeat(rows)
        for _ in range(repeats + 1):
            items = [(s, torch.randint(0, vocab, (width,), generator=gen).tolist(), context) for s in seqs]
            if runner.device.type == "cuda":
                torch.cuda.synchronize(runner.device)
            t0 = time.perf_counter()
            logits = runner.forward(items, [range(width)] * rows, hidden=False, relative=True)
            keyed_sample(torch.cat(logits, 0).float(), settings, 0, uids, positions)
            if runner.device.type == "cuda":
                torch.cuda.synchronize(runner.device)
            times.append(time.perf_counter() - t0)
            for s in seqs:
                runner.blocks.truncate(s, context)
    finally:
        for s in seqs:
            runner.blocks.free(s)
        runner.stats = stats
    return min(times[1:])  # the first run warms up; another process only ever adds time
