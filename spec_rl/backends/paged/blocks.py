"""Block manager of the paged KV cache: refcounted blocks and block tables (docs/design.md "Paged KV cache"). Appending
into a shared, partly filled block copies it first; an operation that fails (an unknown sequence is a KeyError) changes
no state."""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable

from ...util.validation import check_int


class OutOfBlocks(RuntimeError):
    """Not enough free KV-cache blocks (``needed``, ``free``); raised before any state changed."""

    def __init__(self, needed: int, free: int, what: str = ""):
        self.needed = int(needed)
        self.free = int(free)
        msg = f"need {needed} free KV-cache blocks but only {free} are free"
        if what:
            msg += f" ({what})"
        super().__init__(msg + "; finish or free sequences first, or build the engine with more num_blocks")


class BlockManager:
    """Refcounted blocks and the block tables of sequences (hashable ids); TypeError or ValueError for bad sizes."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = check_int("num_blocks", num_blocks, low=1)
        self.block_size = check_int("block_size", block_size, low=1)
        self._free: deque[int] = deque(range(self.num_blocks))
        self._ref = [0] * self.num_blocks
        self._tables: dict[Hashable, list[int]] = {}
        self._lens: dict[Hashable, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def has(self, seq: Hashable) -> bool:
        return seq in self._tables

    def length(self, seq: Hashable) -> int:
        return self._lens[seq]

    def block_table(self, seq: Hashable) -> list[int]:
        """A copy of the sequence's block table."""
        return list(self._tables[seq])

    def blocks_for(self, num_tokens: int) -> int:
        return -(-int(num_tokens) // self.block_size)

    def slots(self, seq: Hashable, start: int, end: int) -> list[int]:
        """Slot ids of positions [start, end) of ``seq``."""
        assert 0 <= start <= end <= self._lens[seq], (seq, start, end, self._lens[seq])
        table, bs = self._tables[seq], self.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def append_cost(self, seq: Hashable, num_tokens: int) -> int:
        """Free blocks :meth:`append_slots` would take (new blocks + copy-on-write)."""
        length, table = self._lens[seq], self._tables[seq]
        new = self.blocks_for(length + num_tokens) - len(table)
        cow = 1 if num_tokens > 0 and length % self.block_size and self._ref[table[-1]] > 1 else 0
        return new + cow

    def allocate(self, seq: Hashable, num_tokens: int) -> list[int]:
        """Create ``seq`` with ``num_tokens`` slots in fresh blocks; returns their slot ids."""
        num_tokens = check_int("num_tokens", num_tokens, low=0)
        assert seq not in self._tables, f"sequence {seq!r} already exists"
        need = self.blocks_for(num_tokens)
        if need > len(self._free):
            raise OutOfBlocks(need, len(self._free), f"allocate {num_tokens} tokens for {seq!r}")
        self._tables[seq] = [self._take() for _ in range(need)]
        self._lens[seq] = int(num_tokens)
        return self.slots(seq, 0, num_tokens)

    def fork(self, parent: Hashable, child: Hashable, length: int | None = None) -> None:
        """Create ``child`` sharing ``parent``'s blocks for its first ``length`` tokens (default: all)."""
        assert child not in self._tables, f"sequence {child!r} already exists"
        plen = self._lens[parent]
        length = plen if length is None else check_int("length", length, low=0, high=plen)
        shared = self._tables[parent][: self.blocks_for(length)]
        for b in shared:
            self._ref[b] += 1
        self._tables[child] = list(shared)
        self._lens[child] = length

    def append_slots(self, seq: Hashable, num_tokens: int) -> tuple[list[int], list[tuple[int, int]]]:
        """Extend ``seq``; returns (new slot ids, (src, dst) blocks the caller copies in every layer before writing)."""
        num_tokens = check_int("num_tokens", num_tokens, low=0)
        cost = self.append_cost(seq, num_tokens)
        if cost > len(self._free):
            raise OutOfBlocks(cost, len(self._free), f"append {num_tokens} tokens to {seq!r}")
        table, length = self._tables[seq], self._lens[seq]
        cow: list[tuple[int, int]] = []
        if num_tokens > 0 and length % self.block_size and self._ref[table[-1]] > 1:
            src = table[-1]
            dst = self._take()
            self._ref[src] -= 1  # still > 0: another sequence holds it
            table[-1] = dst
            cow.append((src, dst))
        while len(table) < self.blocks_for(length + num_tokens):
            table.append(self._take())
        self._lens[seq] = length + num_tokens
        return self.slots(seq, length, length + num_tokens), cow

    def truncate(self, seq: Hashable, new_len: int) -> None:
        """Shrink ``seq`` to ``new_len`` tokens (a shared partial block is copied on the next append)."""
        new_len = check_int("new_len", new_len, low=0, high=self._lens[seq])
        table = self._tables[seq]
        keep = self.blocks_for(new_len)
        for b in table[keep:]:
            self._release(b)
        del table[keep:]
        self._lens[seq] = int(new_len)

    def free(self, seq: Hashable) -> None:
        for b in self._tables.pop(seq):
            self._release(b)
        del self._lens[seq]

    def _take(self) -> int:
        b = self._free.popleft()
        self._ref[b] = 1
        return b

    def _release(self, b: int) -> None:
        self._ref[b] -= 1
        if self._ref[b] == 0:
            self._free.append(b)
