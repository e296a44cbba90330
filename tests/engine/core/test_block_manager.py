"""engine/core/block_manager.py: exact block ids on allocate, free and rewind."""
import pytest

from engine.core.block_manager import BlockManager, BlockPool


def test_allocate_takes_lowest_free_ids_in_order():
    bm = BlockManager(num_blocks=8, block_size=4)
    assert bm.allocate("a", 5)  # 2 blocks
    assert bm.table("a") == [0, 1]
    assert bm.allocate("b", 4)
    assert bm.table("b") == [2]
    assert bm.allocate("a", 9)  # grows by one block
    assert bm.table("a") == [0, 1, 3]
    assert bm.allocate("a", 12)  # still inside block 3
    assert bm.table("a") == [0, 1, 3]
    assert bm.pool.num_free == 4


def test_free_returns_blocks_to_the_back_last_block_first():
    bm = BlockManager(num_blocks=6, block_size=2)
    bm.allocate("a", 5)  # [0, 1, 2]
    bm.allocate("b", 2)  # [3]
    bm.free("a")
    assert bm.pool.num_free == 5
    # free list now: 4, 5, then a's blocks last-first: 2, 1, 0
    bm.allocate("c", 10)
    assert bm.table("c") == [4, 5, 2, 1, 0]
    assert not bm.allocate("d", 1)  # nothing left, and nothing taken
    assert bm.table("d") == []


def test_rewind_drops_whole_blocks_only():
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.allocate("a", 10)  # slots 0..9 in blocks [0, 1, 2]
    bm.rewind("a", 1)  # 9 slots: still 3 blocks
    assert bm.table("a") == [0, 1, 2] and bm.num_slots["a"] == 9
    bm.rewind("a", 2)  # 7 slots: block 2 no longer used
    assert bm.table("a") == [0, 1] and bm.num_slots["a"] == 7
    assert bm.pool.num_free == 6
    bm.allocate("a", 13)  # regrows from the front of the free list: 3, 4, then the returned 2
    assert bm.table("a") == [0, 1, 3, 4]
    bm.rewind("a", 13)
    assert bm.table("a") == [] and bm.pool.num_free == 8


def test_slot_mapping():
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.allocate("x", 2)
    bm.allocate("a", 6)  # [1, 2]
    assert [bm.slot("a", p) for p in range(6)] == [4, 5, 6, 7, 8, 9]


def test_double_free_is_an_invariant_violation():
    pool = BlockPool(4)
    ids = pool.take(2)
    pool.give_back(ids)
    with pytest.raises(AssertionError):
        pool.give_back(ids[:1])
