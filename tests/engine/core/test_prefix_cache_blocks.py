"""Prefix caching in the block pool: chain hashes, reference counts, hits, and eviction order (exact ids)."""
from __future__ import annotations

import pytest

from engine.core.block_manager import BlockManager
from engine.core.prefix_hash import ROOT, block_hash, extend_hashes, namespace_hash

NS = namespace_hash("m")


def hashes_of(tokens: list[int], block_size: int = 4, ns: int = NS) -> list[int]:
    return extend_hashes([], tokens, block_size, ns)


def test_the_chain_commits_to_every_earlier_token_and_the_namespace():
    a = hashes_of(list(range(12)))
    assert len(a) == 3 and len(set(a)) == 3
    b = hashes_of([99] + list(range(1, 12)))  # first token differs: every block differs
    assert all(x != y for x, y in zip(a, b))
    c = hashes_of(list(range(8)) + [0, 0, 0, 0])  # only the last block differs
    assert c[:2] == a[:2] and c[2] != a[2]
    assert hashes_of(list(range(12)), ns=namespace_hash("m", "salt"))[0] != a[0]
    assert hashes_of(list(range(12)), ns=namespace_hash("other"))[0] != a[0]
    assert hashes_of(list(range(11))) == a[:2]  # a partial block has no hash
    assert a[0] == block_hash(ROOT, [0, 1, 2, 3], NS)  # stable: a pure function of its inputs


def test_extending_is_incremental():
    tokens = list(range(10))
    h = hashes_of(tokens[:5])
    assert extend_hashes(h, tokens, 4, NS) == hashes_of(tokens)


def test_a_second_request_with_the_prefix_shares_the_blocks():
    bm = BlockManager(num_blocks=8, block_size=4)
    prompt = list(range(10))
    h = hashes_of(prompt)
    assert bm.allocate_cached("a", h, max_blocks=(len(prompt) - 1) // 4) == 0
    assert bm.allocate("a", 10)
    assert bm.table("a") == [0, 1, 2]
    assert bm.cache_blocks("a", h, num_final_tokens=10) == 2  # the partial third block is not cached
    got = bm.allocate_cached("b", h, max_blocks=(len(prompt) - 1) // 4)
    assert got == 8 and bm.table("b") == [0, 1]
    assert bm.pool.refs(0) == 2 and bm.pool.refs(1) == 2
    assert bm.allocate("b", 10) and bm.table("b") == [0, 1, 3]
    assert bm.pool.num_used == 4


def test_the_block_holding_the_last_prompt_token_is_never_a_hit():
    """An 8-token prompt (two full blocks) may reuse one: its last token must be computed for its logits,
    and computing it writes the second block, which may be shared."""
    bm = BlockManager(num_blocks=8, block_size=4)
    h = hashes_of(list(range(8)))
    bm.allocate("a", 8)
    bm.cache_blocks("a", h, 9)
    assert bm.allocate_cached("b", h, max_blocks=(8 - 1) // 4) == 4


def test_freed_cached_blocks_stay_findable_until_evicted_tail_first():
    bm = BlockManager(num_blocks=4, block_size=4)
    h = hashes_of(list(range(12)))
    bm.allocate("a", 12)
    bm.cache_blocks("a", h, 12)
    bm.free("a")
    assert bm.pool.num_free == 4 and bm.pool.num_cached == 3  # free, yet still cached
    # the free queue: the never-used block 3, then a's blocks tail first: 3, 2, 1, 0
    assert bm.allocate("x", 4) and bm.table("x") == [3]  # the never-used block goes first
    assert bm.pool.num_cached == 3
    assert bm.allocate("y", 4) and bm.table("y") == [2]  # then a's tail: its hash is forgotten
    assert bm.pool.num_cached == 2 and bm.pool.num_evicted == 1
    assert bm.allocate_cached("b", h, max_blocks=3) == 8 and bm.table("b") == [0, 1]


def test_a_hit_revives_a_free_block_and_protects_it_from_eviction():
    bm = BlockManager(num_blocks=3, block_size=2)
    h = hashes_of([1, 2, 3, 4], block_size=2)
    bm.allocate("a", 4)
    bm.cache_blocks("a", h, 4)
    bm.free("a")  # free queue: 2, 1, 0
    assert bm.allocate_cached("b", h, max_blocks=2) == 4 and bm.table("b") == [0, 1]
    assert bm.pool.num_free == 1
    assert not bm.allocate("c", 4)  # two blocks needed, one free: the shared ones are not taken
    assert bm.allocate("c", 2) and bm.table("c") == [2]


def test_the_same_prefix_computed_twice_keeps_the_first_block_cached():
    bm = BlockManager(num_blocks=4, block_size=2)
    h = hashes_of([5, 6], block_size=2)
    bm.allocate("a", 2)
    bm.allocate("b", 2)
    assert bm.cache_blocks("a", h, 2) == 1
    assert bm.cache_blocks("b", h, 2) == 0  # b's block stays private and goes back plain
    assert bm.pool.lookup(h) == bm.table("a")
    bm.free("b")
    assert bm.pool.num_cached == 1


def test_rewinding_never_drops_a_cached_block():
    bm = BlockManager(num_blocks=4, block_size=2)
    h = hashes_of([1, 2, 3, 4], block_size=2)
    bm.allocate("a", 6)
    bm.cache_blocks("a", h, 4)
    bm.rewind("a", 2)  # the uncached third block goes
    assert bm.table("a") == [0, 1]
    with pytest.raises(AssertionError, match="cached"):
        bm.rewind("a", 2)


def test_reset_forgets_only_unheld_cached_blocks():
    bm = BlockManager(num_blocks=4, block_size=2)
    h = hashes_of([1, 2, 3, 4], block_size=2)
    bm.allocate("a", 4)
    bm.cache_blocks("a", h, 4)
    bm.allocate_cached("b", h, max_blocks=1)
    bm.free("a")
    assert bm.pool.reset_cache() == 1  # block 1: free and cached; block 0 is held by b
    assert bm.pool.lookup(h) == [0]


def test_every_reference_returns():
    """Many requests over a shared prefix, freed in any order: every block free again, cached ones findable."""
    import random

    rng = random.Random(0)
    bm = BlockManager(num_blocks=64, block_size=4)
    system = list(range(100, 116))
    live = []
    for i in range(200):
        prompt = system + [rng.randrange(50) for _ in range(rng.randrange(1, 9))]
        h = hashes_of(prompt)
        rid = f"r{i}"
        bm.allocate_cached(rid, h, max_blocks=(len(prompt) - 1) // 4)
        if not bm.allocate(rid, len(prompt) + 4):
            bm.free(rid)
            continue
        bm.cache_blocks(rid, h, len(prompt))
        live.append(rid)
        while live and (len(live) > 6 or rng.random() < 0.3):
            bm.free(live.pop(rng.randrange(len(live))))
    for rid in live:
        bm.free(rid)
    assert bm.pool.num_free == 64 and bm.pool.num_used == 0
    assert all(bm.pool.refs(b) == 0 for b in range(64))
    assert len(bm.pool.lookup(hashes_of(system))) == 4  # the shared system prompt survived every eviction


def test_blocks_set_aside_for_the_stock_stop_being_findable():
    """The hand-over stock reuses swapped-out and disowned blocks for other payloads: their hashes must go."""
    bm = BlockManager(num_blocks=8, block_size=2)
    h = hashes_of([1, 2, 3, 4], block_size=2)
    bm.allocate("a", 4)
    bm.cache_blocks("a", h, 4)
    stock = bm.set_aside(2)
    old = bm.swap("a", stock)
    assert bm.pool.lookup(h) == [] and not any(bm.pool.is_cached(b) for b in old)
    bm.cache_blocks("a", h, 4)
    assert bm.pool.lookup(h) == stock
    assert bm.disown("a") == stock and bm.pool.lookup(h) == []
