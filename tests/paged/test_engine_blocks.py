"""BlockManager: refcounts, free list, copy-on-write and truncation under random operations.

Besides the bookkeeping invariants, a fake cache (one value per slot) is
driven exactly as the engine drives the real one: copy-on-write pairs are
copied before the new slots are written. Every sequence must then read back
exactly the tokens it wrote, whatever its siblings did.
"""

import random

import pytest
from block_checks import check_invariants, refcount, sequences

from spec_rl.backends.paged.blocks import BlockManager, OutOfBlocks


class FakeCache:
    def __init__(self, mgr: BlockManager):
        self.mgr = mgr
        self.slots = [None] * (mgr.num_blocks * mgr.block_size)

    def copy(self, pairs):
        bs = self.mgr.block_size
        for src, dst in pairs:
            self.slots[dst * bs : (dst + 1) * bs] = self.slots[src * bs : (src + 1) * bs]

    def read(self, seq):
        return [self.slots[s] for s in self.mgr.slots(seq, 0, self.mgr.length(seq))]


def test_fork_shares_and_cow_copies_partial_block():
    mgr = BlockManager(num_blocks=8, block_size=4)
    cache = FakeCache(mgr)
    slots = mgr.allocate("a", 6)  # blocks: one full, one with 2 of 4 slots
    for s, tok in zip(slots, range(6)):
        cache.slots[s] = tok
    mgr.fork("a", "b")
    assert mgr.block_table("a") == mgr.block_table("b")
    assert all(refcount(mgr, b) == 2 for b in mgr.block_table("a"))
    assert mgr.num_free == 6
    new, cow = mgr.append_slots("b", 1)
    assert len(cow) == 1 and cow[0][0] == mgr.block_table("a")[1] and cow[0][1] == mgr.block_table("b")[1]
    cache.copy(cow)
    cache.slots[new[0]] = 100
    # the first (full) block stays shared, the partial one was copied
    assert mgr.block_table("a")[0] == mgr.block_table("b")[0]
    assert refcount(mgr, mgr.block_table("a")[0]) == 2 and refcount(mgr, mgr.block_table("a")[1]) == 1
    # a is now the only holder of its partial block: it writes in place
    new_a, cow_a = mgr.append_slots("a", 1)
    assert cow_a == []
    cache.slots[new_a[0]] = 200
    assert cache.read("a") == [0, 1, 2, 3, 4, 5, 200]
    assert cache.read("b") == [0, 1, 2, 3, 4, 5, 100]
    check_invariants(mgr)
    mgr.free("a")
    mgr.free("b")
    assert mgr.num_free == 8
    check_invariants(mgr)


def test_append_at_block_boundary_needs_no_copy():
    mgr = BlockManager(num_blocks=4, block_size=4)
    mgr.allocate("a", 4)
    mgr.fork("a", "b")
    _, cow = mgr.append_slots("b", 1)
    assert cow == []
    assert mgr.num_free == 2


def test_truncate_frees_blocks_and_shared_tail_is_copied_on_write():
    mgr = BlockManager(num_blocks=6, block_size=4)
    cache = FakeCache(mgr)
    for s, tok in zip(mgr.allocate("a", 10), range(10)):
        cache.slots[s] = tok
    assert mgr.num_free == 3
    mgr.truncate("a", 4)
    assert mgr.num_free == 5 and mgr.length("a") == 4
    mgr.fork("a", "b")
    mgr.truncate("b", 2)  # b's only block is shared and partial
    new, cow = mgr.append_slots("b", 3)
    assert len(cow) == 1
    cache.copy(cow)
    for s, tok in zip(new, (50, 51, 52)):
        cache.slots[s] = tok
    assert cache.read("a") == [0, 1, 2, 3]
    assert cache.read("b") == [0, 1, 50, 51, 52]
    check_invariants(mgr)


def test_out_of_blocks_is_atomic():
    mgr = BlockManager(num_blocks=3, block_size=2)
    mgr.allocate("a", 3)  # 2 blocks
    mgr.fork("a", "b")
    before = (mgr.num_free, mgr.block_table("a"), mgr.block_table("b"), mgr.length("b"))
    assert mgr.append_cost("b", 3) == 2  # copy of the shared partial block + one new block
    assert mgr.append_cost("b", 3) > mgr.num_free
    with pytest.raises(OutOfBlocks) as info:
        mgr.append_slots("b", 3)
    assert info.value.needed == 2 and info.value.free == 1
    assert (mgr.num_free, mgr.block_table("a"), mgr.block_table("b"), mgr.length("b")) == before
    with pytest.raises(OutOfBlocks):
        mgr.allocate("c", 5)
    assert not mgr.has("c")
    check_invariants(mgr)


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0, 4)
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(4, 0)
    mgr = BlockManager(4, 4)
    mgr.allocate("a", 2)
    with pytest.raises(AssertionError, match="already exists"):
        mgr.allocate("a", 1)
    with pytest.raises(ValueError, match="length must be <= 2, got 3"):
        mgr.fork("a", "b", length=3)
    with pytest.raises(ValueError, match="new_len must be <= 2, got 5"):
        mgr.truncate("a", 5)
    with pytest.raises(KeyError):
        mgr.free("zz")


@pytest.mark.parametrize("seed", range(6))
def test_random_operations_keep_invariants_and_contents(seed):
    rng = random.Random(seed)
    mgr = BlockManager(num_blocks=rng.choice([6, 12, 24]), block_size=rng.choice([1, 2, 4, 5]))
    cache = FakeCache(mgr)
    expected: dict[int, list] = {}
    next_id = 0
    token = 0
    for _ in range(400):
        op = rng.choice(["alloc", "fork", "append", "append", "truncate", "free"])
        seqs = list(expected)
        try:
            if op == "alloc" or not seqs:
                n = rng.randint(0, 3 * mgr.block_size)
                slots = mgr.allocate(next_id, n)
                toks = list(range(token, token + n))
                token += n
                for s, t in zip(slots, toks):
                    cache.slots[s] = t
                expected[next_id] = toks
                next_id += 1
            elif op == "fork":
                parent = rng.choice(seqs)
                length = rng.randint(0, len(expected[parent]))
                mgr.fork(parent, next_id, length)
                expected[next_id] = expected[parent][:length]
                next_id += 1
            elif op == "append":
                seq = rng.choice(seqs)
                n = rng.randint(0, 2 * mgr.block_size)
                cost = mgr.append_cost(seq, n)
                free_before = mgr.num_free
                if cost > free_before:
                    with pytest.raises(OutOfBlocks):
                        mgr.append_slots(seq, n)
                    continue
                slots, cow = mgr.append_slots(seq, n)
                assert free_before - mgr.num_free == cost
                cache.copy(cow)
                toks = list(range(token, token + n))
                token += n
                for s, t in zip(slots, toks):
                    cache.slots[s] = t
                expected[seq] += toks
            elif op == "truncate":
                seq = rng.choice(seqs)
                new_len = rng.randint(0, len(expected[seq]))
                mgr.truncate(seq, new_len)
                expected[seq] = expected[seq][:new_len]
            else:
                seq = rng.choice(seqs)
                mgr.free(seq)
                del expected[seq]
        except OutOfBlocks:
            pass  # allocate/fork never change state on failure; checked below
        check_invariants(mgr)
        assert set(sequences(mgr)) == set(expected)
        for seq, toks in expected.items():
            assert mgr.length(seq) == len(toks)
            assert cache.read(seq) == toks, f"sequence {seq} sees another sequence's writes"
    for seq in list(expected):
        mgr.free(seq)
    assert mgr.num_free == mgr.num_blocks
    check_invariants(mgr)
