"""One timed decode step of the paged engine: the points of its :class:`~spec_rl.backends.step_cost.StepCost`."""

from __future__ import annotations

import torch

from ..backends.step_cost import fastest_run
from ..sampling.distribution import SamplingSettings, keyed_sample
from .model_runner import ModelRunner


def paged_capacity(runner: ModelRunner, context: int, width: int) -> int:
    """How many sequences of ``context + width`` tokens the free blocks hold (the rows a measurement may use)."""
    per_seq = -(-(context + width) // runner.blocks.block_size)
    return runner.blocks.num_free // per_seq


@torch.no_grad()
def time_paged_step(runner: ModelRunner, rows: int, width: int, context: int = 64, repeats: int = 5) -> float:
    """Seconds of one packed decode forward (+ keyed samples at every fed position) over ``rows`` sequences
    of ``context`` cached tokens feeding ``width`` tokens each, the fastest of ``repeats``
    (:func:`~spec_rl.backends.step_cost.fastest_run`). Random ids; the sequences are cut back after each
    run and freed at the end; the runner's counters are left as they were."""
    runner.allocate_cache()
    vocab = runner.model.get_output_embeddings().weight.shape[0]
    gen = torch.Generator().manual_seed(rows * 31 + width)
    stats = runner.stats.copy()
    seqs = [runner.new_sequence() for _ in range(rows)]
    settings = SamplingSettings(max_tokens=width)
    try:
        runner.forward([(s, torch.randint(0, vocab, (context,), generator=gen).tolist(), 0) for s in seqs],
                       [[context - 1]] * rows, hidden=False)  # fmt: skip
        uids = torch.arange(rows * width, device=runner.device)
        positions = (context + torch.arange(width, device=runner.device)).repeat(rows)
        inputs = [[(s, torch.randint(0, vocab, (width,), generator=gen).tolist(), context) for s in seqs]
                  for _ in range(repeats + 1)]  # fmt: skip

        def step(i: int) -> None:
            logits = runner.forward(inputs[i], [range(width)] * rows, hidden=False, relative=True)
            keyed_sample(torch.cat(logits, 0).float(), settings, 0, uids, positions)

        def cut_back() -> None:
            for s in seqs:
                runner.blocks.truncate(s, context)

        return fastest_run(step, runner.device, repeats, after=cut_back)
    finally:
        for s in seqs:
            runner.blocks.free(s)
        runner.stats = stats
