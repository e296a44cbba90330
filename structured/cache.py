"""GrammarCache: compiled grammars by content key, bounded by entry count and by bytes, least recently
used first out.

Entries are futures (a compile runs on a thread while the prompt runs), so an entry's size is known only
once its compile finishes: a pending entry counts 0 bytes, and `settle` (called by the compile before it
completes the future, so a waiter never sees a stale size) records its size and evicts. A failed
compile leaves the cache, so the same source is compiled again next time. An entry
larger than the whole byte bound is not kept; whoever holds its future still has the grammar.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future
from typing import Callable

DEFAULT_MAX_CACHED = 512
DEFAULT_MAX_CACHE_BYTES = 256 * 2**20


def compiled_size(compiled) -> int:
    """Bytes an xgrammar CompiledGrammar holds (its own accounting: the grammar plus the adaptive token
    masks, which dominate)."""
    return int(compiled.memory_size_bytes)


class GrammarCache:
    def __init__(self, max_entries: int = DEFAULT_MAX_CACHED, max_bytes: int = DEFAULT_MAX_CACHE_BYTES,
                 size_of: Callable[[object], int] = compiled_size):
        if max_entries < 1 or max_bytes < 1:
            raise ValueError(f"a grammar cache needs room: max_entries={max_entries}, max_bytes={max_bytes}")
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._size_of = size_of
        self._entries: OrderedDict[str, Future] = OrderedDict()  # least recently used first
        self._sizes: dict[str, int] = {}  # settled entries only
        self.nbytes = 0  # sum of _sizes
        self.lock = threading.Lock()  # callers hold it across look-up and insert (compile once per key)

    # All methods below expect `self.lock` held by the caller.
    def get(self, key: str) -> Future | None:
        """The live entry (not failed), now the most recently used; None if absent or failed."""
        fut = self._entries.get(key)
        if fut is None:
            return None
        # A failure whose callback has not run yet (callbacks follow the waiters' wake-up) is stale too.
        if fut.done() and (fut.cancelled() or fut.exception() is not None):
            return None
        self._entries.move_to_end(key)
        return fut

    def peek(self, key: str) -> Future | None:
        """The entry without touching its recency."""
        return self._entries.get(key)

    def put(self, key: str, fut: Future) -> None:
        """Insert (or replace) as the most recently used; sized at once if already done."""
        self._drop(key)
        self._entries[key] = fut
        if fut.done() and not fut.cancelled() and fut.exception() is None:
            self._sized(key, fut.result())
        self._evict()

    def settle(self, key: str, fut: Future, compiled) -> None:
        """`fut`'s compile produced `compiled` (None: it failed): record its size and evict, or drop the
        entry; nothing happens if `fut` is no longer the entry of `key`."""
        if self._entries.get(key) is not fut:
            return
        if compiled is None:
            self._drop(key)
            return
        self._sized(key, compiled)
        self._evict()

    def _sized(self, key: str, compiled) -> None:
        size = self._size_of(compiled)
        if size > self.max_bytes:  # it alone would empty the cache: keep the others instead
            self._drop(key)
            return
        self._sizes[key] = size
        self.nbytes += size

    def _drop(self, key: str) -> None:
        self._entries.pop(key, None)
        self.nbytes -= self._sizes.pop(key, 0)

    def _evict(self) -> None:
        while len(self._entries) > self.max_entries or self.nbytes > self.max_bytes:
            self._drop(next(iter(self._entries)))

    def keys(self) -> list[str]:
        """Least recently used first."""
        return list(self._entries)

    def __len__(self) -> int:
        return len(self._entries)
