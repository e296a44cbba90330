"""CallerWatch: ends the decode streams and the feed of a router replica that died.

Ray does not end a streaming call whose caller's process is gone: with a router killed mid-stream, the
decode group went on decoding its requests to their last token for nobody, holding their KV blocks all
the while (tests/router/test_faults.py). Each stream names the router that opened it (its Serve actor's
name); every CHECK_S this pings the routers that have requests or a feed subscription open and, for one
that is dead, hands its requests to `on_dead` and then the router itself to `on_gone`.

A router's feed stream (decode_worker/feed.py) outlives its requests: a router that died with none open
left its feed streaming for nobody, counted by Serve as an ongoing request of the decode replica for good
(in its load, and in every graceful shutdown, which then waited out its timeout and force-killed the
replica). So feed subscribers are watched too.

A name alone does not tell: Ray keeps a dead actor's name resolvable, so life is an answer to
`__ray_ready__`. A slow answer counts as alive (a busy router is not a dead one).
"""
from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import Callable

import ray

log = logging.getLogger(__name__)

# One ping per router per second is nothing next to a step; every second a dead router goes unnoticed its
# requests decode for nobody (at the zoo's CPU speed, ~100 steps a second).
CHECK_S = 1.0
# A router whose feed link closed is pinged this long even with nothing open here (its requests ended at the
# close): Ray learns of a killed process a few seconds after its sockets close, and its death is counted.
SUSPECT_S = 30.0
SERVE_NAMESPACE = "serve"  # where Ray Serve creates its replica actors (ray.serve._private.constants)


class CallerWatch:
    def __init__(self, on_dead: Callable[[str, str], None], check_s: float = CHECK_S,
                 on_gone: Callable[[str], None] | None = None):
        """on_dead(request_id, caller): the stream's router is gone; on_gone(caller): called after its
        requests', once per dead router (its feed can go)."""
        self.on_dead = on_dead
        self.on_gone = on_gone
        self.check_s = check_s
        self._streams: dict[str, str] = {}  # request id -> the caller's actor name
        self.subscribers: collections.Counter[str] = collections.Counter()  # caller -> its open feed streams
        self._suspects: dict[str, float] = {}  # caller -> until when it is pinged for its link's close
        self._handles: dict[str, object] = {}
        self._soon = asyncio.Event()
        self.callers_lost = 0

    def opened(self, request_id: str, caller: str | None) -> None:
        if caller:
            self._streams[request_id] = caller

    def closed(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def subscribed(self, caller: str | None) -> None:
        if caller:
            self.subscribers[caller] += 1

    def unsubscribed(self, caller: str | None) -> None:
        if caller and caller in self.subscribers:  # not when its death was already noticed
            self.subscribers[caller] -= 1
            if self.subscribers[caller] <= 0:
                del self.subscribers[caller]

    def check_now(self, caller: str | None = None) -> None:
        """Check without waiting out the period; `caller` (it closed its feed link: it may have died, and Ray
        may not know yet) is pinged for SUSPECT_S more even with nothing open here."""
        if caller:
            self._suspects[caller] = time.monotonic() + SUSPECT_S
        self._soon.set()

    async def run(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._soon.wait(), self.check_s)
            except asyncio.TimeoutError:
                pass
            self._soon.clear()
            now = time.monotonic()
            self._suspects = {n: until for n, until in self._suspects.items() if until > now}
            callers = set(self._streams.values()) | set(self.subscribers) | set(self._suspects)
            for name in [n for n in self._handles if n not in callers]:
                del self._handles[name]
            for name in callers:
                if await self._alive(name):
                    continue
                self.callers_lost += 1
                orphans = [rid for rid, c in self._streams.items() if c == name]
                log.warning("router %s is gone, with %d request(s) open here: ending them and its feed", name,
                            len(orphans))
                for rid in orphans:
                    self.closed(rid)
                    self.on_dead(rid, name)
                self.subscribers.pop(name, None)  # its feed stream ends (on_gone); it is not pinged again
                self._suspects.pop(name, None)
                if self.on_gone is not None:
                    self.on_gone(name)

    async def _alive(self, name: str) -> bool:
        try:
            handle = self._handles.get(name)
            if handle is None:
                handle = self._handles[name] = await asyncio.to_thread(ray.get_actor, name, SERVE_NAMESPACE)
            await asyncio.wait_for(handle.__ray_ready__.remote(), self.check_s)
            return True
        except (ValueError, ray.exceptions.ActorDiedError):
            return False
        except Exception:  # noqa: BLE001 - slow, unreachable for now, or any other doubt: not known dead
            return True
