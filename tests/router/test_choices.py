"""router/choices.py alone: the children's seeds and the merge of their streams (first error wins, the
others are closed and run their clean-up)."""
from __future__ import annotations

import asyncio

import pytest

from router.choices import SEED_MODULUS, _merge, child_seed
from router.errors import APIError


def test_child_seeds_follow_vllms_rule_and_stay_in_range():
    assert [child_seed(7, i) for i in range(3)] == [7, 8, 9]
    assert child_seed(None, 2) is None
    assert child_seed(SEED_MODULUS - 1, 1) == 0


def test_merge_interleaves_and_ends_when_every_stream_has():
    async def stream(name, n, delay):
        for i in range(n):
            await asyncio.sleep(delay)
            yield (name, i)

    async def run():
        return [x async for x in _merge([stream("a", 3, 0.01), stream("b", 2, 0.015)])]

    got = asyncio.run(run())
    assert sorted(got) == [("a", 0), ("a", 1), ("a", 2), ("b", 0), ("b", 1)]
    assert [x for x in got if x[0] == "a"] == [("a", 0), ("a", 1), ("a", 2)]  # each stream's order kept


def test_the_first_error_ends_the_merge_and_closes_the_others():
    closed = []

    async def endless(name):
        try:
            while True:
                await asyncio.sleep(0.01)
                yield name
        finally:
            closed.append(name)

    async def failing():
        yield "f"
        await asyncio.sleep(0.03)
        raise APIError(500, "the decode worker went away", "unavailable_error")

    async def run():
        seen = []
        with pytest.raises(APIError, match="went away"):
            async for x in _merge([endless("a"), failing(), endless("b")]):
                seen.append(x)
        return seen

    seen = asyncio.run(run())
    assert "f" in seen and "a" in seen
    assert sorted(closed) == ["a", "b"]


def test_each_choice_calls_the_workers_with_a_serve_identity_of_its_own():
    """Serve indexes calls waiting for a replica by the internal id of the request context they were made in,
    first of equal ids only, and prefill routing hands a replica to the call with that id: the children of one
    response, started in one HTTP request's context, would share it and all but one could wait forever (seen
    under load). start_all gives each child's calls an id of its own and keeps the HTTP request id."""
    from ray.serve import context

    from router.choices import start_all

    class Child:
        seen = None

        async def start(self):
            await asyncio.sleep(0)
            ctx = context._serve_request_context.get()
            self.seen = (ctx.request_id, ctx._internal_request_id)

        def cancel(self):
            pass

    async def run():
        context._serve_request_context.set(context._RequestContext(request_id="http-1", _internal_request_id="same"))
        children = [Child() for _ in range(3)]
        await start_all(children)
        return [c.seen for c in children], context._serve_request_context.get()._internal_request_id

    seen, outer = asyncio.run(run())
    assert [request_id for request_id, _ in seen] == ["http-1"] * 3
    internal = [i for _, i in seen]
    assert len(set(internal)) == 3 and "same" not in internal
    assert outer == "same"  # the HTTP request's own context is untouched
