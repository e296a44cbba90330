"""Feed links (cluster/feed_link.py): a decode replica's per-step batches to a router over a kept-open socket,
as typed records (cluster/protocol/feed.py), after both ends exchanged their protocol version."""
from __future__ import annotations

import asyncio
import socket

import pytest

from cluster.errors import ProtocolError, ProtocolVersionError
from cluster.feed_link import FeedLinkAddress, FeedLinkError, FeedLinkServer, read_feed_link
from cluster.framing import frame, read_frame
from cluster.protocol import FEED_LINK_VERSION, FeedBatch, StreamError, TokenDelta, wire
from engine.outputs import SpecUsage


def feed_batch(*items: tuple[str, int]) -> FeedBatch:
    """A batch of one-token deltas; a negative token stands for the error that ends its request."""
    return FeedBatch(tuple((rid, TokenDelta(rid, (tok,), False, None) if tok >= 0 else StreamError(f"lost {-tok}"))
                           for rid, tok in items))


class Source:
    """Stands in for the decode replica's feed subscriptions (decode_worker/feed.py): FeedBatches put on a
    queue, None ends one."""

    def __init__(self):
        self.queue: asyncio.Queue = asyncio.Queue()
        self.started: list[str] = []
        self.finished: list[str] = []  # subscriptions whose generator was closed (ended, or cancelled)
        self.peer_closed: list[str] = []

    async def batches(self, key: str):
        self.started.append(key)
        try:
            while (batch := await self.queue.get()) is not None:
                yield batch
        finally:
            self.finished.append(key)


async def _server(source: Source, version: int = FEED_LINK_VERSION) -> FeedLinkServer:
    server = FeedLinkServer("127.0.0.1", source.batches, source.peer_closed.append, version=version)
    await server.start()
    return server


async def _connect(address: FeedLinkAddress, token: bytes,
                   version: int = FEED_LINK_VERSION) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A raw client of the link that sends `token` (a router would send address.token) and its hello."""
    reader, writer = await asyncio.open_connection(address.host, address.port)
    writer.write(token + frame(wire.hello("feed", version)))
    return reader, writer


async def _until(condition, what: str, timeout_s: float = 5.0) -> None:
    for _ in range(int(timeout_s / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"not seen: {what}")


def test_batches_arrive_in_order_and_the_end_of_the_source_closes_the_link():
    async def main():
        source = Source()
        server = await _server(source)
        got = []

        async def read():
            async for batch in read_feed_link(server.offer("router-a"), "decode replica r1"):
                got.append(batch)

        reading = asyncio.ensure_future(read())
        sent = [feed_batch(("req-1", i), ("req-2", -i - 1)) for i in range(50)]
        for batch in sent:
            source.queue.put_nowait(batch)
        await _until(lambda: len(got) == len(sent), "every batch")
        source.queue.put_nowait(None)  # the feed ended here (taken over, or its router known dead)
        with pytest.raises(FeedLinkError, match="decode replica r1 closed its feed link"):
            await asyncio.wait_for(reading, 5)
        await _until(lambda: server.open_links == 0, "the link gone on the server")
        server.close()
        return source, got, sent

    source, got, sent = asyncio.run(main())
    assert got == sent and source.started == ["router-a"] and source.finished == ["router-a"]
    assert source.peer_closed == []  # the server ended it, not the peer


def test_a_peer_that_closes_its_end_is_reported_and_its_subscription_closed():
    async def main():
        source = Source()
        server = await _server(source)
        address = server.offer("router-b")
        _, writer = await _connect(address, address.token)
        source.queue.put_nowait(feed_batch(("r", 1)))
        await _until(lambda: source.started == ["router-b"], "the subscription")
        assert server.open_links == 1
        writer.close()  # the router died: its socket closes with no batch pending
        await _until(lambda: source.peer_closed == ["router-b"], "the peer's close reported")
        await _until(lambda: source.finished == ["router-b"], "the subscription closed")
        await _until(lambda: server.open_links == 0, "the link gone")
        server.close()

    asyncio.run(main())


def test_an_older_link_closing_while_a_newer_one_of_its_key_is_open_is_not_reported():
    """A router that re-subscribed reads the newer link: the older one's close says nothing of its requests
    (the decode replica ends a key's requests when its last link closes)."""
    async def main():
        errors = []  # what the link handlers raised (asyncio reports it to the loop's handler)
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: errors.append(context))
        source = Source()
        server = await _server(source)
        old_address, new_address = server.offer("router-c"), server.offer("router-c")
        _, old = await _connect(old_address, old_address.token)
        await _until(lambda: source.started == ["router-c"], "the first subscription")
        _, new = await _connect(new_address, new_address.token)
        await _until(lambda: source.started == ["router-c"] * 2, "the second subscription")
        old.close()
        await _until(lambda: server.open_links == 1, "the older link gone")
        assert source.peer_closed == []
        new.close()
        await _until(lambda: source.peer_closed == ["router-c"], "the last link's close reported")
        await _until(lambda: server.open_links == 0, "both links gone")
        server.close()
        assert not errors, errors

    asyncio.run(main())


def test_tokens_are_single_use_and_a_wrong_token_is_closed_unanswered():
    async def main():
        source = Source()
        server = await _server(source)
        address = server.offer("router-c")
        # A stray client with a wrong token: closed without a byte, and the offer still stands.
        reader, writer = await _connect(address, b"x" * len(address.token))
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()
        source.queue.put_nowait(feed_batch(("r", 7)))
        first = read_feed_link(address, "decode replica")
        assert await asyncio.wait_for(first.__anext__(), 5) == feed_batch(("r", 7))
        # The same token again: it was taken, so this connection is closed unanswered.
        with pytest.raises(FeedLinkError, match="closed its feed link"):
            await asyncio.wait_for(read_feed_link(address, "decode replica").__anext__(), 5)
        await first.aclose()
        server.close()
        return source

    source = asyncio.run(main())
    assert source.started == ["router-c"]


def test_an_address_nobody_listens_on_fails_with_the_reason():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: connections are refused

        async def main():
            await read_feed_link(FeedLinkAddress("127.0.0.1", port, b"t" * 32), "decode replica r9", 2.0).__anext__()

        with pytest.raises(FeedLinkError, match="cannot reach decode replica r9's feed at 127.0.0.1"):
            asyncio.run(main())


def test_a_decode_replica_of_another_version_is_refused_when_the_link_opens():
    """A router reading a decode replica of another Tandem version: a ProtocolVersionError naming both
    versions before any batch, and the decode side serves no subscription."""
    async def main():
        source = Source()
        server = await _server(source, version=FEED_LINK_VERSION + 1)
        source.queue.put_nowait(feed_batch(("r", 1)))
        expected = f"decode replica r2 speaks feed link protocol version {FEED_LINK_VERSION + 1}, this side speaks"
        with pytest.raises(ProtocolVersionError, match=f"{expected} {FEED_LINK_VERSION}"):
            await asyncio.wait_for(read_feed_link(server.offer("router-d"), "decode replica r2").__anext__(), 5)
        await _until(lambda: server.open_links == 0, "the refused link gone")
        server.close()
        return source

    source = asyncio.run(main())
    assert source.started == [] and source.peer_closed == []


def test_a_router_of_another_version_gets_the_hello_and_then_a_closed_link():
    async def main():
        source = Source()
        server = await _server(source)
        address = server.offer("router-e")
        reader, writer = await _connect(address, address.token, version=FEED_LINK_VERSION + 3)
        assert await asyncio.wait_for(read_frame(reader, "hello"), 5) == wire.hello("feed", FEED_LINK_VERSION)
        assert await asyncio.wait_for(reader.read(), 5) == b""  # closed: no batch follows
        writer.close()
        server.close()
        return source

    source = asyncio.run(main())
    assert source.started == []


def test_a_malformed_batch_is_a_protocol_error_naming_the_field():
    async def fake_decode(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readexactly(32)
        await read_frame(reader, "hello")
        writer.write(frame(wire.hello("feed", FEED_LINK_VERSION)))
        writer.write(frame((("r", "delta", ("r", (1,), "no", None, (), None)),)))
        await writer.drain()

    async def main():
        server = await asyncio.start_server(fake_decode, "127.0.0.1", 0)
        address = FeedLinkAddress("127.0.0.1", server.sockets[0].getsockname()[1], b"t" * 32)
        with pytest.raises(ProtocolError, match="TokenDelta field 'finished' must be a bool"):
            await asyncio.wait_for(read_feed_link(address, "decode replica").__anext__(), 5)
        server.close()

    asyncio.run(main())


@pytest.mark.parametrize("raw, message", [
    ((("r", "token", ()),), "FeedBatch item field 'kind' must be one of"),
    ((("r", "error", ("gone", "unavailable_error", 200)),), "StreamError field 'status' must be an HTTP error"),
    ((("r", "error", ("gone", "unavailable_error")),), "StreamError must have 3 fields"),
    (((7, "delta", ("r", (1,), False, None, (), None)),), "FeedBatch item field 'request_id' must be a str"),
    ({"r": 1}, "FeedBatch field 'items' must be an array"),
])
def test_batch_records_are_read_strictly(raw, message):
    with pytest.raises(ProtocolError, match=message):
        FeedBatch.from_wire(raw)


def test_a_batch_round_trips_through_msgpack():
    sent = FeedBatch((("a", TokenDelta("a", (1, 2), True, "stop", ((1, -0.1, None), (2, -0.2, {2: -0.2})),
                                       SpecUsage("ngram", 9, 4, 2, 6))),
                      ("b", StreamError("the decode group is restarting", "unavailable_error", 503))))
    assert FeedBatch.from_wire(wire.unpack(wire.pack(sent.to_wire()), "batch")) == sent


def test_offer_needs_a_started_server():
    server = FeedLinkServer("127.0.0.1", Source().batches, lambda key: None)
    with pytest.raises(RuntimeError, match="not started"):
        server.offer("k")


def test_a_closed_feed_link_reaches_the_client_as_a_retryable_503():
    from router.generation import api_error

    error = api_error(FeedLinkError("decode replica r1 closed its feed link (it died or was stopped)"))
    assert (error.status, error.error_type) == (503, "unavailable_error")
    assert "retry" in error.message and "\n" not in error.message
