"""The paged engine's static-shape decode step (docs/design.md "Static decode step"): every tensor of a step has a
shape fixed by its bucket (batch rows, block-table width), the step samples on the device and advances its own
state, so ``sync_every`` steps run back to back and the host reads the tokens once. On CUDA each bucket's step is
captured in a CUDA graph (one replay per step); on a CPU it runs eagerly and gives the packed step's tokens.

Steps with proposals (history speculation, tail speculation) stay on the packed step: their proposer is asked on the
host before every step and hears every token after it, so a step cannot run without a host round trip anyway."""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass

import torch

from ...sampling.distribution import gumbel_race, no_distribution_error, sampling_log_softmax
from ...sampling.philox import STREAM_SAMPLE, philox_keys
from ...util.validation import check_int
from .attention import PagedBatch, paged_attention_active
from .sampler import KeyedSampler
from .sequence import SequenceState

NO_TOKEN = -1  # out_ids entry of a step a row did not run (finished or padding)
MAX_SYNC_EVERY = 256


@dataclass(frozen=True)
class DecodeConfig:
    """How the paged engine runs decode steps without proposals.

    ``static``: the static-shape step (None: on CUDA only; True: also on a CPU, eagerly); ``cuda_graphs``: capture it
    per bucket on CUDA (False: run it eagerly there); ``sync_every``: steps between host reads of finished rows, at
    most :data:`MAX_SYNC_EVERY` (None: 8 on CUDA, 1 on a CPU, where a read costs nothing); a row that finishes
    inside a chunk idles to its end. TypeError or ValueError for a bad field."""

    static: bool | None = None
    cuda_graphs: bool = True
    sync_every: int | None = None

    def __post_init__(self) -> None:
        for name in ("static", "cuda_graphs"):
            value = getattr(self, name)
            if not (isinstance(value, bool) or (name == "static" and value is None)):
                raise TypeError(f"DecodeConfig.{name} must be a bool{' or None' if name == 'static' else ''}")
        if self.sync_every is not None:
            hint = " (a chunk's tokens are held per row: a longer one only idles finished rows)"
            check_int("sync_every", self.sync_every, low=1, high=MAX_SYNC_EVERY, hint=hint)

    def uses_static(self, device: torch.device) -> bool:
        return device.type == "cuda" if self.static is None else self.static

    def steps_per_sync(self, device: torch.device) -> int:
        return self.sync_every or (8 if device.type == "cuda" else 1)


def bucket_of(n: int, cap: int) -> int:
    """The smallest power of two >= n, at most ``cap`` (the engine's batch bound, itself a bucket)."""
    return min(1 << max(n - 1, 0).bit_length(), cap)


class _Buffers:
    """The static tensors of one bucket: the step's inputs, its state (advanced in place) and its outputs."""

    def __init__(self, rows: int, width: int, steps: int, eos: torch.Tensor, device: torch.device):
        def new(shape, dtype):
            return torch.zeros(shape, dtype=dtype, device=device)

        self.tokens, self.pos, self.remaining = new(rows, torch.long), new(rows, torch.long), new(rows, torch.long)
        self.uids, self.done, self.bad = new(rows, torch.long), new(rows, torch.bool), new(rows, torch.bool)
        self.tables = new((rows, width), torch.int32)
        self.seed, self.step = new((), torch.long), new((), torch.long)
        self.out_ids, self.out_lps = new((rows, steps), torch.long), new((rows, steps), torch.float32)
        self.eos = eos
        self.graph = None


class StaticDecoder:
    """Runs chunks of static-shape decode steps for the engine's :class:`ModelRunner`; graphs are kept per (rows,
    width, sampling settings) and share one memory pool."""

    def __init__(self, runner, max_batch_size: int, config: DecodeConfig):
        self.runner = runner
        self.max_batch_size = int(max_batch_size)
        self.device = runner.device
        self.graphs = self.device.type == "cuda" and config.cuda_graphs
        self.sync_every = config.steps_per_sync(self.device)
        self._buffers: dict[tuple, _Buffers] = {}
        self._pool = None
        self.capture_error: str | None = None  # why a capture failed (its bucket runs eagerly)

    def decode(self, seqs: list[SequenceState], sampler: KeyedSampler) -> int:
        """Up to ``sync_every`` decode steps of ``seqs`` (none with a proposer); returns the tokens sampled."""
        runner, blocks = self.runner, self.runner.blocks
        starts = [blocks.length(s.seq_id) for s in seqs]
        steps = min(self.sync_every, max(s.budget for s in seqs))
        cow = []
        for s in seqs:
            cow += blocks.append_slots(s.seq_id, min(steps, s.budget))[1]
        runner._copy_on_write(cow)
        tables = [blocks.block_table(s.seq_id) for s in seqs]
        rows = bucket_of(len(seqs), self.max_batch_size)
        width = bucket_of(max(len(t) for t in tables) + 1, 1 << 30)  # + 1: a finished row's position may end a block
        buf = self._buffers_for(rows, width, sampler)
        self._load(buf, seqs, starts, tables, sampler)
        for _ in range(steps):
            if buf.graph is not None:
                buf.graph.replay()
            else:
                self._step(buf, sampler.settings)
        ids, lps, bad = buf.out_ids[: len(seqs), :steps].tolist(), buf.out_lps[: len(seqs), :steps].tolist(), None
        if bool(buf.bad.any()):
            bad = torch.nonzero(buf.bad).flatten().tolist()
        fed = 0
        for k, (seq, start) in enumerate(zip(seqs, starts)):
            live = [t for t in ids[k] if t != NO_TOKEN]
            if bad is None:
                kept = seq.emit(live, lps[k][: len(live)], sampler.eos_ids)
                assert kept == len(live), (kept, len(live))
            blocks.truncate(seq.seq_id, start + len(live))
            fed += len(live)
        if bad is not None:
            raise no_distribution_error(
                [
                    f"uid {sampler.uids[seqs[r].result_index]} (positions {starts[r] + 1}-{starts[r] + steps})"
                    for r in bad
                ]
            )
        stats = runner.stats
        stats.decode_tokens += fed
        stats.decode_rows += fed
        stats.decode_positions += rows * steps
        stats.decode_steps += steps
        stats.forwards += steps
        stats.graph_steps += steps if buf.graph is not None else 0
        return fed

    def _load(self, buf: _Buffers, seqs, starts, tables, sampler: KeyedSampler) -> None:
        """The chunk's rows into the bucket; padding rows are finished rows over the scratch block."""
        rows, width = buf.tables.shape
        scratch = self.runner.scratch_block
        pad = rows - len(seqs)
        table = torch.full((rows, width), scratch, dtype=torch.int32)
        for k, t in enumerate(tables):
            table[k, : len(t)] = torch.tensor(t, dtype=torch.int32)
        host = {
            "tokens": [s.last for s in seqs] + [0] * pad,
            "pos": starts + [1] * pad,
            "remaining": [s.budget for s in seqs] + [0] * pad,
            "uids": [sampler.uids[s.result_index] for s in seqs] + [0] * pad,
            "done": [False] * len(seqs) + [True] * pad,
        }
        for name, values in host.items():
            getattr(buf, name).copy_(torch.tensor(values, dtype=getattr(buf, name).dtype), non_blocking=True)
        buf.tables.copy_(table, non_blocking=True)
        seed = sampler.seed % (1 << 64)
        buf.seed.fill_(seed - (1 << 64) if seed >= 1 << 63 else seed)  # the same 64 bits as int64
        buf.step.zero_()
        buf.bad.zero_()
        buf.out_ids.fill_(NO_TOKEN)

    def _step(self, buf: _Buffers, settings) -> None:
        """One decode step over the bucket, in place: live rows write their K/V, sample and advance."""
        runner = self.runner
        rows, width = buf.tables.shape
        bs = runner.blocks.block_size
        live = ~buf.done
        block = buf.tables.gather(1, (buf.pos // bs).clamp(max=width - 1).unsqueeze(1)).squeeze(1).long()
        slots = (block * bs + buf.pos % bs).masked_fill(~live, runner.scratch_block * bs)  # no host scalar tensor
        kv_lens = buf.pos + live.long()  # a finished row attends to what it holds and writes only the scratch block
        span = width * bs
        kernel = runner.decode_kernel
        mask = None
        if kernel is None:
            mask = (torch.arange(span, device=self.device) < kv_lens.unsqueeze(1)).view(rows, 1, 1, span)
        batch = PagedBatch(
            kv_caches=runner.kv_caches,
            slot_mapping=slots,
            block_tables=buf.tables,
            kv_lens=kv_lens,
            max_kv=span,
            q_index=torch.arange(rows, device=self.device).unsqueeze(1),
            q_valid=None,
            mask=mask,
            decode_kernel=kernel,
            kv_lens_i32=kv_lens.int() if kernel is not None else None,
            max_slot=runner.kv_caches[0].shape[0] * bs - 1,
        )
        with paged_attention_active(runner.model, batch):
            logits = runner.head.states(
                hidden=False, input_ids=buf.tokens.unsqueeze(0), position_ids=buf.pos.unsqueeze(0), use_cache=False
            )[0]
        logp = sampling_log_softmax(logits.float(), settings.temperature, settings.top_k, settings.top_p)
        keys = philox_keys(buf.seed, buf.uids, buf.pos + 1, STREAM_SAMPLE)
        ids = gumbel_race(logp, keys)
        lps = logp.gather(1, ids.unsqueeze(1)).squeeze(1)
        buf.bad |= live & ~(logp.exp().sum(-1) > 0)
        column = buf.step.view(1, 1).expand(rows, 1)
        buf.out_ids.scatter_(1, column, ids.masked_fill(~live, NO_TOKEN).unsqueeze(1))
        buf.out_lps.scatter_(1, column, lps.unsqueeze(1))
        remaining = buf.remaining - live.long()
        ended = (ids.unsqueeze(1) == buf.eos.unsqueeze(0)).any(1) | (remaining <= 0)
        buf.remaining.copy_(remaining)
        buf.tokens.copy_(torch.where(live, ids, buf.tokens))
        buf.pos.add_(live.long())
        buf.done |= live & ended
        buf.step.add_(1)

    def _buffers_for(self, rows: int, width: int, sampler: KeyedSampler) -> _Buffers:
        key = (rows, width, sampler.settings)
        buf = self._buffers.get(key)
        if buf is None:
            eos = torch.tensor(sorted(sampler.eos_ids), dtype=torch.long, device=self.device)
            buf = self._buffers[key] = _Buffers(rows, width, self.sync_every, eos, self.device)
            if self.graphs:
                self._capture(buf, sampler.settings)
        return buf

    def _capture(self, buf: _Buffers, settings) -> None:
        """Warm the bucket's step up on a side stream, then capture it; a step that cannot be captured runs eagerly
        (warned once)."""
        t0 = time.perf_counter()
        try:
            self._idle(buf)
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._step(buf, settings)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            self._idle(buf)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                self._step(buf, settings)
            self._pool = graph.pool()
            buf.graph = graph
        except Exception as exc:  # noqa: BLE001  the eager step is always correct
            self.graphs = False
            self.runner.stats.graph_fallbacks += 1
            self.capture_error = f"{type(exc).__name__}: {exc}"
            warnings.warn(
                f"the paged engine's decode step could not be captured in a CUDA graph ({type(exc).__name__}: "
                f"{exc}); it runs eagerly (DecodeConfig(cuda_graphs=False) silences this)",
                RuntimeWarning,
                stacklevel=2,
            )
        finally:
            torch.cuda.synchronize(self.device)
            self.runner.stats.capture_seconds += time.perf_counter() - t0

    def _idle(self, buf: _Buffers) -> None:
        """Every row a finished padding row (warm-up and capture write only the scratch block)."""
        buf.tables.fill_(self.runner.scratch_block)
        buf.pos.fill_(1)
        buf.done.fill_(True)
        buf.step.zero_()
