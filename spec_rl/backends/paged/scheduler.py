"""Scheduler of the paged engine (docs/design.md "Paged KV cache"): admission reserves every running sequence's
remaining budget, so a decode step never runs out of blocks; when nothing fits an idle cache, the newest resumed
sequence is evicted or a group is split."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Sequence

from ..base import Continuation
from .blocks import BlockManager, OutOfBlocks
from .sequence import GroupMember, PrefillGroup, SequenceState


def packed_wave_end(lengths: Sequence[int], start: int, max_tokens: int) -> int:
    """End of the wave from ``start``: rows while their tokens fit ``max_tokens``, at least one."""
    end, tokens = start, 0
    while end < len(lengths) and (end == start or tokens + lengths[end] <= max_tokens):
        tokens += lengths[end]
        end += 1
    return end


class Scheduler:
    """Which sequences run next under a block budget: ``waiting`` groups, ``resumed`` and ``running`` sequences."""

    def __init__(self, blocks: BlockManager, max_batch_size: int, max_tokens_per_forward: int):
        self.blocks = blocks
        self.max_batch_size = int(max_batch_size)
        self.max_tokens_per_forward = int(max_tokens_per_forward)
        self.waiting: deque[PrefillGroup] = deque()
        self.resumed: deque[SequenceState] = deque()
        self.running: list[SequenceState] = []

    def sequence_need(self, seq: SequenceState) -> int:
        """Most blocks ``seq`` can still take: its remaining budget's K/V (+1 copy-on-write)."""
        return self.blocks.append_cost(seq.seq_id, seq.budget)

    def group_need(self, group: PrefillGroup) -> int:
        plen = len(group.context)
        cow = 1 if plen % self.blocks.block_size and len(group.members) > 1 else 0
        need = self.blocks.blocks_for(plen)
        for member in group.members:
            need += self.blocks.blocks_for(plen + member.budget - 1) - self.blocks.blocks_for(plen) + cow
        return need

    def schedule(self) -> list[PrefillGroup]:
        """Admit what fits; returns the groups to prefill. OutOfBlocks when one sequence cannot fit an idle cache."""
        while True:
            committed = sum(self.sequence_need(s) for s in self.running)
            committed = self._admit_resumed(committed)
            if self.resumed and not self.running:
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
        lengths = [len(g.context) for g in groups]
        start = 0
        while start < len(groups):
            end = packed_wave_end(lengths, start, self.max_tokens_per_forward)
            yield groups[start:end]
            start = end

    def retire(self, results: list[Continuation | None]) -> None:
        for seq in self.running:
            if seq.finished:
                self.blocks.free(seq.seq_id)
                results[seq.result_index] = seq.continuation()
        self.running = [seq for seq in self.running if not seq.finished]

    def abort(self) -> None:
        """Free every sequence held and forget all waiting work."""
        for seq in [*self.running, *self.resumed]:
            if self.blocks.has(seq.seq_id):
                self.blocks.free(seq.seq_id)
        self.running, self.resumed, self.waiting = [], deque(), deque()

    def scoring_waves(self, lengths: Sequence[int], seq_ids: list[int | None]) -> Iterator[list[int]]:
        """Scoring rows in waves that fit the free blocks; when short, the oldest scored rows are evicted (``seq_ids[r]
        = None``)."""
        resident: deque[int] = deque()  # oldest first
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
        self, scored, jobs, fork: Callable[[int, int], int]
    ) -> tuple[list[SequenceState], list[PrefillGroup]]:
        """(sequences to resume, re-prefill groups) of the jobs with a cut and a budget: the first job on a row takes
        the row's sequence cut to [prompt, draft[:n]], the others fork it (forks before any cut); an evicted row
        becomes a re-prefill."""
        seq_ids = scored.state.seq_ids
        live = [i for i, j in enumerate(jobs) if j.cut is not None and j.budget > 0]
        lens = {i: len(scored.prompts[jobs[i].cut.row]) + int(jobs[i].cut.n) for i in live}
        owner: dict[int, int] = {}  # row -> the job that takes its sequence
        for i in live:
            owner.setdefault(jobs[i].cut.row, i)
        held: dict[int, int] = {}  # job -> the sequence it resumes on
        for i in live:  # forks first: a row's sequence is cut or freed only once its children share its blocks
            row = jobs[i].cut.row
            if owner[row] != i and seq_ids[row] is not None:
                held[i] = fork(seq_ids[row], lens[i])
        for row, i in owner.items():
            if seq_ids[row] is not None:
                self.blocks.truncate(seq_ids[row], lens[i])
                held[i], seq_ids[row] = seq_ids[row], None
        resumed: list[SequenceState] = []
        reprefill: dict[tuple[int, ...], PrefillGroup] = {}
        for i in live:
            cut = jobs[i].cut
            prefix = scored.prompts[cut.row] + scored.drafts[cut.row][: int(cut.n)]
            token, budget = int(cut.token), int(jobs[i].budget)
            if i in held:
                resumed.append(SequenceState(held[i], i, budget=budget, last=token, context=prefix))
            else:  # evicted while scoring: prefill prompt + prefix + token again
                key = tuple(prefix + [token])
                group = reprefill.setdefault(key, PrefillGroup(list(key), [], reprefill=True))
                group.members.append(GroupMember(i, budget))
        return resumed, list(reprefill.values())
