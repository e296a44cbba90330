"""Feed: a router's requests' items leave a decode replica batched, one FeedBatch per step, and a request's
last item (finished delta or error) ends it."""
from __future__ import annotations

import asyncio

from cluster.protocol import StreamError, TokenDelta
from decode_worker.feed import Feed


def _delta(rid: str, tok: int, finished: bool = False) -> TokenDelta:
    return TokenDelta(rid, (tok,), finished, "length" if finished else None)


def test_one_steps_items_for_many_requests_leave_as_one_batch_and_last_items_end_requests():
    async def main():
        ended = []
        feed = Feed(ended.append)
        sinks = {rid: feed.sink(rid) for rid in ("a", "b", "c")}
        stream = feed.batches()
        for rid, sink in sinks.items():  # one step's deliveries
            sink.put_nowait(_delta(rid, 1))
        first = await asyncio.wait_for(stream.__anext__(), 1)
        sinks["a"].put_nowait(_delta("a", 2, finished=True))  # the next step's
        sinks["b"].put_nowait(StreamError("rank died"))
        second = await asyncio.wait_for(stream.__anext__(), 1)
        return first, second, ended, feed

    first, second, ended, feed = asyncio.run(main())
    assert [rid for rid, _ in first.items] == ["a", "b", "c"]
    assert [(rid, type(item).__name__) for rid, item in second.items] == [("a", "TokenDelta"), ("b", "StreamError")]
    assert ended == ["a", "b"] and feed.requests == {"c"} and not feed.idle


def test_items_wait_for_a_subscriber_and_a_newer_subscription_takes_over():
    async def main():
        feed = Feed(lambda rid: None)
        feed.sink("x").put_nowait(_delta("x", 7))  # before the router subscribed
        old = feed.batches()
        assert [rid for rid, _ in (await asyncio.wait_for(old.__anext__(), 1)).items] == ["x"]
        pending = asyncio.ensure_future(old.__anext__())
        new = feed.batches()
        first_of_new = asyncio.ensure_future(new.__anext__())
        await asyncio.sleep(0)
        feed.put("x", _delta("x", 8, finished=True))
        got = await asyncio.wait_for(first_of_new, 2)
        ended_old = None
        try:
            await asyncio.wait_for(pending, 3)  # the old subscription ends once it sees the takeover
        except StopAsyncIteration:
            ended_old = True
        return got, ended_old, feed

    got, ended_old, feed = asyncio.run(main())
    assert [item.token_ids for _, item in got.items] == [(8,)]
    assert ended_old and feed.idle
