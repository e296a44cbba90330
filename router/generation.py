"""Generation: one request's trip through the workers, as the router sees it.

1. open the request on a decode replica (Serve picks it by load); the answer is its group's address;
2. ask a prefill replica (picked by load) to run the prompt and hand the KV to that group; its stream
   answers with the first token, and ends once the KV has left (or raises if the hand-over failed);
3. read the request's items from that decode replica's feed (router/decode_feed.py): token deltas, or a
   StreamError; until the prefill's stream has ended, watch it too, so that a prefill that dies with the
   hand-over still queued ends the request at once rather than at the decode side's deadline for the header.
Cancelling (client gone, stop string) cancels whatever is in flight; the workers free the blocks.
"""
from __future__ import annotations

import asyncio
import logging
import re
from dataclasses import dataclass
from typing import AsyncIterator

import ray
from ray.serve.exceptions import BackPressureError

from cluster.feed_link import FeedLinkError
from cluster.protocol import PrefillRequest, PrefillResult, StreamError
from engine.errors import TandemError
from engine.outputs import SpecUsage
from engine.sampling_params import SamplingParams
from router.decode_feed import DecodeFeeds, FeedBroken
from router.errors import APIError

log = logging.getLogger(__name__)

# How long a hand-over failure reported by the decode side waits for the prefill's own outcome, which names
# the cause when the prefill died (Ray reports a killed actor within about a second).
PREFILL_FAILURE_GRACE_S = 3.0


@dataclass(frozen=True, slots=True)
class TokenEvent:
    token_ids: tuple[int, ...]
    logprobs: tuple = ()
    finish_reason: str | None = None  # set on the last event
    speculative: SpecUsage | None = None  # the decode side's speculation counts, on the last event


def api_error(e: BaseException) -> APIError:
    """Map what a worker call raised to the HTTP error a client gets."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, ray.exceptions.RayTaskError):
        cause = e.cause if getattr(e, "cause", None) is not None else e
        if isinstance(cause, TandemError):
            return APIError.from_tandem(cause)
        if cause is not e:
            return api_error(cause)
    if isinstance(e, TandemError):
        return APIError.from_tandem(e)
    if isinstance(e, FeedLinkError):  # the decode replica's end of the feed closed: it died or was stopped
        log.warning("%s", e)
        return APIError(503, "the decode worker went away while serving the request; retry", "unavailable_error")
    if isinstance(e, BackPressureError):
        return APIError(503, "the server is overloaded; retry later", "overloaded_error", code="overloaded")
    if isinstance(e, (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)):
        # Ray's text names pids, addresses and OOM advice: the log keeps it, the client gets the role.
        log.warning("a worker died under a request: %s", " ".join(str(e).split("\n")[:2]))
        return APIError(503, f"the {_role(e)} died while serving the request; retry", "unavailable_error")
    log.exception("unexpected worker error", exc_info=e)
    return APIError(500, f"internal error: {type(e).__name__}: {e}", "internal_error")


def _role(e: BaseException) -> str:
    """"prefill worker" / "decode worker" from a Ray actor error's class name (ServeReplica:APP:DEPLOYMENT)."""
    found = re.search(r"class_name: ServeReplica:[^:\s]*:(\S+)", str(e))
    return f"{found.group(1)} worker" if found else "worker"


class Generation:
    def __init__(self, prefill, feeds: DecodeFeeds, request_id: str, prompt_token_ids: list[int], params: dict):
        self.prefill, self.feeds = prefill, feeds
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self._queue: asyncio.Queue | None = None  # the decode side's items for this request, while it is open
        self._prefill_call = None  # the prefill's stream, until the hand-over has left it
        self._handover: asyncio.Future | None = None  # ends when the prefill's stream does
        self.first: PrefillResult | None = None

    async def start(self) -> PrefillResult:
        """Runs until the first token exists; raises APIError (nothing is left running then)."""
        try:
            target, self._queue = await self.feeds.open(self.request_id, len(self.prompt_token_ids),
                                                        self.prompt_token_ids, self.params.get("cache_salt"))
            request = PrefillRequest(self.request_id, tuple(self.prompt_token_ids), SamplingParams(**self.params))
            self._prefill_call = self.prefill.options(stream=True).prefill.remote(request.to_wire(), target)
            self.first = await self._prefill_call.__anext__()
        except BaseException as e:
            self.cancel()
            if isinstance(e, Exception):
                raise api_error(e) from e
            raise
        if self.first.finished:
            self._close(cancel=True)  # no hand-over comes: the decode side drops the expected request
            self._prefill_call = None
        else:
            self._handover = asyncio.ensure_future(self._handed_over(self._prefill_call))
        return self.first

    @staticmethod
    async def _handed_over(prefill_stream) -> None:
        async for _ in prefill_stream:
            raise APIError(500, "the prefill answered more than one result", "internal_error")

    async def events(self) -> AsyncIterator[TokenEvent]:
        """The first token(s), then the decode group's; raises APIError if the decode side fails."""
        first = self.first
        yield TokenEvent(tuple(first.token_ids), tuple(first.logprobs), first.finish_reason if first.finished else None)
        if first.finished:
            return
        try:
            while True:
                item = await self._next_decode_item()
                if isinstance(item, StreamError):
                    self._close(cancel=False)
                    raise APIError(item.status, item.message, item.error_type)
                if isinstance(item, FeedBroken):
                    self._close(cancel=True)  # the replica is most likely gone; if not, it must not decode on
                    raise api_error(item.error)
                yield TokenEvent(item.token_ids, item.logprobs, item.finish_reason if item.finished else None,
                                 item.speculative)
                if item.finished:
                    self._close(cancel=False)
                    return
        except APIError:
            raise
        except Exception as e:  # noqa: BLE001 - anything else: end the request on the decode side too
            self.cancel()
            raise api_error(e) from e
        except BaseException:  # cancelled (the client went away) or closed early: abort it on the decode side
            self.cancel()
            raise

    async def _next_decode_item(self):
        """The decode side's next item for this request; while the hand-over is still the prefill's, the
        prefill's failure (it died, or could not send) ends the request first, the decode side dropping it."""
        if self._handover is None:
            return await self._queue.get()
        item = asyncio.ensure_future(self._queue.get())
        await asyncio.wait({item, self._handover}, return_when=asyncio.FIRST_COMPLETED)
        if item.done() and not self._handover.done() and isinstance(item.result(), StreamError):
            # The decode side saw the hand-over fail while the prefill's call is still open: most often the
            # prefill died mid-send, and Ray's report of that, the cause a client can act on, is a moment
            # behind the decode side's (its channel broke first). Wait that moment for it.
            await asyncio.wait({self._handover}, timeout=PREFILL_FAILURE_GRACE_S)
        if self._handover.done():
            handover, self._handover, self._prefill_call = self._handover, None, None
            if handover.exception() is not None:
                item.cancel()
                self.cancel()
                raise api_error(handover.exception()) from handover.exception()
        return await item

    def _close(self, cancel: bool) -> None:
        if self._queue is not None:
            self._queue = None
            self.feeds.close(self.request_id, cancel)

    def cancel(self) -> None:
        """Stop whatever is still running; never raises (it runs while another error is being answered)."""
        if self._handover is not None:
            self._handover.cancel()
            self._handover = None
        if self._prefill_call is not None:
            try:
                self._prefill_call.cancel()
            except Exception as e:  # noqa: BLE001 - a call that failed to start has nothing to cancel
                log.debug("cancelling %s: %s", self.request_id, e)
            self._prefill_call = None
        self._close(cancel=True)
