"""HandoverStock: KV blocks a decode rank sets aside so that an incoming hand-over's blocks are reserved
the moment its header arrives, on the channel's own thread, instead of at the group's next step.

Without it a header waits for a step boundary to be reported, then for the next one to reserve blocks in
lockstep (`RESERVE`), and only then may its payload come: on a busy group that is two steps of waiting
per hand-over. The stock is the rank's private pool of set-aside blocks (they count as used in the
engine's pool, so scheduling never sees them): a channel thread takes a request's blocks from it,
receives the payload straight into them, and the group commits the request at its next step.

On by default (DecodeConfig.handover_stock = 0.125): it is what lets a hand-over join without waiting for
the group's steps (bench/results/served_vs_engine_cpu.md, 2 quiet CPU cores, concurrency 64, with a step
queued ahead: +21% tok/s, 2nd-token p50 3.4 s -> 1.1 s; without the stock every hand-over costs a lockstep
RESERVE at a step boundary, and the prefill sends them one after another). An earlier measurement on a
heavily loaded 2-core CPU saw TTFT rise at concurrency 16 with it (bench/results/handover_cpu.md).

What keeps tensor-parallel ranks consistent: the engine's own pool must change identically on every
rank at the same step, whatever each rank's threads did. So the stock never gives to or takes from the
engine's pool outside a lockstep command, and each request changes the engine's pool by the same amount
at the same command on every rank: at `RESERVE` (sent to every rank when some rank found its stock empty
and parked the header) the blocks are allocated as on the plain path and swapped for the stock's at
`COMMIT`; without a `RESERVE` the stock's blocks are adopted at `COMMIT` and the stock is refilled from
the engine's pool, all or nothing (`owed` carries a refill that did not fit to a later step).
"""
from __future__ import annotations

import threading


class HandoverStock:
    def __init__(self, block_ids: list[int] | None = None):
        self._lock = threading.Lock()
        self._free: list[int] = list(block_ids or [])
        self.owed = 0  # blocks adopted by requests and not yet refilled (step thread only)

    def take(self, n: int) -> list[int] | None:
        """n blocks for one hand-over (any thread); None if the stock holds fewer."""
        with self._lock:
            if n > len(self._free):
                return None
            ids, self._free = self._free[:n], self._free[n:]
            return ids

    def give(self, block_ids: list[int]) -> None:
        with self._lock:
            self._free.extend(block_ids)

    @property
    def num_free(self) -> int:
        with self._lock:
            return len(self._free)
