"""The feed link's records: what a decode replica sends a router replica, one FeedBatch per step that had
anything for the router's requests (decode_worker/feed.py), each item a TokenDelta or the StreamError that
ends a request.

Over the feed link (cluster/feed_link.py) a batch travels as its `to_wire()` value in a msgpack frame,
after both ends exchanged FEED_LINK_VERSION when the link opened; as a Serve stream (a router with its feed
link off) it travels as the record itself. An item's wire form is `(request id, kind, record)`, kind
"delta" or "error", so a batch is read without guessing at shapes.
"""
from __future__ import annotations

from dataclasses import dataclass

from cluster.protocol import wire
from cluster.protocol.step import TokenDelta

FEED_LINK_VERSION = 2  # bump on any change to the wire forms below or to TokenDelta's (exchanged when a link opens;
# 2: TokenDelta.speculative)


@dataclass(frozen=True, slots=True)
class StreamError:
    """Ends a request's stream with an error (a typed value: the router maps it to a response)."""
    message: str
    error_type: str = "unavailable_error"
    status: int = 503

    WIRE = ("message", "error_type", "status")

    def to_wire(self) -> tuple:
        return (self.message, self.error_type, self.status)

    @staticmethod
    def from_wire(raw) -> "StreamError":
        message, error_type, status = wire.record(raw, "StreamError", StreamError.WIRE)
        status = wire.integer(status, "StreamError", "status")
        wire.check(400 <= status <= 599, "StreamError", "status", "an HTTP error status", status)
        return StreamError(wire.text(message, "StreamError", "message"),
                           wire.text(error_type, "StreamError", "error_type"), status)


FeedItem = TokenDelta | StreamError
_READERS = {"delta": TokenDelta.from_wire, "error": StreamError.from_wire}


@dataclass(frozen=True, slots=True)
class FeedBatch:
    """One step's items for one router replica's requests, in the order they happened."""
    items: tuple[tuple[str, FeedItem], ...]  # (request id, its delta or the error that ends it)

    def to_wire(self) -> tuple:
        return tuple((rid, "delta" if type(item) is TokenDelta else "error", item.to_wire())
                     for rid, item in self.items)

    @staticmethod
    def from_wire(raw) -> "FeedBatch":
        items = []
        for entry in wire.array(raw, "FeedBatch", "items"):
            rid, kind, item = wire.record(entry, "FeedBatch item", ("request_id", "kind", "item"))
            wire.check(kind in _READERS, "FeedBatch item", "kind", f"one of {sorted(_READERS)}", kind)
            items.append((wire.text(rid, "FeedBatch item", "request_id"), _READERS[kind](item)))
        return FeedBatch(tuple(items))
