"""DecodeFeeds: this router replica's end of the decode replicas' feeds (decode_worker/feed.py).

One feed per decode replica carries the token deltas of all this router's requests there, one FeedBatch
per decode step, over a feed link (cluster/feed_link.py: a TCP connection) or, with `link` off, a Serve stream; a
reader task per feed hands each item to its request's queue. A request is opened with a unary call (Serve
picks the decode replica by load); its cancel and the feed go to that replica by name
(router/request_router.py honours a `replica` keyword). If a feed fails (its decode replica died), every
request read from it gets the error; the next request there opens a new feed.
"""
from __future__ import annotations

import asyncio
import contextvars
import logging

from cluster.feed_link import read_feed_link
from cluster.protocol import DecodeOpened, StreamError
from router.errors import APIError

log = logging.getLogger(__name__)


class FeedBroken:
    """Queued for the requests of a feed that failed: the decode replica's error, raised by the reader."""
    __slots__ = ("error",)

    def __init__(self, error: BaseException):
        self.error = error


class DecodeFeeds:
    def __init__(self, decode, caller: str | None, link: bool = True):
        """decode: the decode deployment's handle; caller: this router's Serve actor name (None in tests
        that drive the class outside Serve); link: feeds over feed links, else as Serve streams."""
        self.decode = decode
        self.caller = caller
        self.link = link
        self._queues: dict[str, asyncio.Queue] = {}  # open request id -> its items
        self._replica_of: dict[str, str] = {}
        self._readers: dict[str, asyncio.Task] = {}  # decode replica id -> the task reading its feed
        self._cancels: set = set()  # cancel calls in flight (kept referenced until they complete)

    async def open(self, request_id: str, num_prompt_tokens: int, prompt_token_ids: list[int] | None = None,
                   cache_salt: str | None = None, avoid: str | None = None,
                   local: tuple | None = None) -> tuple[DecodeOpened, asyncio.Queue]:
        """Raises APIError for a refusal of the decode side (its group is being rebuilt), or what the call
        raised. prompt_token_ids (and cache_salt): the decode ranks pin what they hold of the prompt and the
        target says how many leading blocks the prefill may skip (DecodeTarget.reused_blocks). avoid: a decode
        replica to rank last (a resumed request's, whose worker died there). local: (PrefillRequest wire form,
        most uncached tokens) offers the request to the group to prefill itself (DecodeOpened.local)."""
        # The queue exists before the call: a request the group prefills itself can have its first token on the
        # feed before the open's answer is back here, and the reader drops items of requests it does not know.
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        try:
            opened: DecodeOpened | StreamError = await self.decode.open.remote(
                request_id, num_prompt_tokens, self.caller, prompt_token_ids, cache_salt, avoid=avoid, local=local)
        except asyncio.CancelledError:
            # The client left while the decode side was opening it: it may be open there already, and which
            # replica holds it is not known; a cancel goes to whichever Serve picks (with one decode replica,
            # the right one; else the request's hand-over deadline ends it there).
            self._queues.pop(request_id, None)
            task = _detached(self._cancel(request_id, None))
            self._cancels.add(task)
            task.add_done_callback(self._cancels.discard)
            raise
        except BaseException:
            self._queues.pop(request_id, None)
            raise
        if isinstance(opened, StreamError):
            self._queues.pop(request_id, None)
            raise APIError(opened.status, opened.message, opened.error_type)
        self._replica_of[request_id] = opened.replica
        reader = self._readers.get(opened.replica)
        if reader is None or reader.done():
            self._readers[opened.replica] = _detached(self._read(opened.replica))
        return opened, queue

    def replica_of(self, request_id: str) -> str | None:
        """The decode replica an open request is on."""
        return self._replica_of.get(request_id)

    def close(self, request_id: str, cancel: bool) -> None:
        """Stop delivering the request's items; `cancel`: it did not end on the decode side, abort it there
        (fire and forget: never raises)."""
        self._queues.pop(request_id, None)
        replica = self._replica_of.pop(request_id, None)
        if not cancel or replica is None:
            return
        task = _detached(self._cancel(request_id, replica))
        self._cancels.add(task)
        task.add_done_callback(self._cancels.discard)

    async def _cancel(self, request_id: str, replica: str | None) -> None:
        try:
            await self.decode.cancel.remote(request_id, replica=replica)
        except Exception as e:  # noqa: BLE001 - the replica may be gone: then so is the request
            log.debug("cancel of %s failed: %s", request_id, e)

    async def _read(self, replica: str) -> None:
        error: BaseException | None = None
        try:
            async for batch in self._batches(replica):
                for request_id, item in batch.items:
                    queue = self._queues.get(request_id)
                    if queue is not None:
                        queue.put_nowait(item)
            error = RuntimeError("the decode replica ended its feed")
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the decode replica failed: its requests get the error
            error = e
        finally:
            if self._readers.get(replica) is asyncio.current_task():
                del self._readers[replica]
        log.warning("decode feed from replica %s ended: %s", replica, str(error).splitlines()[0] if str(error) else
                    type(error).__name__)
        for request_id, owner in list(self._replica_of.items()):
            if owner == replica:
                self._queues[request_id].put_nowait(FeedBroken(error))

    async def _batches(self, replica: str):
        if not self.link:
            async for batch in self.decode.options(stream=True).feed.remote(self.caller, replica=replica):
                yield batch
            return
        address = await self.decode.feed_link.remote(self.caller, replica=replica)
        async for batch in read_feed_link(address, f"decode replica {replica}"):
            yield batch


def _detached(coro) -> asyncio.Task:
    """A task outside the HTTP request being served: Serve cancels the calls a request made when the request
    is cancelled (its client left), and neither a cancel sent because the client left nor a feed shared by
    every request may go with it."""
    return asyncio.get_running_loop().create_task(coro, context=contextvars.Context())
