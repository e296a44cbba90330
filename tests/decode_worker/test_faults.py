"""A decode rank that dies mid-step ends its group's in-flight requests with an error (never a hang), and the
decode replica rebuilds its group so that later requests are served again, with no KV block left in use
on the prefill or the new group. (Deaths inside a hand-over: test_handover_faults.py.)"""
from __future__ import annotations

import asyncio
import os
import signal
import time

import openai
import pytest
import ray

from cluster.testing import wait_for

pytestmark = pytest.mark.ray


def test_killed_decode_rank_gives_errors_not_hangs_and_the_group_recovers(tandem_server):
    decode = tandem_server.decode_handle()
    before = decode.stats.remote().result()
    pids = decode.rank_pids.remote().result()
    assert len(pids) == tandem_server.config.tp == 2

    async def stream_until_error(client, prompt, started: asyncio.Event):
        stream = await client.completions.create(model=tandem_server.model, prompt=prompt, max_tokens=230,
                                                 temperature=0, stream=True, extra_body={"ignore_eos": True})
        chunks = 0
        try:
            async for _ in stream:
                chunks += 1
                if chunks == 3:
                    started.set()
        except openai.APIError as e:
            return "error", chunks, str(e)
        return "finished", chunks, ""

    async def non_streaming(client, started: asyncio.Event):
        await started.wait()
        try:
            await client.completions.create(model=tandem_server.model, prompt="lazy dog", max_tokens=230,
                                            temperature=0, extra_body={"ignore_eos": True})
        except openai.APIStatusError as e:
            return "error", e.status_code, e.body
        return "finished", 200, None

    async def main():
        async with tandem_server.async_openai(timeout=60) as client:
            started = [asyncio.Event() for _ in range(3)]
            tasks = [asyncio.create_task(stream_until_error(client, p, ev))
                     for p, ev in zip(["Hello, how are you?", "The quick brown fox", "def add(a, b):"], started)]
            await asyncio.gather(*[ev.wait() for ev in started])
            blocking = asyncio.create_task(non_streaming(client, started[0]))
            await asyncio.sleep(0.1)
            os.kill(pids[1], signal.SIGKILL)
            try:  # a bound on a hang only: every request must end with an error, none may wait forever
                return await asyncio.wait_for(asyncio.gather(*tasks, blocking), timeout=180)
            except asyncio.TimeoutError:
                raise AssertionError("requests in flight on a killed decode rank hang instead of failing") from None

    results = asyncio.run(main())
    streams, plain = results[:3], results[3]
    # The router hears it from whichever side fails first: the decode replica (its rank died) or, for a
    # request whose KV was still being sent, the prefill (its send broke).
    died = ("decode rank died", "hand-over to the decode group failed")
    for outcome, chunks, message in streams:
        assert outcome == "error" and any(d in message for d in died), (outcome, chunks, message)
    assert plain[0] == "error" and plain[1] == 503 and any(d in plain[2]["message"] for d in died), plain
    assert "\n" not in plain[2]["message"]  # one line for the client; Ray's account of the death is logged

    # The replica builds a new group; requests succeed again.
    client = tandem_server.openai(timeout=60)

    def served():
        try:
            return client.completions.create(model=tandem_server.model, prompt="Hello", max_tokens=5, temperature=0)
        except openai.APIStatusError:
            return None

    out = wait_for(served, "the decode group recovers and serves again", timeout_s=300, poll_s=1.0)
    assert out.usage.completion_tokens == 5
    after = decode.stats.remote().result()
    assert after["groups_started"] == before["groups_started"] + 1 and after["group_id"] != before["group_id"]
    assert set(decode.rank_pids.remote().result()).isdisjoint(pids)
    wait_for(lambda: not any(tandem_server.kv_blocks_in_use().values()), "KV blocks in use back to 0", 120, 0.5)


@pytest.mark.parametrize("link", [True, False], ids=["feed-link", "serve-stream"])
def test_a_dead_routers_feed_ends_even_with_no_request_open(tandem_server, link):
    """A router that dies with no request open leaves its feed stream on the decode replica, which Ray never
    ends: it counted as an ongoing request there for good (in the replica's load, and in every graceful
    shutdown, which waited out its timeout and force-killed the replica). The replica's caller watch ends it.
    Over a feed link the replica sees the connection close and asks Ray about the router at once."""
    decode = tandem_server.decode_handle()
    before = decode.stats.remote().result()
    name = f"feed-reader-{os.getpid()}-{link}"  # a named actor in Serve's namespace, as a router replica is
    reader = FeedReader.options(name=name, namespace="serve").remote(tandem_server.app)
    reading = reader.read.remote(name, link)
    wait_for(lambda: decode.stats.remote().result()["feed_subscriptions"] == before["feed_subscriptions"] + 1,
             "the reader's feed subscription open", 60)
    assert decode.stats.remote().result()["feed_links"] == before["feed_links"] + link
    ray.kill(reader, no_restart=True)
    stats = wait_for(lambda: (s := decode.stats.remote().result())["feed_subscriptions"]
                     == before["feed_subscriptions"] and s, "the dead reader's feed ended", 60)
    assert stats["feed_links"] == before["feed_links"]
    stats = wait_for(lambda: (s := decode.stats.remote().result())["routers_lost"] == before["routers_lost"] + 1
                     and s, "the dead reader counted lost", 60)
    assert stats["requests_ended_link_closed"] == before["requests_ended_link_closed"]
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(reading, timeout=30)


def test_a_dead_routers_open_request_ends_when_its_feed_link_closes(tandem_server):
    """A router that dies with a request open (its hand-over still to come) closes its feed link: the decode
    replica ends the request (as the link closes, or as Ray reports the death, whichever it learns first) and
    counts the router lost once."""
    decode = tandem_server.decode_handle()
    before = decode.stats.remote().result()
    name = f"feed-reader-open-{os.getpid()}"
    reader = FeedReader.options(name=name, namespace="serve").remote(tandem_server.app)
    ray.get(reader.open.remote(f"orphan-{os.getpid()}", name), timeout=60)
    reader.read.remote(name, True)
    wait_for(lambda: decode.stats.remote().result()["feed_links"] == before["feed_links"] + 1, "the link open", 60)
    assert decode.stats.remote().result()["num_requests"] == before["num_requests"] + 1
    ray.kill(reader, no_restart=True)
    stats = wait_for(lambda: (s := decode.stats.remote().result())["num_requests"] == before["num_requests"]
                     and s["feed_links"] == before["feed_links"] and s, "the orphan request ended", 60)
    wait_for(lambda: decode.stats.remote().result()["routers_lost"] == before["routers_lost"] + 1,
             "the dead reader counted lost", 60)
    time.sleep(1.5)  # another check of the watch: counted once
    assert decode.stats.remote().result()["routers_lost"] == before["routers_lost"] + 1


def test_a_live_routers_requests_end_when_its_feed_link_closes_and_it_learns_why_on_the_next(tandem_server):
    """A router whose feed reader failed (it answered its requests there with a 503) closes its link alive:
    nobody reads those requests' tokens, so the decode replica ends them at once (Ray's watch cannot: the router
    is alive), queueing an error for each that a new link of the router receives."""
    decode = tandem_server.decode_handle()
    before = decode.stats.remote().result()
    name = f"feed-reader-alive-{os.getpid()}"
    orphan = f"orphan-alive-{os.getpid()}"
    reader = FeedReader.options(name=name, namespace="serve").remote(tandem_server.app)
    try:
        ray.get(reader.open.remote(orphan, name), timeout=60)
        reading = reader.read_for.remote(name, 3.0)  # then the link closes; the actor lives on
        wait_for(lambda: decode.stats.remote().result()["feed_links"] == before["feed_links"] + 1, "the link open", 60)
        ray.get(reading, timeout=60)
        stats = wait_for(lambda: (s := decode.stats.remote().result())["num_requests"] == before["num_requests"]
                         and s, "the request ended", 30)
        assert stats["requests_ended_link_closed"] == before["requests_ended_link_closed"] + 1
        batch = ray.get(reader.first_batch.remote(name), timeout=60)
        assert [(rid, type(item).__name__) for rid, item in batch.items] == [(orphan, "StreamError")], batch
        assert "feed link closed" in batch.items[0][1].message
        assert decode.stats.remote().result()["routers_lost"] == before["routers_lost"]
    finally:
        ray.kill(reader, no_restart=True)


@ray.remote(num_cpus=0)
class FeedReader:
    """Reads a decode replica's feed the way router/decode_feed.py does, and nothing else."""

    def __init__(self, app: str):
        from ray import serve
        self.decode = serve.get_deployment_handle("decode", app)

    async def open(self, request_id: str, name: str) -> None:
        await self.decode.open.remote(request_id, 8, name)

    async def read_for(self, name: str, seconds: float) -> None:
        """Reads over a feed link for `seconds`, then closes it (as a router whose reader failed)."""
        try:
            await asyncio.wait_for(self.read(name, True), seconds)
        except asyncio.TimeoutError:
            pass

    async def first_batch(self, name: str):
        from cluster.feed_link import read_feed_link

        async for batch in read_feed_link(await self.decode.feed_link.remote(name), "decode"):
            return batch

    async def read(self, name: str, link: bool) -> None:
        if link:
            from cluster.feed_link import read_feed_link

            async for _ in read_feed_link(await self.decode.feed_link.remote(name), "decode"):
                pass
            return
        async for _ in self.decode.options(stream=True).feed.remote(name):
            pass
