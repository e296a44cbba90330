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
