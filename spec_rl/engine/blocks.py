"""Block manager for the paged KV cache: refcounted fixed-size blocks.

Every sequence owns a *block table* (a list of block ids); token position
``p`` of a sequence lives in slot ``table[p // block_size] * block_size +
p % block_size`` (the slot-mapping convention of :mod:`spec_rl.ops`, after
vLLM). Blocks are refcounted so that the G samples of a group can share their
prompt's blocks (:meth:`BlockManager.fork`). A sequence that appends into a
partially filled block that another sequence also holds first gets a private
copy of it (copy-on-write): :meth:`BlockManager.append_slots` returns the
``(src, dst)`` pairs the engine must copy with :func:`spec_rl.ops.copy_blocks`
in every layer *before* writing new K/V (docs/design.md "Paged KV cache").
The design follows the readable block manager of nano-vllm (refcounted
blocks, a free list); no code is taken from it.

Failure is explicit and atomic: an operation that needs more free blocks than
exist raises :class:`OutOfBlocks`, and one with a bad argument (a token count
that is not an integer >= 0, an unknown block) raises before changing any state.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable

from ..util.validation import check_int


class OutOfBlocks(RuntimeError):
    """Not enough free KV-cache blocks for the requested operation.

    Raised before any state is changed, so the caller can wait for running
    sequences to finish (or free some) and retry.

    Attributes:
        needed: blocks the operation needs.
        free: blocks free at the time.
    """

    def __init__(self, needed: int, free: int, what: str = ""):
        self.needed = int(needed)
        self.free = int(free)
        msg = f"need {needed} free KV-cache blocks but only {free} are free"
        if what:
            msg += f" ({what})"
        super().__init__(msg + "; finish or free sequences first, or build the engine with more num_blocks")


class BlockManager:
    """Refcounted fixed-size blocks and per-sequence block tables.

    Args:
        num_blocks: blocks in the cache (>= 1).
        block_size: tokens per block (>= 1).

    Sequences are identified by any hashable id chosen by the caller.

    Raises:
        TypeError: a size or token count that is not an integer (floats are never truncated).
        ValueError: a size < 1 or a negative token count.
    """

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = check_int("num_blocks", num_blocks, low=1)
        self.block_size = check_int("block_size", block_size, low=1)
        self._free: deque[int] = deque(range(self.num_blocks))
        self._ref = [0] * self.num_blocks
        self._tables: dict[Hashable, list[int]] = {}
        self._lens: dict[Hashable, int] = {}

    # ------------------------------------------------------------------ queries
    @property
    def num_free(self) -> int:
        """Blocks with refcount 0."""
        return len(self._free)

    def refcount(self, block: int) -> int:
        """References to ``block`` (0: free).

        Raises:
            IndexError: ``block`` is not in [0, num_blocks).
        """
        block = check_int("block", block)
        if not 0 <= block < self.num_blocks:
            raise IndexError(f"block {block} is outside [0, {self.num_blocks})")
        return self._ref[block]

    def has(self, seq: Hashable) -> bool:
        return seq in self._tables

    def sequences(self) -> list[Hashable]:
        return list(self._tables)

    def length(self, seq: Hashable) -> int:
        """Tokens (slots) the sequence holds."""
        self._require(seq)
        return self._lens[seq]

    def block_table(self, seq: Hashable) -> list[int]:
        """A copy of the sequence's block table (block ids, in position order)."""
        self._require(seq)
        return list(self._tables[seq])

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens: ceil(num_tokens / block_size)."""
        return -(-int(num_tokens) // self.block_size)

    def slots(self, seq: Hashable, start: int, end: int) -> list[int]:
        """Slot ids of positions [start, end) of ``seq`` (must be < its length)."""
        self._require(seq)
        if not (0 <= start <= end <= self._lens[seq]):
            raise ValueError(f"positions [{start}, {end}) are outside sequence {seq!r} of length {self._lens[seq]}")
        table, bs = self._tables[seq], self.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def append_cost(self, seq: Hashable, num_tokens: int) -> int:
        """Free blocks :meth:`append_slots` would take for ``num_tokens`` more tokens (new blocks + copy-on-write)."""
        self._require(seq)
        length, table = self._lens[seq], self._tables[seq]
        new = self.blocks_for(length + num_tokens) - len(table)
        cow = 1 if num_tokens > 0 and length % self.block_size and self._ref[table[-1]] > 1 else 0
        return new + cow

    def can_allocate(self, num_blocks: int) -> bool:
        """Whether ``num_blocks`` blocks are free now."""
        return num_blocks <= len(self._free)

    # ---------------------------------------------------------------- mutations
    def allocate(self, seq: Hashable, num_tokens: int) -> list[int]:
        """Create ``seq`` holding ``num_tokens`` slots in fresh blocks; returns their slot ids.

        Raises:
            ValueError: ``seq`` exists already or ``num_tokens`` < 0.
            OutOfBlocks: too few free blocks (nothing changed).
        """
        num_tokens = check_int("num_tokens", num_tokens, low=0)
        if seq in self._tables:
            raise ValueError(f"sequence {seq!r} already exists; free it first")
        need = self.blocks_for(num_tokens)
        if need > len(self._free):
            raise OutOfBlocks(need, len(self._free), f"allocate {num_tokens} tokens for {seq!r}")
        self._tables[seq] = [self._take() for _ in range(need)]
        self._lens[seq] = int(num_tokens)
        return self.slots(seq, 0, num_tokens)

    def fork(self, parent: Hashable, child: Hashable, length: int | None = None) -> None:
        """Create ``child`` sharing ``parent``'s blocks for its first ``length`` tokens (default: all).

        No block is copied now; shared blocks get one more reference. A later
        append into a shared, partially filled block copies it (see :meth:`append_slots`).

        Raises:
            ValueError: unknown parent, existing child, or ``length`` > parent's length.
        """
        self._require(parent)
        if child in self._tables:
            raise ValueError(f"sequence {child!r} already exists; free it first")
        plen = self._lens[parent]
        length = plen if length is None else check_int("length", length)
        if not 0 <= length <= plen:
            raise ValueError(f"fork length must be in [0, {plen}] (the parent's length), got {length}")
        shared = self._tables[parent][: self.blocks_for(length)]
        for b in shared:
            self._ref[b] += 1
        self._tables[child] = list(shared)
        self._lens[child] = length

    def append_slots(self, seq: Hashable, num_tokens: int) -> tuple[list[int], list[tuple[int, int]]]:
        """Extend ``seq`` by ``num_tokens`` slots.

        Returns:
            (slot ids of the new positions, copy-on-write pairs [(src, dst)]).
            The caller must copy every pair (``ops.copy_blocks``) in every
            layer before writing K/V to the new slots.

        Raises:
            OutOfBlocks: too few free blocks (nothing changed).
        """
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
        """Shrink ``seq`` to ``new_len`` tokens; blocks past it lose this sequence's reference.

        A shared block that ends up partially filled stays shared; the next
        append into it copies it first (copy-on-write), so other holders never see the write.
        """
        self._require(seq)
        new_len = check_int("new_len", new_len)
        if not 0 <= new_len <= self._lens[seq]:
            raise ValueError(f"new_len must be in [0, {self._lens[seq]}] (the current length), got {new_len}")
        table = self._tables[seq]
        keep = self.blocks_for(new_len)
        for b in table[keep:]:
            self._release(b)
        del table[keep:]
        self._lens[seq] = int(new_len)

    def free(self, seq: Hashable) -> None:
        """Drop ``seq``; its blocks lose one reference (freed at zero)."""
        self._require(seq)
        for b in self._tables.pop(seq):
            self._release(b)
        del self._lens[seq]

    def check_invariants(self) -> None:
        """Raise AssertionError if refcounts, tables and the free list disagree (for tests)."""
        counts = [0] * self.num_blocks
        for seq, table in self._tables.items():
            assert len(table) == self.blocks_for(self._lens[seq]), f"{seq!r}: table size does not match length"
            assert len(set(table)) == len(table), f"{seq!r}: block listed twice"
            for b in table:
                counts[b] += 1
        assert counts == self._ref, "refcounts differ from the number of tables holding each block"
        free = list(self._free)
        assert len(set(free)) == len(free), "free list has duplicates"
        assert set(free) == {b for b in range(self.num_blocks) if counts[b] == 0}, "free list != blocks with refcount 0"

    # ----------------------------------------------------------------- helpers
    def _require(self, seq: Hashable) -> None:
        if seq not in self._tables:
            raise KeyError(f"unknown sequence {seq!r}")

    def _take(self) -> int:
        b = self._free.popleft()
        self._ref[b] = 1
        return b

    def _release(self, b: int) -> None:
        self._ref[b] -= 1
        if self._ref[b] == 0:
            self._free.append(b)
