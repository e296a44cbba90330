"""Paged KV cache bookkeeping: a pool of fixed-size blocks and each request's block table.

Only ids live here; the KV tensor itself belongs to the model runner. Free blocks are handed out
from the front of a FIFO and returned to its back, so ids are deterministic (tests assert them).
A request's blocks cover its `num_tokens` slots; `rewind` drops the last n (rejected drafts).
`kv_slots` turns block tables and positions into KV-cache slots (the step's slot mapping).
"""
from __future__ import annotations

from collections import deque

import numpy as np


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._is_free = [True] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def take(self, n: int) -> list[int]:
        assert n <= len(self._free), (n, len(self._free))
        ids = [self._free.popleft() for _ in range(n)]
        for i in ids:
            self._is_free[i] = False
        return ids

    def give_back(self, ids: list[int]) -> None:
        for i in ids:
            assert not self._is_free[i], f"block {i} freed twice"
            self._is_free[i] = True
            self._free.append(i)


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

    def rewind(self, request_id: str, n: int) -> None:
        """Forget the request's last n slots; blocks no longer covering any slot go back to the pool."""
        held = self.num_slots.get(request_id, 0)
        assert 0 <= n <= held, (n, held)
        keep_slots = held - n
        table = self.tables.get(request_id, [])
        keep = -(-keep_slots // self.block_size)
        dropped = table[keep:]
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

    def disown(self, request_id: str) -> list[int]:
        """Undo `adopt`: the request's blocks leave its table without returning to the pool."""
        self.num_slots.pop(request_id, None)
        return self.tables.pop(request_id, [])

    def swap(self, request_id: str, block_ids: list[int]) -> list[int]:
        """Replace the request's blocks by set-aside ones of the same count; returns the old (now set aside)."""
        old = self.tables[request_id]
        assert len(old) == len(block_ids), (len(old), len(block_ids))
        self.tables[request_id] = list(block_ids)
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
