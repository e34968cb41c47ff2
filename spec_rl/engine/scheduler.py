"""Scheduler of the paged engine: admission, eviction and forward packing.

Admission reserves the worst case (docs/design.md "Paged KV cache"): a
sequence or group is admitted only when the free blocks cover the most that
every running sequence can still take (its remaining budget), so a decode step
never runs out of blocks midway. A speculative decode step feeds the pending
token and up to ``budget - 1`` proposed tokens, so even before the rejected
ones are given back it holds no more slots than its remaining budget reserves:
the reservation is the same with or without speculation. What does not fit
waits until running sequences finish and free their blocks. When nothing runs and the next group
still does not fit (too many blocks, or more members than ``max_batch_size``),
the group is split into single members; a single sequence that cannot fit an
empty cache raises :class:`~spec_rl.engine.blocks.OutOfBlocks`.

Resumed sequences (continued from a scoring pass, or forked from the scored
row whose draft holds their verified prefix) already hold blocks, so they
are admitted first; if none of them fits while nothing runs, the newest gives
up its K/V and is prefilled again later (counted as re-prefill).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Sequence

from ..backends.checks import check_continue_rows
from ..backends.protocol import Continuation
from .blocks import BlockManager, OutOfBlocks
from .sequence import GroupMember, PrefillGroup, SequenceState, SpliceHandle, empty_continuation


def packed_wave_end(lengths: Sequence[int], start: int, max_tokens: int) -> int:
    """End (exclusive) of the wave that starts at ``start``: rows are taken while their token total fits.

    The first row is always taken, however long, so every wave makes progress.
    """
    end, tokens = start, 0
    while end < len(lengths) and (end == start or tokens + lengths[end] <= max_tokens):
        tokens += lengths[end]
        end += 1
    return end


class Scheduler:
    """Which sequences run next, under a block budget and a batch-size limit.

    Parameters
    ----------
    blocks:
        the engine's block manager (shared with the model runner).
    max_batch_size:
        most sequences decoded together.
    max_tokens_per_forward:
        most tokens in one prefill or scoring forward.

    Attributes
    ----------
    waiting:
        groups waiting for prefill, in admission order.
    resumed:
        sequences that hold blocks but have not been admitted yet.
    running:
        admitted sequences (decoding, or finished and not yet retired).
    """

    def __init__(self, blocks: BlockManager, max_batch_size: int, max_tokens_per_forward: int):
        self.blocks = blocks
        self.max_batch_size = int(max_batch_size)
        self.max_tokens_per_forward = int(max_tokens_per_forward)
        self.waiting: deque[PrefillGroup] = deque()
        self.resumed: deque[SequenceState] = deque()
        self.running: list[SequenceState] = []

    # ------------------------------------------------------------ block needs
    def sequence_need(self, seq: SequenceState) -> int:
        """Most blocks ``seq`` can still take: K/V growth of its remaining budget (+1 copy-on-write).

        Also the peak of a speculative step: its 1 + k fed tokens never exceed the budget
        (k <= budget - 1), and tokens + budget stays constant after the rollback.
        """
        return self.blocks.append_cost(seq.seq_id, seq.budget)

    def group_need(self, group: PrefillGroup) -> int:
        """Blocks a group takes in the worst case: the shared context, then each member's growth."""
        plen = len(group.context)
        cow = 1 if plen % self.blocks.block_size and len(group.members) > 1 else 0
        need = self.blocks.blocks_for(plen)
        for member in group.members:
            need += self.blocks.blocks_for(plen + member.budget - 1) - self.blocks.blocks_for(plen) + cow
        return need

    # -------------------------------------------------------------- admission
    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.resumed or self.running)

    def add(self, groups: Sequence[PrefillGroup], resumed: Sequence[SequenceState]) -> None:
        self.waiting.extend(groups)
        self.resumed.extend(resumed)

    def schedule(self) -> list[PrefillGroup]:
        """Admit what fits: resumed sequences join :attr:`running`; the admitted groups are returned for prefill.

        Raises:
            OutOfBlocks: a single sequence does not fit even in an idle cache.
        """
        while True:
            committed = sum(self.sequence_need(s) for s in self.running)
            committed = self._admit_resumed(committed)
            if self.resumed and not self.running:
                # Nothing runs and the next resumed sequence does not fit: give up the
                # K/V of a waiting one (newest first) and prefill it again later.
                seq = self.resumed.pop()
                self.blocks.free(seq.seq_id)
                self.waiting.append(seq.as_reprefill())
                continue
            return self._admit_groups(committed)

    def _admit_resumed(self, committed: int) -> int:
        while self.resumed and len(self.running) < self.max_batch_size:
            need = self.sequence_need(self.resumed[0])
            if committed + need > self.blocks.num_free:
                break
            committed += need
            self.running.append(self.resumed.popleft())
        return committed

    def _admit_groups(self, committed: int) -> list[PrefillGroup]:
        admitted: list[PrefillGroup] = []
        batch = len(self.running)
        while self.waiting:
            group = self.waiting[0]
            need = self.group_need(group)
            if batch + len(group.members) <= self.max_batch_size and committed + need <= self.blocks.num_free:
                committed += need
                batch += len(group.members)
                admitted.append(self.waiting.popleft())
                continue
            if self.running or admitted or self.resumed:
                break  # wait for running sequences to free their blocks
            if len(group.members) > 1:  # the whole group cannot run even alone: split it
                self.waiting.popleft()
                self.waiting.extendleft(reversed(group.split()))
                continue
            what = f"a context of {len(group.context)} tokens with budget {group.members[0].budget}"
            raise OutOfBlocks(need, self.blocks.num_free, what)
        return admitted

    def prefill_waves(self, groups: list[PrefillGroup]) -> Iterator[list[PrefillGroup]]:
        """Admitted groups in waves of at most ``max_tokens_per_forward`` context tokens (one forward each)."""
        lengths = [len(g.context) for g in groups]
        start = 0
        while start < len(groups):
            end = packed_wave_end(lengths, start, self.max_tokens_per_forward)
            yield groups[start:end]
            start = end

    # ------------------------------------------------------------ retirement
    def retire(self, results: list[Continuation | None]) -> None:
        """Free the blocks of finished sequences and store their continuations."""
        still = []
        for seq in self.running:
            if seq.finished:
                self.blocks.free(seq.seq_id)
                results[seq.result_index] = seq.continuation()
            else:
                still.append(seq)
        self.running = still

    def abort(self) -> None:
        """Free every sequence this scheduler holds (after an error) and forget all waiting work."""
        for seq in [*self.running, *self.resumed]:
            if self.blocks.has(seq.seq_id):
                self.blocks.free(seq.seq_id)
        self.running, self.resumed, self.waiting = [], deque(), deque()

    # ------------------------------------------------------ speculative path
    def scoring_waves(self, lengths: Sequence[int], seq_ids: list[int | None]) -> Iterator[list[int]]:
        """Rows of a scoring pass in waves that fit the free blocks; ``seq_ids[r]`` is set by the caller.

        When blocks run short, the oldest scored rows give up their K/V
        (``seq_ids[r] = None``; continue_from prefills them again), then waves
        shrink to fewer rows.

        Raises:
            OutOfBlocks: one row does not fit even in an empty cache.
        """
        resident: deque[int] = deque()  # rows whose K/V is in the cache, oldest first
        start = 0
        while start < len(lengths):
            end = packed_wave_end(lengths, start, self.max_tokens_per_forward)
            need = sum(self.blocks.blocks_for(lengths[r]) for r in range(start, end))
            while need > self.blocks.num_free and resident:
                r = resident.popleft()
                self.blocks.free(seq_ids[r])
                seq_ids[r] = None
            while need > self.blocks.num_free and end - start > 1:  # fewer rows per forward
                end = start + (end - start) // 2
                need = sum(self.blocks.blocks_for(lengths[r]) for r in range(start, end))
            if need > self.blocks.num_free:
                raise OutOfBlocks(need, self.blocks.num_free, "scoring one prompt + draft; raise num_blocks")
            rows = list(range(start, end))
            yield rows
            resident.extend(rows)
            start = end

    def resume_scored_rows(
        self,
        handle: SpliceHandle,
        accepted_lens: Sequence[int],
        first_tokens: Sequence[int | None],
        budgets: Sequence[int],
        results: list[Continuation | None],
        sources: Sequence[int],
        fork: Callable[[int, int], int],
    ) -> tuple[list[SequenceState], list[PrefillGroup]]:
        """Cut each scored row to its verified prefix and turn it into a sequence to resume.

        Row i continues [prompt, drafts[sources[i]][:n], first token]. A row whose
        source is another row gets a fork of the source's sequence (``fork(parent,
        length)`` returns the new id), made before any row is cut, so a source may
        itself continue with another n or be released. Ownership of a row resumed on
        its own sequence moves from the handle to the returned sequence
        (``handle.seq_ids[i] = None``); the caller releases what the handle still holds.
        A row whose source's K/V was evicted while scoring becomes a re-prefill group
        of [prompt, prefix, first token] (rows with the same context share one); a row
        with no first token or a zero budget gets an empty continuation in ``results``.

        Raises:
            ValueError: see :func:`spec_rl.backends.checks.check_continue_rows`; nothing changed then.
        """
        sources = check_continue_rows(handle.prompts, handle.drafts, accepted_lens, budgets, sources)
        lens = [len(p) + int(n) for p, n in zip(handle.prompts, accepted_lens)]
        live = [i for i in range(len(lens)) if first_tokens[i] is not None and int(budgets[i]) > 0]
        for i in set(range(len(lens))) - set(live):
            results[i] = empty_continuation()
        held: dict[int, int] = {}  # row -> the sequence it resumes on
        for i in live:  # forks first: a source is cut or freed only once its children share its blocks
            parent = handle.seq_ids[sources[i]]
            if sources[i] != i and parent is not None:
                held[i] = fork(parent, lens[i])
        for i in live:
            own = handle.seq_ids[i]
            if sources[i] == i and own is not None:
                self.blocks.truncate(own, lens[i])
                handle.seq_ids[i] = None
                held[i] = own
        resumed: list[SequenceState] = []
        reprefill: dict[tuple[int, ...], PrefillGroup] = {}
        for i in live:
            prefix = handle.prompts[i] + handle.drafts[sources[i]][: int(accepted_lens[i])]
            token, budget = int(first_tokens[i]), int(budgets[i])
            if i in held:
                resumed.append(SequenceState(held[i], i, budget, pending_token=token, context=prefix))
            else:  # evicted while scoring: prefill prompt + prefix + token again
                key = tuple(prefix + [token])
                group = reprefill.setdefault(key, PrefillGroup(list(key), [], reprefill=True))
                group.members.append(GroupMember(i, budget))
        return resumed, list(reprefill.values())
