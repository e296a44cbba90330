"""A decode rank that dies mid-step: through a router with resumption (the default, router/generation.py) every
request in flight goes on after a pause with exactly the output an uninterrupted run gives (streamed and whole,
greedy, seeded sampling, logprobs); through a router with `resume_attempts=0` the same death ends its requests
with a typed error (never a hang). The decode replica rebuilds its group, and no KV block is left in use on the
prefill or the new group. (Deaths inside a hand-over: test_handover_faults.py; guided and speculative requests:
tests/router/test_resumption.py.)"""
from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest
import ray

from cluster.testing import wait_for
from deploy.metrics_probe import scrape
from deploy.testing import start_router, stop_router
from tests.support.resume import completion, first_difference, same_output

pytestmark = pytest.mark.ray

MAX_TOKENS = 230
RESUMED = [  # (prompt, stream, sampling) of the requests sent through the resuming router
    ("Hello, how are you?", True, {"temperature": 0}),
    ("The quick brown fox", True, {"temperature": 0.9, "seed": 5}),
    ("def add(a, b):", True, {"temperature": 0, "logprobs": 2}),
    ("lazy dog", False, {"temperature": 0}),
    ("Once upon a time", False, {"temperature": 0.8, "seed": 11, "logprobs": 1}),
]


def _resumptions(server) -> float:
    return sum(v for (name, labels), v in scrape(httpx.get(f"{server.base_url}/metrics").text).items()
               if name == "tandem_request_resumptions_total")


def test_killed_decode_rank_resumes_every_request_exactly_and_the_group_recovers(tandem_server):
    decode = tandem_server.decode_handle()
    before = decode.stats.remote().result()
    pids = decode.rank_pids.remote().result()
    assert len(pids) == tandem_server.config.tp == 2
    plain = start_router(tandem_server, "noresume", resume_attempts=0)
    resumed_before = _resumptions(tandem_server)

    def kw(sampling: dict) -> dict:
        return {"max_tokens": MAX_TOKENS, "extra_body": {"ignore_eos": True}, **sampling}

    async def main():
        async with tandem_server.async_openai(timeout=300) as client, plain.async_openai(timeout=300) as other:
            reference = await asyncio.gather(*[completion(client, tandem_server.model, p, s, **kw(k))
                                               for p, s, k in RESUMED])
            started = [asyncio.Event() for _ in RESUMED]
            tasks = [asyncio.create_task(completion(client, tandem_server.model, p, s, ev, **kw(k)))
                     for (p, s, k), ev in zip(RESUMED, started)]
            unresumed = [asyncio.Event() for _ in range(2)]
            ended = [asyncio.create_task(completion(other, plain.model, p, True, ev, **kw({"temperature": 0})))
                     for p, ev in zip(["Tell me a story", "Count to ten"], unresumed)]
            await asyncio.gather(*[ev.wait() for ev in started + unresumed])
            await asyncio.sleep(0.1)
            killed_at = time.monotonic()
            os.kill(pids[1], signal.SIGKILL)
            try:  # a bound on a hang only
                got = await asyncio.wait_for(asyncio.gather(*tasks, *ended), timeout=240)
            except asyncio.TimeoutError:
                raise AssertionError("requests in flight on a killed decode rank hang") from None
            return reference, got[:len(tasks)], got[len(tasks):], time.monotonic() - killed_at

    try:
        reference, got, ended, seconds = asyncio.run(main())
    finally:
        stop_router("noresume")
    assert all(r["outcome"] == "finished" for r in reference), reference
    for want, have, spec in zip(reference, got, RESUMED):
        assert same_output(have, want), (spec, first_difference(have, want))
    # The router without resumption ends its requests with the typed error, as it did before resumption.
    died = ("decode rank died", "hand-over to the decode group failed")
    for r in ended:
        assert r["outcome"] == "error" and any(d in r["error"] for d in died) and "\n" not in r["error"], r
    # Requests that finished before the kill needed no resumption; at least one was cut and resumed.
    assert _resumptions(tandem_server) > resumed_before, f"no request was resumed ({seconds:.1f}s after the kill)"

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
