"""One HTTP response over its choices: `n` samples of each prompt (and, on /v1/completions, several prompts).

Each choice is its own engine request (router/generation.py) written by its own ResponseWriter
(router/output.py): the children of one prompt carry the same prompt, so the prefill replica's prefix
cache computes its full blocks once and shares them (vLLM V1 fans `n` out the same way, over its prefix
cache); a child's partial last block is its own, which is the copy-on-write the shared blocks need. Each
child samples with its own seed stream: with a `seed`, child j of a prompt uses seed + j, so the same
request gives the same n outputs, and child 0 equals the same request with n = 1.

This module merges the children: a whole response lists every choice in index order; a stream interleaves
their chunks as they come (OpenAI's own streams do too: clients sort by `choices[].index`). Usage counts
each prompt once and every choice's completion. The first child to fail ends the response with its error
and cancels the others (their blocks are freed on both sides).
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from typing import AsyncIterator

from router import responses as R
from router.errors import APIError
from router.output import ResponseWriter
from router.sink import ResponseSink

SEED_MODULUS = 2**63  # SamplingParams' seed range


def child_seed(seed: int | None, sample: int) -> int | None:
    """The seed of a prompt's `sample`-th child (vLLM's rule: seed + index)."""
    return None if seed is None else (seed + sample) % SEED_MODULUS


class Choices:
    """The response of one request over its choices' writers (one writer when n = 1 and one prompt)."""

    def __init__(self, sink: ResponseSink, writers: list[ResponseWriter], prompt_tokens: int, rid: str, chat: bool,
                 arrival: float, endpoint: str, stream_options=None):
        self.sink, self.writers, self.rid, self.chat = sink, writers, rid, chat
        self.model = writers[0].model
        self.created = writers[0].created
        self.prompt_tokens = prompt_tokens  # each prompt once, however many samples it has
        self.arrival, self.endpoint = arrival, endpoint
        self._usage_at_end = stream_options is not None and stream_options.include_usage
        # vLLM's continuous_usage_stats: with include_usage, every chunk also carries the usage so far
        self._usage_always = self._usage_at_end and stream_options.continuous_usage_stats
        self._closed = False

    def usage(self) -> R.Usage:
        spec = [w.usage.speculative for w in self.writers if w.usage.speculative is not None]
        return R.Usage(self.prompt_tokens, sum(w.usage.completion_tokens for w in self.writers),
                       sum(spec[1:], spec[0]) if spec else None)

    async def collect(self) -> dict:
        status = 500
        try:
            choices = await self._all(w.collect() for w in self.writers)
            status = 200
        except APIError as e:
            status = e.status
            raise
        except asyncio.CancelledError:
            status = 499
            raise
        finally:
            self._cancel()
            self._done(status)
        return R.whole_body(self.rid, self.model, self.created, self.chat, choices, self.usage())

    async def _all(self, works) -> list[dict]:
        tasks = [asyncio.ensure_future(w) for w in works]
        try:
            return await asyncio.gather(*tasks)
        finally:  # one failed (or the client left): the others stop too
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def sse(self) -> AsyncIterator[str]:
        status = 499  # until the stream completes: a client that goes away cancels this generator
        try:
            try:
                async for chunk in _merge([w.chunks() for w in self.writers]):
                    if self._usage_always:
                        chunk["usage"] = self.usage().body()
                    yield R.sse(chunk)
            except APIError as e:
                status = e.status
                yield e.sse()
                yield R.SSE_DONE
                return
            if self._usage_at_end:
                yield R.sse(R.usage_chunk(self.rid, self.model, self.created, self.chat, self.usage()))
            yield R.SSE_DONE
            status = 200
        finally:
            self._cancel()
            self._done(status)

    def _cancel(self) -> None:
        for w in self.writers:
            w.gen.cancel()

    def __del__(self):
        # A stream whose client left before its first byte is never iterated: its `finally` never runs.
        if not self._closed:
            self._cancel()
            self._done(499)

    def _done(self, status: int) -> None:
        if self._closed:
            return
        self._closed = True
        self.sink.request_end(self.endpoint, status, time.monotonic() - self.arrival)


async def start_all(gens: list) -> None:
    """Start every choice's generation together (their prompts meet in the prefill replica's batch and
    prefix cache); if one fails, the others are cancelled and its error raised."""
    if len(gens) == 1:
        await gens[0].start()
        return
    tasks = [asyncio.ensure_future(_as_own_call(g.start())) for g in gens]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for g in gens:
            g.cancel()
        raise


async def _as_own_call(work):
    """Run `work` (in its own task) with a Serve request context of its own. Serve copies the calling HTTP
    request's internal id into every handle call made in its context, and its request routers index the
    calls waiting for a replica by that id, the first of several equal ones only: the children of one
    response would share it, and all but one could wait for a replica forever. The HTTP request id stays
    (the logs still name the request)."""
    from ray.serve import context

    ctx = context._serve_request_context.get()
    if ctx is not None:
        context._serve_request_context.set(dataclasses.replace(ctx, _internal_request_id=uuid.uuid4().hex))
    return await work


async def _merge(streams: list) -> AsyncIterator[dict]:
    """The streams' items as each comes; the first error ends the merge, closing the others."""
    if len(streams) == 1:  # the common case, without tasks in between
        async for item in streams[0]:
            yield item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(stream):
        try:
            async for item in stream:
                await queue.put(item)
            await queue.put(done)
        except BaseException as e:  # noqa: BLE001 - handed to the reader, which raises it
            await queue.put(e)
        finally:
            await stream.aclose()

    tasks = [asyncio.ensure_future(pump(s)) for s in streams]
    try:
        left = len(tasks)
        while left:
            item = await queue.get()
            if item is done:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
