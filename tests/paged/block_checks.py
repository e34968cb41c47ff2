"""Test-only views of a BlockManager's bookkeeping: refcounts, the sequences held, and the invariants that tie its
refcounts, block tables and free list together."""

from spec_rl.backends.paged.blocks import BlockManager


def refcount(mgr: BlockManager, block: int) -> int:
    """References to ``block`` (0: free)."""
    return mgr._ref[block]


def sequences(mgr: BlockManager) -> list:
    return list(mgr._tables)


def check_invariants(mgr: BlockManager) -> None:
    """AssertionError if refcounts, tables and the free list disagree."""
    counts = [0] * mgr.num_blocks
    for seq, table in mgr._tables.items():
        assert len(table) == mgr.blocks_for(mgr._lens[seq]), f"{seq!r}: table size does not match length"
        assert len(set(table)) == len(table), f"{seq!r}: block listed twice"
        for b in table:
            counts[b] += 1
    assert counts == mgr._ref, "refcounts differ from the number of tables holding each block"
    free = list(mgr._free)
    assert len(set(free)) == len(free), "free list has duplicates"
    assert set(free) == {b for b in range(mgr.num_blocks) if counts[b] == 0}, "free list != blocks with refcount 0"
