"""Generation: one request's trip through the workers, as the router sees it.

1. open the request on a decode replica (Serve picks it by load); the answer is its group's address;
2. ask a prefill replica (picked by load) to run the prompt and hand the KV to that group; its stream
   answers with the first token, and ends once the KV has left (or raises if the hand-over failed);
3. read the request's items from that decode replica's feed (router/decode_feed.py): token deltas, or a
   StreamError; until the prefill's stream has ended, watch it too, so that a prefill that dies with the
   hand-over still queued ends the request at once rather than at the decode side's deadline for the header.
Cancelling (client gone, stop string) cancels whatever is in flight; the workers free the blocks.

Resumption (Resume): when a worker dies under the request (any 503 "unavailable" failure: a decode rank or
replica died, a prefill replica died, the KV hand-over broke), the request is not lost. Everything above this
class (detokenizer, stop strings, tool-call parser, logprobs, usage) lives in the router and keeps its state;
what died is only the workers' copy. So the request is submitted again as a continuation of the tokens it
already yielded (cluster/protocol PrefillRequest.continuation: same seed, so sampling, which depends only on
(seed, position), draws the same tokens; its grammar replays them on the prefill side; speculation's draft state
is recomputed there as for any prompt), to whichever prefill and decode replicas Serve picks, and the stream
goes on with the next token: the client sees a pause, never an error, never a repeated or missing token.
Bounded: at most `Resume.attempts` re-submissions per request, each pause at most `Resume.deadline_s`; then
the request ends with the error as before. A client that leaves during the pause cancels the attempt.
"""
from __future__ import annotations

import asyncio
import logging
import re
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable

import ray
from ray.serve.exceptions import BackPressureError

from cluster.feed_link import FeedLinkError
from cluster.protocol import PrefillRequest, PrefillResult, StreamError, attempt_id
from engine.core.request import Continuation
from engine.errors import TandemError
from engine.outputs import SpecUsage
from engine.sampling_params import SamplingParams
from router.decode_feed import DecodeFeeds, FeedBroken
from router.errors import APIError

log = logging.getLogger(__name__)

# How long a hand-over failure reported by the decode side waits for the prefill's own outcome, which names
# the cause when the prefill died (Ray reports a killed actor within about a second).
PREFILL_FAILURE_GRACE_S = 3.0


# First wait before re-submitting a request whose worker died, doubled per failed attempt up to the cap: Ray
# restarts a dead prefill replica and the decode replica rebuilds its group in seconds, and the open call itself
# waits for a group being rebuilt (decode_worker/deployment.py), so retrying faster only burns attempts.
RESUME_BACKOFF_S = 0.25
RESUME_BACKOFF_CAP_S = 2.0


@dataclass(frozen=True, slots=True)
class Resume:
    """How a request whose worker died is resumed (RouterSettings.resume_attempts / resume_deadline_s).
    on_resume(cause, pause seconds) is called once per resumption that yields a token again (metrics)."""
    attempts: int = 3  # re-submissions per request; 0: no resumption (the request ends with the error)
    deadline_s: float = 120.0  # longest pause per resumption, from the failure to the next token
    on_resume: Callable[[str, float], None] | None = None


NO_RESUME = Resume(attempts=0)


def resumable(e: APIError) -> bool:
    """A failure of the workers, not of the request: what a worker death, a broken hand-over or a decode group
    being rebuilt is answered with (a 503 "unavailable_error"; an overload is a 503 "overloaded_error")."""
    return e.status == 503 and e.error_type == "unavailable_error"


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


def local_eligible(params: dict) -> bool:
    """Whether a request may be prefilled by the decode group itself (conditional disaggregation): not one with
    a grammar (its compile stays on the prefill replicas, off the decode step) nor one asking for prompt
    logprobs (computed by a prefill only)."""
    return params.get("structured_output") is None and params.get("prompt_logprobs") is None


class Generation:
    def __init__(self, prefill, feeds: DecodeFeeds, request_id: str, prompt_token_ids: list[int], params: dict,
                 resume: Resume = NO_RESUME, local_max_tokens: int = 0):
        """local_max_tokens: offer the request to the decode group to prefill itself when its ranks hold all but
        at most this many of its prompt tokens (RouterSettings.local_prefill_max_tokens; 0: never)."""
        self.prefill, self.feeds = prefill, feeds
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.resume = resume
        self.local_max_tokens = local_max_tokens if local_eligible(params) else 0
        self.local = False  # the current attempt is prefilled by the decode group (no prefill replica, no hand-over)
        self._queue: asyncio.Queue | None = None  # the decode side's items for this request, while it is open
        self._prefill_call = None  # the prefill's stream, until the hand-over has left it
        self._handover: asyncio.Future | None = None  # ends when the prefill's stream does
        self.first: PrefillResult | None = None
        # What the client has been sent, for a resumption: the tokens yielded, their logprobs when asked,
        # the seed the prefill sampled with (drawn there when the request gave none).
        self._sent: list[int] = []
        self._sent_logprobs: list = []
        self._seed: int | None = params.get("seed")
        self.resumptions = 0
        self._attempt_id = request_id  # the current attempt's id at the workers (a resumption's gets a suffix)
        self._avoid: str | None = None  # the decode replica a worker failure happened on: the next attempt avoids it
        self._opened = False  # the current attempt got past the decode replica's open

    async def start(self) -> PrefillResult:
        """Runs until the first token exists; raises APIError (nothing is left running then). A worker that
        dies under the request before its first token is resumed like one that dies later (nothing was sent
        yet); a request no decode replica would open (every group is being rebuilt) is refused at once, as a
        new request should be, for the client or its load balancer to retry elsewhere."""
        try:
            self.first = await self._begin(None)
        except APIError as e:
            if not self._opened:
                raise
            self.first = await self._resumed(e, _cause(e.message))
        return self.first

    async def _begin(self, continuation: Continuation | None) -> PrefillResult:
        """One attempt: open the request on a decode replica, run its prompt (and continuation) on a prefill
        replica that hands the KV over, unless the decode group holds nearly all of it and prefills it itself;
        -> the first result. Raises APIError, with nothing left running."""
        self._opened = self.local = False
        try:
            ids = list(self.prompt_token_ids)
            known = ids + (list(continuation.output_token_ids) if continuation is not None else [])
            params = self.params if continuation is None else {**self.params, "prompt_logprobs": None}
            request = PrefillRequest(self._attempt_id, tuple(ids), SamplingParams(**params), continuation)
            offer = (request.to_wire(), self.local_max_tokens) if self.local_max_tokens else None
            opened, self._queue = await self.feeds.open(self._attempt_id, len(known), known,
                                                        self.params.get("cache_salt"), self._avoid, local=offer)
            self._opened = True
            if opened.local:
                self.local = True
                first = await self._first_delta(opened.seed)
            else:
                self._prefill_call = self.prefill.options(stream=True).prefill.remote(request.to_wire(),
                                                                                      opened.target)
                first = await self._prefill_call.__anext__()
        except BaseException as e:
            self.cancel()
            if isinstance(e, Exception):
                raise api_error(e) from e
            raise
        if first.seed is not None:
            self._seed = first.seed
        if first.finished:
            self._close(cancel=not self.local)  # no hand-over comes: the decode side drops the expected request
            self._prefill_call = None
        elif not self.local:
            self._handover = asyncio.ensure_future(self._handed_over(self._prefill_call))
        return first

    async def _first_delta(self, seed: int | None) -> PrefillResult:
        """A locally prefilled attempt's first token(s), from the decode feed, as the prefill would have
        answered them. Raises APIError (the decode side's StreamError or a broken feed)."""
        while True:
            item = await self._queue.get()
            if isinstance(item, StreamError):
                raise APIError(item.status, item.message, item.error_type)
            if isinstance(item, FeedBroken):
                raise api_error(item.error)
            if item.token_ids or item.finished:  # a step that ran only a chunk of the prompt reports no token
                break
        return PrefillResult(self._attempt_id, list(item.token_ids), item.finished,
                             item.finish_reason if item.finished else None, list(item.logprobs), seed=seed)

    async def _resumed(self, error: APIError, cause: str) -> PrefillResult:
        """Submit the request again after `error` as a continuation of what was sent; -> the new attempt's
        first result. Raises `error` (or the last attempt's) when it is not a worker failure, the attempts
        are used up, or the pause would pass its deadline."""
        if not resumable(error) or self.resumptions >= self.resume.attempts:
            raise error
        if self._sent and self._seed is None:  # a prefill of another version that does not say its seed
            raise error
        failed_at = time.monotonic()
        delay = RESUME_BACKOFF_S
        while True:
            if self.resumptions >= self.resume.attempts or time.monotonic() - failed_at + delay > self.resume.deadline_s:
                raise error
            await asyncio.sleep(delay)  # cancelled here (the client left): nothing is running
            self.resumptions += 1
            self._attempt_id = attempt_id(self.request_id, self.resumptions)
            log.warning("resuming %s after %d sent tokens (%s: %s) as %s", self.request_id, len(self._sent), cause,
                        error.message, self._attempt_id)
            cont = None
            if self._sent:
                cont = Continuation(tuple(self._sent), self._seed,
                                    tuple(self._sent_logprobs) if self.params.get("logprobs") is not None else ())
            try:
                first = await self._begin(cont)
            except APIError as e:
                if not resumable(e):
                    raise
                error, delay = e, min(delay * 2, RESUME_BACKOFF_CAP_S)
                continue
            if self.resume.on_resume is not None:
                self.resume.on_resume(cause, time.monotonic() - failed_at)
            return first

    @staticmethod
    async def _handed_over(prefill_stream) -> None:
        async for _ in prefill_stream:
            raise APIError(500, "the prefill answered more than one result", "internal_error")

    async def events(self) -> AsyncIterator[TokenEvent]:
        """The first token(s), then the decode group's; raises APIError if the decode side fails and the
        request cannot be resumed."""
        first = self.first
        while True:
            event = TokenEvent(tuple(first.token_ids), tuple(first.logprobs),
                               first.finish_reason if first.finished else None)
            self._sent_through(event)
            yield event
            if first.finished:
                return
            try:
                async for event in self._decoded():
                    self._sent_through(event)
                    yield event
                return
            except _WorkerFailed as failed:
                first = await self._resumed(failed.error, failed.cause)

    def _sent_through(self, event: TokenEvent) -> None:
        self._sent.extend(event.token_ids)
        if self.params.get("logprobs") is not None:
            self._sent_logprobs.extend(event.logprobs)

    async def _decoded(self) -> AsyncIterator[TokenEvent]:
        """The decode group's events for the current attempt; a worker failure comes out as _WorkerFailed
        (nothing of the attempt is left running then), any other failure as its APIError."""
        try:
            while True:
                try:
                    item = await self._next_decode_item()
                except APIError as e:  # the prefill's stream failed: it died, or the hand-over broke
                    raise _WorkerFailed(e, _cause(e.message)) from e
                if isinstance(item, StreamError):
                    self._abandon()
                    self._close(cancel=False)
                    raise _WorkerFailed(APIError(item.status, item.message, item.error_type), _cause(item.message))
                if isinstance(item, FeedBroken):
                    self.cancel()  # the replica is most likely gone; if not, it must not decode on
                    raise _WorkerFailed(api_error(item.error), "decode")
                if item.finished:  # closed before the last event goes out: a reader that stops there cancels nothing
                    self._close(cancel=False)
                yield TokenEvent(item.token_ids, item.logprobs, item.finish_reason if item.finished else None,
                                 item.speculative)
                if item.finished:
                    return
        except (APIError, _WorkerFailed):
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
            self._avoid = self.feeds.replica_of(self._attempt_id)  # where the next attempt, if any, should not go
            self._queue = None
            self.feeds.close(self._attempt_id, cancel)

    def cancel(self) -> None:
        """Stop whatever is still running; never raises (it runs while another error is being answered)."""
        self._abandon()
        self._close(cancel=True)

    def _abandon(self) -> None:
        """Stop the attempt's prefill call: a hand-over it still holds queued is then dropped unsent
        (prefill_worker/handover.py), not left to hold up the hand-overs queued behind it."""
        if self._handover is not None:
            self._handover.cancel()
            self._handover = None
        if self._prefill_call is not None:
            try:
                self._prefill_call.cancel()
            except Exception as e:  # noqa: BLE001 - a call that failed to start has nothing to cancel
                log.debug("cancelling %s: %s", self._attempt_id, e)
            self._prefill_call = None


def _cause(message: str) -> str:
    """What failed, for the resumptions metric, from the failure's message (router/generation.py's own and the
    workers' StreamErrors name it): the KV hand-over, a prefill replica, or else the decode side."""
    if "hand-over" in message:
        return "handover"
    return "prefill" if "prefill" in message else "decode"


class _WorkerFailed(Exception):
    """Inside Generation: the current attempt failed because a worker did (`cause`: decode, prefill, handover)."""

    def __init__(self, error: APIError, cause: str):
        super().__init__(error.message)
        self.error, self.cause = error, cause
