"""Feed links: a decode replica's per-step token batches to a router replica over one TCP connection.

A decode replica sends each router replica one FeedBatch per step (cluster/protocol/feed.py,
decode_worker/feed.py). As a Ray Serve streaming call each item cost about 1.5-2 ms of CPU on the sending and
on the receiving side (a py-spy profile of the served benchmark at concurrency 1: Serve's replica machinery
and Ray core on both ends), paid every step on the same cores the step needs. Over a kept-open connection with
length-prefixed msgpack frames of each batch's wire form (cluster/framing.py) an item costs tens of
microseconds. It also ends the moment either side dies: the router learns that its decode replica is gone from
the connection's end, not from a Serve stream error, and the decode replica learns that a router closed its
end (it died, or its replica is stopping) at once.

The decode replica listens (FeedLinkServer, asyncio, on the node's address) and hands each subscribing
router a single-use token through a Serve call (`offer`); the router connects and presents it, then its
hello (FEED_LINK_VERSION), which the decode side answers with its own before the first batch
(read_feed_link). A router and a decode replica of different versions fail at that point, with a
ProtocolVersionError on the router's side, before any request's tokens cross. After its hello the router
sends nothing: the decode side reads a peer's close, nothing else.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import hmac
import logging
import secrets
import time
from typing import AsyncIterator, Callable

from cluster.errors import ProtocolError
from cluster.framing import TOKEN_BYTES, frame, no_delay, read_frame
from cluster.protocol import wire
from cluster.protocol.feed import FEED_LINK_VERSION, FeedBatch

LINK = "feed"

log = logging.getLogger(__name__)

OFFER_TTL_S = 60.0  # an offer not taken by then is dropped (its router died between asking and connecting)
TOKEN_WAIT_S = 10.0  # a connection that does not present its token and hello by then is closed


class FeedLinkError(ConnectionError):
    """The feed link could not be opened, or it closed (its decode replica died or was stopped)."""


@dataclasses.dataclass(frozen=True)
class FeedLinkAddress:
    host: str
    port: int
    token: bytes = dataclasses.field(repr=False)


class FeedLinkServer:
    """Decode side. `source(key)` gives the async iterable of batches a subscriber of `key` reads (the
    feed's `batches()`); `on_peer_closed(key)` is called when a subscriber closed its end while its source
    still ran and no other link of `key` is open (the router died, is stopping, or its reader failed: in
    each case nobody reads that key's feed any more)."""

    def __init__(self, host: str, source: Callable[[str], AsyncIterator[FeedBatch]],
                 on_peer_closed: Callable[[str], None], version: int = FEED_LINK_VERSION):
        self.host = host
        self._version = version  # another value only where a test plays a decode replica of another version
        self._source = source
        self._on_peer_closed = on_peer_closed
        self._server: asyncio.AbstractServer | None = None
        self._offers: list[tuple[bytes, str, float]] = []  # (token, key, expiry)
        self._links: set[asyncio.Task] = set()
        self._open_keys: collections.Counter[str] = collections.Counter()  # key -> its links past the token
        self.port = 0

    async def start(self) -> None:
        if self._server is None:
            self._server = await asyncio.start_server(self._on_connection, self.host, 0)
            self.port = self._server.sockets[0].getsockname()[1]

    def offer(self, key: str) -> FeedLinkAddress:
        """A single-use address for a subscriber of `key` (start() first)."""
        if self._server is None:
            raise RuntimeError("the feed link server is not started")
        now = time.monotonic()
        self._offers = [o for o in self._offers if o[2] > now]
        token = secrets.token_bytes(TOKEN_BYTES)
        self._offers.append((token, key, now + OFFER_TTL_S))
        return FeedLinkAddress(self.host, self.port, token)

    @property
    def open_links(self) -> int:
        return len(self._links)

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._links):
            task.cancel()

    def _take(self, token: bytes) -> str | None:
        for i, (known, key, expiry) in enumerate(self._offers):
            if hmac.compare_digest(known, token):
                del self._offers[i]
                return key if expiry > time.monotonic() else None
        return None

    async def _on_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._links.add(asyncio.current_task())
        try:
            try:
                token = await asyncio.wait_for(reader.readexactly(TOKEN_BYTES), TOKEN_WAIT_S)
            except (asyncio.IncompleteReadError, asyncio.TimeoutError, OSError):
                return
            key = self._take(token)
            if key is None:
                return  # a stray or stale client: closed unanswered
            no_delay(writer.get_extra_info("socket"))
            if not await self._hello(reader, writer, key):
                return
            pump = asyncio.ensure_future(self._pump(self._source(key), writer))
            peer_closed = asyncio.ensure_future(reader.read(1))  # the peer sends nothing more: b"" at its end
            self._open_keys[key] += 1
            try:
                done, _ = await asyncio.wait({pump, peer_closed}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in (pump, peer_closed):
                    task.cancel()
                self._open_keys[key] -= 1
                if self._open_keys[key] <= 0:
                    del self._open_keys[key]
            if pump not in done:
                # A newer link of the key (the router re-subscribed) is its reader now; its old one may still
                # be waiting out the feed's takeover check when the router closes it.
                if key not in self._open_keys:
                    self._on_peer_closed(key)
            elif not pump.cancelled() and pump.exception() is not None:
                log.warning("feed link for %s broke: %s", key or "(unnamed)", pump.exception())
        finally:
            self._links.discard(asyncio.current_task())
            writer.close()

    async def _hello(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, key: str) -> bool:
        """Reads the router's hello and answers with this side's (also to a router of another version, so
        that it can say why it is refused); False: the link is refused."""
        try:
            peer = await asyncio.wait_for(read_frame(reader, "the router's hello"), TOKEN_WAIT_S)
            writer.write(frame(wire.hello(LINK, self._version)))
            wire.check_hello(peer, LINK, self._version, f"router {key or '(unnamed)'}")
            return True
        except (asyncio.IncompleteReadError, asyncio.TimeoutError, OSError, ProtocolError) as e:
            log.error("feed link refused: %s", e)
            await writer.drain()
            return False

    async def _pump(self, batches: AsyncIterator[FeedBatch], writer: asyncio.StreamWriter) -> None:
        """Until the source ends (a newer subscription took over, or the feed was closed)."""
        async for batch in batches:
            writer.write(frame(batch.to_wire()))
            await writer.drain()  # a slow router holds the next batches in the feed, where they merge


async def read_feed_link(address: FeedLinkAddress, name: str, timeout_s: float = 10.0,
                         version: int = FEED_LINK_VERSION) -> AsyncIterator[FeedBatch]:
    """Router side: the batches the decode replica sends, until it closes the link; then FeedLinkError.
    ProtocolVersionError before the first batch if the decode replica speaks another version; ProtocolError
    if a batch is malformed."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(address.host, address.port), timeout_s)
    except (OSError, asyncio.TimeoutError) as e:
        raise FeedLinkError(f"cannot reach {name}'s feed at {address.host}:{address.port}: {e}") from e
    try:
        no_delay(writer.get_extra_info("socket"))
        writer.write(address.token + frame(wire.hello(LINK, version)))
        try:
            hello = await asyncio.wait_for(read_frame(reader, f"{name}'s hello"), timeout_s)
        except (asyncio.IncompleteReadError, asyncio.TimeoutError, OSError) as e:
            raise FeedLinkError(f"{name} closed its feed link unanswered (a stale token, or it is stopping): "
                                f"{type(e).__name__}") from None
        wire.check_hello(hello, LINK, version, name)
        while True:
            try:
                value = await read_frame(reader, f"{name}'s feed")
            except asyncio.IncompleteReadError:
                raise FeedLinkError(f"{name} closed its feed link (it died or was stopped)") from None
            except OSError as e:
                raise FeedLinkError(f"the feed link from {name} broke: {type(e).__name__}: {e}") from e
            yield FeedBatch.from_wire(value)
    finally:
        writer.close()
