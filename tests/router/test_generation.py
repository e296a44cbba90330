"""router/generation.py: how a request's failure reaches the client when two workers report it."""
from __future__ import annotations

import asyncio

import pytest
import ray

from cluster.protocol import StreamError
from router.errors import APIError
from router.generation import Generation


class _Feeds:
    """DecodeFeeds' two methods a failing request calls: which replica it was on, close its stream (cancel: abort
    it there)."""

    def __init__(self):
        self.closed: list[tuple[str, bool]] = []

    def close(self, request_id: str, cancel: bool) -> None:
        self.closed.append((request_id, cancel))

    def replica_of(self, request_id: str) -> str | None:
        return None


class _PrefillDied(ray.exceptions.RayActorError):
    def __str__(self) -> str:  # what Ray says of a killed Serve replica (the router reads the class name)
        return "The actor died unexpectedly. class_name: ServeReplica:tandem:prefill pid=4242"


async def _first_failure(prefill_dies_after_s: float | None) -> tuple[APIError, _Feeds]:
    """A hand-over failure already queued by the decode side while the prefill's call is open; the prefill's
    call then fails with its death after `prefill_dies_after_s` (None: it never ends)."""
    feeds = _Feeds()
    g = Generation(prefill=None, feeds=feeds, request_id="r1", prompt_token_ids=[1, 2], params={})
    g._queue = asyncio.Queue()
    g._queue.put_nowait(StreamError("hand-over failed on rank 1: channel c: answering failed: Connection closed"))
    handover = asyncio.get_running_loop().create_future()
    g._handover = handover
    if prefill_dies_after_s is not None:
        asyncio.get_running_loop().call_later(prefill_dies_after_s, handover.set_exception, _PrefillDied())
    item = await g._next_decode_item()
    if isinstance(item, StreamError):  # as events() does with it
        return APIError(item.status, item.message, item.error_type), feeds
    pytest.fail(f"expected a failure, got {item!r}")


def test_a_handover_failure_reported_before_the_prefills_death_names_the_death():
    """Regression (tests/prefill_worker/test_faults.py flaked): a prefill replica SIGKILLed mid-send broke
    the decode rank's channel, whose 'hand-over failed on rank 1: ...' reached the router a moment before
    Ray's report of the death, and the client got the channel's error instead of 'the prefill worker died'."""
    with pytest.raises(APIError) as e:
        asyncio.run(_first_failure(prefill_dies_after_s=0.2))
    assert e.value.status == 503 and "prefill worker died" in e.value.message


def test_a_handover_failure_with_the_prefill_alive_is_the_decode_sides():
    """The prefill's call stays open (it is alive, the channel broke for another reason): after the grace the
    client gets the decode side's own account."""
    err, feeds = asyncio.run(_first_failure(prefill_dies_after_s=None))
    assert err.status == 503 and err.message.startswith("hand-over failed on rank 1")


class _LocalFeeds(_Feeds):
    """A decode replica that takes every offered request to prefill itself, its feed items queued up front."""

    def __init__(self, items):
        super().__init__()
        self.items, self.offers = items, []

    async def open(self, request_id, num_tokens, known, salt, avoid, local=None):
        from cluster.protocol import DecodeOpened

        self.offers.append(local)
        queue = asyncio.Queue()
        for item in self.items:
            queue.put_nowait(item)
        return DecodeOpened("replica-a", target=None, local=local is not None, seed=local and 77), queue


def test_a_locally_prefilled_request_starts_at_its_first_token_not_at_a_chunk_of_its_prompt():
    """Conditional disaggregation: the decode group's first steps may run chunks of the prompt (deltas with no
    token); the first result is the first token, with the seed the decode replica chose; no prefill is called."""
    from cluster.protocol import PrefillRequest, TokenDelta

    items = [TokenDelta("r1", (), False, None), TokenDelta("r1", (), False, None), TokenDelta("r1", (9,), False, None),
             TokenDelta("r1", (4, 5), True, "length")]
    feeds = _LocalFeeds(items)
    g = Generation(prefill=None, feeds=feeds, request_id="r1", prompt_token_ids=[1, 2, 3],
                   params={"max_tokens": 3, "temperature": 0.5}, local_max_tokens=64)

    async def run():
        first = await g.start()
        return first, [e async for e in g.events()]

    first, events = asyncio.run(run())
    assert (first.token_ids, first.seed, g.local) == ([9], 77, True)
    assert [e.token_ids for e in events] == [(9,), (4, 5)] and events[-1].finish_reason == "length"
    wire, limit = feeds.offers[0]
    assert limit == 64 and PrefillRequest.from_wire(wire).prompt_token_ids == (1, 2, 3)
    assert feeds.closed == [("r1", False)]  # ended by the decode side: nothing to cancel


def test_guided_requests_and_prompt_logprobs_are_never_offered_to_the_decode_group():
    from router.generation import local_eligible

    assert local_eligible({"temperature": 0.0})
    assert not local_eligible({"structured_output": {"json": {"type": "object"}}})
    assert not local_eligible({"prompt_logprobs": 0})
