"""Timed decode steps of the paged engine: the points of its :class:`~spec_rl.backends.step_cost.StepCost`."""

from __future__ import annotations

import torch

from ..backends.step_cost import fastest_run
from ..sampling.distribution import SamplingSettings, keyed_sample
from .model_runner import ModelRunner


def paged_capacity(runner: ModelRunner, context: int, width: int) -> int:
    """How many sequences of ``context + width`` tokens the free blocks hold (the rows a measurement may use)."""
    per_seq = -(-(context + width) // runner.blocks.block_size)
    return runner.blocks.num_free // per_seq


class PagedStepTimer:
    """Times packed decode steps of ``runner``; a context manager that frees what it holds on exit.

    ``timer(rows, width, context)`` returns the seconds of one packed decode forward (+ keyed samples at every
    fed position) over ``rows`` sequences of ``context`` cached tokens feeding ``width`` tokens each, the
    fastest of ``repeats`` (:func:`~spec_rl.backends.step_cost.fastest_run`). Random ids. The sequences of the
    latest (rows, context) stay prefilled and are cut back after each run, so timing every width of one batch
    prefills it once; the runner's counters are left as they were.
    """

    def __init__(self, runner: ModelRunner, repeats: int = 5):
        self.runner, self.repeats = runner, int(repeats)
        self._batch: tuple[tuple[int, int], list[int]] | None = None

    def __enter__(self) -> "PagedStepTimer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Free the prefilled sequences (idempotent)."""
        if self._batch is not None:
            for s in self._batch[1]:
                self.runner.blocks.free(s)
            self._batch = None

    def _prefilled(self, rows: int, context: int) -> list[int]:
        if self._batch is None or self._batch[0] != (rows, context):
            self.close()
            self.runner.allocate_cache()
            vocab = self.runner.model.get_output_embeddings().weight.shape[0]
            gen = torch.Generator().manual_seed(rows * 31 + context)
            seqs = []
            self._batch = ((rows, context), seqs)  # filled as allocated: close() frees them on any error
            for _ in range(rows):
                seqs.append(self.runner.new_sequence())
            self.runner.forward([(s, torch.randint(0, vocab, (context,), generator=gen).tolist(), 0) for s in seqs],
                                [[context - 1]] * rows, hidden=False)  # fmt: skip
        return self._batch[1]

    @torch.no_grad()
    def __call__(self, rows: int, width: int, context: int = 64) -> float:
        runner = self.runner
        stats = runner.stats.copy()
        try:
            seqs = self._prefilled(rows, context)
            vocab = runner.model.get_output_embeddings().weight.shape[0]
            gen = torch.Generator().manual_seed(rows * 31 + width)
            settings = SamplingSettings(max_tokens=width)
            uids = torch.arange(rows * width, device=runner.device)
            positions = (context + torch.arange(width, device=runner.device)).repeat(rows)
            inputs = [[(s, torch.randint(0, vocab, (width,), generator=gen).tolist(), context) for s in seqs]
                      for _ in range(self.repeats + 1)]  # fmt: skip

            def step(i: int) -> None:
                logits = runner.forward(inputs[i], [range(width)] * rows, hidden=False, relative=True)
                keyed_sample(torch.cat(logits, 0).float(), settings, 0, uids, positions)

            def cut_back() -> None:
                for s in seqs:
                    runner.blocks.truncate(s, context)

            return fastest_run(step, runner.device, self.repeats, after=cut_back)
        except BaseException:
            self.close()
            raise
        finally:
            runner.stats = stats

