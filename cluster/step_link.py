"""Step links: the per-step control path between a decode replica and each rank of its group.

Every group step is one RankStep out to each rank and one StepReport back. As Ray actor calls those cost
about 1.6 ms of CPU in the rank and 1.9 ms in the replica per step (measured with a 10 ms step on 2 cores:
Ray's call path wakes several threads on both sides), a sixth of a small model's step, taken from the
cores the step needs. Over one kept-open TCP connection per rank, with length-prefixed pickles, a step
costs tens of microseconds on each side. (vLLM and SGLang keep their per-step traffic off Ray for the same
reason; Ray's compiled graphs spin a core on both sides while a step runs, which a small host cannot
spare.) Everything else between the replica and a rank (start-up, hand-over channels, health pings) stays
on Ray.

The rank listens (StepListener, one thread that also runs the steps, in arrival order); the replica
connects (StepLink, asyncio) and matches replies to steps in order. The connection is authenticated by a
random token the replica handed the rank through Ray, so only the replica owning the group may send it
pickles. A rank that dies closes its socket: the replica learns it at once, not at the step deadline.
"""
from __future__ import annotations

import asyncio
import collections
import hmac
import logging
import pickle
import socket
import threading
from typing import Any, Callable

from cluster.framing import HEADER, TOKEN_BYTES, frame, no_delay, read_frame, recv_exact

log = logging.getLogger(__name__)


class StepLinkError(ConnectionError):
    """The link to a rank broke (the rank died or closed it); every step still waiting on it fails."""


class RemoteStepError(RuntimeError):
    """The rank's step raised; the message is the rank's `Type: message`."""


class StepListener:
    """Rank side: accepts the replica's connection (the first that presents `token`) and answers each
    request frame with `handle(request)`'s result, or the error it raised, in order, on its own thread."""

    def __init__(self, host: str, token: bytes, handle: Callable[[Any], Any], name: str = "step-link"):
        self._token = token
        self._handle = handle
        self._server = socket.create_server((host, 0))
        self.address: tuple[str, int] = (host, self._server.getsockname()[1])
        self._conn: socket.socket | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._serve, daemon=True, name=name)
        self._thread.start()

    def close(self) -> None:
        self._closed = True
        for s in (self._conn, self._server):
            if s is not None:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()

    def _serve(self) -> None:
        try:
            conn = self._accept()
            if conn is None:
                return
            while True:
                head = recv_exact(conn, HEADER.size)
                if head is None:
                    return  # the replica closed the link: the group is being dropped
                body = recv_exact(conn, HEADER.unpack(head)[0])
                if body is None:
                    return
                try:
                    reply = ("ok", self._handle(pickle.loads(body)))
                except Exception as e:  # noqa: BLE001 - reported to the replica, which rebuilds the group
                    log.exception("step failed")
                    reply = ("error", f"{type(e).__name__}: {e}")
                conn.sendall(frame(reply))
        except OSError as e:
            if not self._closed:
                log.warning("step link closed: %s", e)
        finally:
            self.close()

    def _accept(self) -> socket.socket | None:
        """The first connection that presents the token; others (a stray client) are dropped."""
        while not self._closed:
            conn, _ = self._server.accept()
            conn.settimeout(10.0)
            try:
                token = recv_exact(conn, TOKEN_BYTES)
            except OSError:
                token = None
            if token is not None and hmac.compare_digest(token, self._token):
                conn.settimeout(None)
                no_delay(conn)
                self._conn = conn
                self._server.close()
                return conn
            conn.close()
        return None


class StepLink:
    """Replica side: one connection to one rank. `call` sends a request now and returns a future of its
    reply; replies come in request order."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, name: str):
        self.name = name
        self._reader, self._writer = reader, writer
        self._waiting: collections.deque[asyncio.Future] = collections.deque()
        self._broken: StepLinkError | None = None
        self._reading = asyncio.ensure_future(self._read())

    @staticmethod
    async def open(address: tuple[str, int], token: bytes, name: str, timeout_s: float) -> "StepLink":
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(*address), timeout_s)
        except (OSError, asyncio.TimeoutError) as e:
            raise StepLinkError(f"cannot reach {name} at {address[0]}:{address[1]}: {e}") from e
        no_delay(writer.get_extra_info("socket"))
        writer.write(token)
        return StepLink(reader, writer, name)

    def call(self, request: Any) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        if self._broken is not None:
            fut.set_exception(self._broken)
            return fut
        self._waiting.append(fut)
        self._writer.write(frame(request))
        return fut

    def close(self) -> None:
        self._fail(StepLinkError(f"the link to {self.name} was closed"))
        self._reading.cancel()
        self._writer.close()

    async def _read(self) -> None:
        try:
            while True:
                kind, value = await read_frame(self._reader)
                if not self._waiting:
                    raise StepLinkError(f"{self.name} answered a step nobody sent")
                fut = self._waiting.popleft()
                if fut.done():
                    continue  # its caller gave up (the group is being replaced)
                if kind == "ok":
                    fut.set_result(value)
                else:
                    fut.set_exception(RemoteStepError(value))
        except asyncio.CancelledError:
            raise
        except asyncio.IncompleteReadError:
            self._fail(StepLinkError(f"{self.name} closed its step link (it died or was stopped)"))
        except (OSError, StepLinkError, pickle.UnpicklingError) as e:
            self._fail(e if isinstance(e, StepLinkError) else StepLinkError(f"the link to {self.name} broke: "
                                                                             f"{type(e).__name__}: {e}"))

    def _fail(self, error: StepLinkError) -> None:
        if self._broken is None:
            self._broken = error
        while self._waiting:
            fut = self._waiting.popleft()
            if not fut.done():
                fut.set_exception(self._broken)
                fut.exception()  # marked as seen: a step whose caller was dropped would log it at exit
