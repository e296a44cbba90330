"""What an engine's prefix cache holds, as the BlockFilter bits a worker reports (cluster/protocol/block_filter.py):
a prefill replica in its routing stats (router/prefix_affinity.py picks the replica), a decode rank under attention
data parallelism in its StepReport (decode_worker/controller.py picks the rank).

Rebuilt only when the cache changed: every registration changes the pool's cached count, every eviction its
evicted count, so an unchanged pair is an unchanged set. A decode rank registers blocks as it decodes, so it also
rebuilds at most every `min_interval_s` while it is busy (the view may lag that long, which only costs a placement
a little reuse), and at once when it goes idle (its last report before a pause must hold what it cached).
"""
from __future__ import annotations

import time

from cluster.protocol.block_filter import BlockFilter


class PrefixView:
    def __init__(self, min_interval_s: float = 0.0, clock=time.monotonic):
        self.min_interval_s = min_interval_s
        self.clock = clock
        self._key: tuple[int, int] | None = None  # the pool's (cached, evicted) counts the bits were built at
        self._bits = b""
        self._built_at = float("-inf")
        self._sent: bytes | None = None

    def bits(self, engine, force: bool = False) -> bytes:
        """The filter's bits now (b"": prefix caching off, or nothing cached). force: rebuild if the cache
        changed, even within min_interval_s (a rank going idle: no report may follow for a while)."""
        if engine.prefix_cache is None:
            return b""
        pool = engine.blocks.pool
        key = (pool.num_cached, pool.num_evicted)
        now = self.clock()
        if key != self._key and (force or now - self._built_at >= self.min_interval_s):
            # The engine thread may register blocks meanwhile: list() of a dict copies it under the GIL.
            hashes = pool.cached_hashes()
            self._key, self._bits, self._built_at = key, BlockFilter.build(hashes, len(hashes)).bits, now
        return self._bits

    def changed(self, engine, force: bool = False) -> bytes | None:
        """The bits if they changed since this last returned them, else None (nothing to send)."""
        bits = self.bits(engine, force)
        if bits is self._sent:  # the same object: not rebuilt since (b"" is one object too)
            return None
        self._sent = bits
        return bits
