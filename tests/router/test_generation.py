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
