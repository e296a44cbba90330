"""Paged KV cache bookkeeping: a pool of fixed-size blocks and each request's block table.

Only ids live here; the KV tensor itself belongs to the model runner. Free blocks are handed out
from the front of a FIFO and returned to its back, so ids are deterministic (tests assert them).
A request's blocks cover its `num_tokens` slots; `rewind` drops the last n (rejected drafts).
`kv_slots` turns block tables and positions into KV-cache slots (the step's slot mapping).

Prefix caching (vLLM's automatic prefix caching, in the same shape): a full block whose KV is final can
be registered under its chain hash (engine/core/prefix_hash.py). Blocks are reference-counted; a block
with no holder goes to the back of the free queue but keeps its KV and its hash, so a later request
with the same prefix takes it back (`touch`) instead of recomputing it. It is evicted, its hash
forgotten, only when the front of the free queue reaches it and a block is needed: least recently
freed first, and within one request's table, its tail before its head (a table is freed tail first,
so a shared head outlives the suffixes hanging off it).
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # front: evicted first
        self._refs = [0] * num_blocks
        self._hash_of: list[int | None] = [None] * num_blocks
        self._cached: dict[int, int] = {}  # block hash -> block id
        self.num_evicted = 0

    @property
    def num_free(self) -> int:
        """Blocks nobody holds: empty ones and cached ones (evictable)."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached(self) -> int:
        """Blocks registered under a hash, held or not."""
        return len(self._cached)

    def refs(self, block: int) -> int:
        return self._refs[block]

    def take(self, n: int) -> list[int]:
        """n blocks for new KV, from the front of the free queue; a cached block taken is evicted."""
        assert n <= len(self._free), (n, len(self._free))
        ids = []
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            self._evict(block)
            self._refs[block] = 1
            ids.append(block)
        return ids

    def give_back(self, ids: list[int]) -> None:
        """Drop one reference to each block; a block nobody holds joins the back of the free queue, in
        the order given (its KV and hash stay until it is evicted)."""
        for i in ids:
            assert self._refs[i] > 0, f"block {i} freed twice"
            self._refs[i] -= 1
            if self._refs[i] == 0:
                self._free[i] = None

    # ---- prefix caching
    def lookup(self, hashes: list[int]) -> list[int]:
        """The blocks of the longest cached prefix of `hashes` (a chain: the first miss ends it)."""
        hits = []
        for h in hashes:
            block = self._cached.get(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def touch(self, ids: list[int]) -> None:
        """Take a reference to cached blocks (a prefix hit); free ones leave the free queue."""
        for i in ids:
            assert self._hash_of[i] is not None, f"block {i} is not cached"
            if self._refs[i] == 0:
                del self._free[i]
            self._refs[i] += 1

    def register(self, block: int, block_hash: int) -> bool:
        """Make a held block with final KV findable under its hash; False when another block already
        holds that hash (two requests computed the same prefix at once: the first stays the cached one)."""
        assert self._refs[block] > 0, f"block {block} is not held"
        if self._hash_of[block] is not None:
            assert self._hash_of[block] == block_hash, (block, self._hash_of[block], block_hash)
            return True
        if block_hash in self._cached:
            return False
        self._cached[block_hash] = block
        self._hash_of[block] = block_hash
        return True

    def forget(self, ids: list[int]) -> None:
        """Blocks leaving the pool's keeping (set aside for the hand-over stock) stop being findable: their
        next content will not be the one their hash names."""
        for i in ids:
            self._evict(i)

    def is_cached(self, block: int) -> bool:
        return self._hash_of[block] is not None

    def hash_of(self, block: int) -> int | None:
        """The hash a cached block is registered under (None: not cached)."""
        return self._hash_of[block]

    def cached_hashes(self) -> list[int]:
        """Every hash this pool can serve now (what a replica reports for cache-aware routing)."""
        return list(self._cached)

    def reset_cache(self) -> int:
        """Forget every cached block nobody holds (their KV becomes plain free space); -> how many."""
        dropped = [b for b in self._free if self._hash_of[b] is not None]
        for b in dropped:
            self._evict(b)
        return len(dropped)

    def _evict(self, block: int) -> None:
        h = self._hash_of[block]
        if h is not None:
            del self._cached[h]
            self._hash_of[block] = None
            self.num_evicted += 1


class BlockManager:
    """Per-request block tables over one BlockPool."""

    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.tables: dict[str, list[int]] = {}
        self.num_slots: dict[str, int] = {}  # slots (token positions) each request holds

    def blocks_needed(self, request_id: str, num_slots: int) -> int:
        have = len(self.tables.get(request_id, ()))
        return max(0, -(-num_slots // self.block_size) - have)

    def allocate(self, request_id: str, num_slots: int) -> bool:
        """Grow the request's table to cover `num_slots` positions. False (nothing taken) if out of blocks."""
        need = self.blocks_needed(request_id, num_slots)
        if need > self.pool.num_free:
            return False
        self.tables.setdefault(request_id, []).extend(self.pool.take(need))
        self.num_slots[request_id] = max(num_slots, self.num_slots.get(request_id, 0))
        return True

    def allocate_cached(self, request_id: str, hashes: list[int], max_blocks: int) -> int:
        """A new request's table starts with the cached blocks of its longest cached prefix (at most
        `max_blocks` of them: the caller keeps the block that holds the prompt's last token out, so that
        token is computed and no step writes into a shared block); -> the tokens they cover."""
        assert request_id not in self.tables, request_id
        hits = self.pool.lookup(hashes[:max_blocks])
        if not hits:
            return 0
        self.pool.touch(hits)
        self.tables[request_id] = hits
        self.num_slots[request_id] = len(hits) * self.block_size
        return len(hits) * self.block_size

    def cache_blocks(self, request_id: str, hashes: list[int], num_final_tokens: int, start: int = 0) -> int:
        """Register the request's full blocks whose KV is final (every slot below `num_final_tokens`
        written for good, the draft head's included) under their hashes, from block `start` (those before
        it were registered already); -> blocks newly registered."""
        table = self.tables.get(request_id, ())
        n = min(num_final_tokens // self.block_size, len(hashes), len(table))
        new = 0
        for b in range(start, n):
            if not self.pool.is_cached(table[b]):
                new += self.pool.register(table[b], hashes[b])
        return new

    def rewind(self, request_id: str, n: int) -> None:
        """Forget the request's last n slots; blocks no longer covering any slot go back to the pool."""
        held = self.num_slots.get(request_id, 0)
        assert 0 <= n <= held, (n, held)
        keep_slots = held - n
        table = self.tables.get(request_id, [])
        keep = -(-keep_slots // self.block_size)
        dropped = table[keep:]
        assert not any(self.pool.is_cached(b) for b in dropped), "rewound into a cached block"
        del table[keep:]
        # Blocks at the end of a chain are returned last-first so the most recent are reused last.
        self.pool.give_back(list(reversed(dropped)))
        self.num_slots[request_id] = keep_slots

    def free(self, request_id: str) -> None:
        table = self.tables.pop(request_id, [])
        self.num_slots.pop(request_id, None)
        self.pool.give_back(list(reversed(table)))

    # ---- blocks set aside outside the tables (the decode side's hand-over stock, decode_worker/stock.py)
    def set_aside(self, n: int) -> list[int] | None:
        """Take n blocks out of the pool for whoever keeps them (they count as used); None if fewer are free.
        All or nothing, so that ranks with equal pools make equal decisions."""
        if n > self.pool.num_free:
            return None
        return self.pool.take(n)

    def adopt(self, request_id: str, block_ids: list[int], num_slots: int) -> None:
        """Set-aside blocks become the table of a request (which holds none yet) covering num_slots."""
        assert request_id not in self.tables, request_id
        assert len(block_ids) == -(-num_slots // self.block_size), (len(block_ids), num_slots)
        self.tables[request_id] = list(block_ids)
        self.num_slots[request_id] = num_slots

    def disown(self, request_id: str, held: int = 0) -> list[int]:
        """Undo `adopt`: the request's blocks leave its table without returning to the pool, except its first
        `held` ones, which were references of its own (a pinned prefix, `attach`): those are given back."""
        self.num_slots.pop(request_id, None)
        blocks = self.tables.pop(request_id, [])
        self.pool.give_back(list(reversed(blocks[:held])))
        self.pool.forget(blocks[held:])
        return blocks[held:]

    def attach(self, request_id: str, held: list[int]) -> None:
        """A request (holding no table yet) starts with blocks it already holds a reference to (a hand-over's
        prefix pinned on the decode side): its table covers their slots; `allocate` grows it past them."""
        assert request_id not in self.tables, request_id
        self.tables[request_id] = list(held)
        self.num_slots[request_id] = len(held) * self.block_size

    def swap(self, request_id: str, block_ids: list[int], start: int = 0) -> list[int]:
        """Replace the request's blocks from index `start` on (those before are a reused prefix it keeps) by
        set-aside ones of the same count; returns the old (now set aside)."""
        table = self.tables[request_id]
        old = table[start:]
        assert len(old) == len(block_ids), (len(old), len(block_ids))
        table[start:] = block_ids
        self.pool.forget(old)
        return old

    def table(self, request_id: str) -> list[int]:
        return self.tables.get(request_id, [])

    def slot(self, request_id: str, position: int) -> int:
        table = self.tables[request_id]
        return table[position // self.block_size] * self.block_size + position % self.block_size


def kv_slots(tables: np.ndarray, rows, positions: np.ndarray, block_size: int) -> np.ndarray:
    """KV-cache slot of each (block-table row, position): tables [B, M] int32, rows [T] (or one row),
    positions [T] int64 -> [T] int64. Positions past the table's width read its last block (padding)."""
    blocks = tables[rows, np.minimum(positions // block_size, tables.shape[1] - 1)].astype(np.int64)
    return blocks * block_size + positions % block_size
