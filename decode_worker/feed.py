"""Feed: everything a decode replica has for one router replica's requests, one batch per step.

A streaming Ray call costs about 0.8 ms of CPU per item, sender and receiver together (measured on this
project's 2-core CPU box: bench/results/served_vs_engine_cpu.md). One stream per request would pay that for
every request at every step: 64 requests at 100 steps/s on a GPU would be about 5 cores of Ray overhead on
the decode replica and the router. A feed pays it once per step per router replica: the controller's
per-request sinks (FeedSink) append (request id, item) pairs to the router's feed while it turns a step's
reports into stream events, and the feed's one open stream yields them all as one FeedBatch
(cluster/protocol/feed.py: the record the feed link carries).

Items are TokenDelta or StreamError. A request's last item (finished delta or error) ends it in the feed.
Items wait here while the router has no feed stream open (between its opening a request and subscribing,
or while it re-subscribes); they are dropped with the feed once its router is known dead.
"""
from __future__ import annotations

import asyncio
from typing import Callable

from cluster.protocol import FeedBatch, StreamError


class Feed:
    def __init__(self, on_end: Callable[[str], None]):
        """on_end(request_id): the request's last item was queued (it is no longer open here)."""
        self.on_end = on_end
        self.requests: set[str] = set()  # open requests whose items go to this feed
        self._items: list[tuple[str, object]] = []
        self._ready = asyncio.Event()
        self._reader = 0  # the current subscription's number: a newer one takes over from an older

    def sink(self, request_id: str) -> "FeedSink":
        self.requests.add(request_id)
        return FeedSink(self, request_id)

    def put(self, request_id: str, item) -> None:
        self._items.append((request_id, item))
        self._ready.set()
        if isinstance(item, StreamError) or getattr(item, "finished", False):
            self.requests.discard(request_id)
            self.on_end(request_id)

    def forget(self, request_id: str) -> None:
        """The router cancelled it: nothing more is sent (items already queued still go, harmlessly)."""
        self.requests.discard(request_id)

    async def batches(self):
        """The feed's stream: a FeedBatch of (request id, item) pairs as soon as a step produced any. A newer
        subscription (the router re-subscribed) ends this one."""
        self._reader += 1
        me = self._reader
        while self._reader == me:
            if not self._items:
                self._ready.clear()
                try:
                    await asyncio.wait_for(self._ready.wait(), 1.0)  # wake now and then to see a takeover
                except asyncio.TimeoutError:
                    pass
                continue  # the loop's test first: a takeover while waiting ends this subscription
            items, self._items = self._items, []
            yield FeedBatch(tuple(items))

    def close(self) -> None:
        """Its router is dead: end the stream still open for it (Ray keeps a dead caller's stream running)."""
        self._reader += 1
        self._items.clear()
        self._ready.set()  # a subscription waiting for items sees it now, not at its next wake-up

    @property
    def idle(self) -> bool:
        return not self.requests and not self._items


class FeedSink:
    """The controller's per-request sink (it calls put_nowait, as on an asyncio.Queue)."""
    __slots__ = ("feed", "request_id")

    def __init__(self, feed: Feed, request_id: str):
        self.feed, self.request_id = feed, request_id

    def put_nowait(self, item) -> None:
        self.feed.put(self.request_id, item)
