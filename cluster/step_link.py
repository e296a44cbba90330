"""Step links: the per-step control path between a decode replica and each rank of its group.

Every group step is one RankStep out to each rank and one StepReport back. As Ray actor calls those cost
about 1.6 ms of CPU in the rank and 1.9 ms in the replica per step (measured with a 10 ms step on 2 cores:
Ray's call path wakes several threads on both sides), a sixth of a small model's step, taken from the
cores the step needs. Over one kept-open TCP connection per rank, with length-prefixed msgpack frames of
the records' wire forms (cluster/protocol/step.py), a step costs tens of microseconds on each side. (vLLM and SGLang keep their per-step traffic off Ray for the same
reason; Ray's compiled graphs spin a core on both sides while a step runs, which a small host cannot
spare.) Everything else between the replica and a rank (start-up, hand-over channels, health pings) stays
on Ray.

The rank listens (StepListener, one thread that also runs the steps, in arrival order); the replica
connects (StepLink, asyncio) and matches replies to steps in order. The connection is authenticated by a
random token the replica handed the rank through Ray, so only the replica owning the group may send it
steps. Then each end sends its hello (STEP_LINK_VERSION); a rank speaking another version is a
ProtocolVersionError when the link opens, at group start, not a malformed step mid-request. A rank that dies
closes its socket: the replica learns it at once, not at the step deadline.

Frames: the replica sends `(RankStep.to_wire(), wait_s)`; the rank answers `("ok", StepReport.to_wire())`
or `("error", "Type: message")` when its step raised.
"""
from __future__ import annotations

import asyncio
import collections
import hmac
import logging
import socket
import threading
from typing import Callable

from cluster.errors import ProtocolError
from cluster.framing import TOKEN_BYTES, frame, no_delay, read_frame, recv_exact, recv_frame
from cluster.protocol import wire
from cluster.protocol.step import STEP_LINK_VERSION, RankStep, StepReport

LINK = "step"
HELLO_TIMEOUT_S = 10.0  # a connection that does not present its token and hello by then is closed

log = logging.getLogger(__name__)


class StepLinkError(ConnectionError):
    """The link to a rank broke (the rank died or closed it); every step still waiting on it fails."""


class RemoteStepError(RuntimeError):
    """The rank's step raised; the message is the rank's `Type: message`."""


class StepListener:
    """Rank side: accepts the replica's connection (the first that presents `token` and this protocol's
    hello) and answers each step with `handle(step, wait_s)`'s report, or the error it raised, in order, on
    its own thread."""

    def __init__(self, host: str, token: bytes, handle: Callable[[RankStep, float], StepReport],
                 name: str = "step-link", version: int = STEP_LINK_VERSION):
        self._token = token
        self._handle = handle
        self._version = version  # another value only where a test plays a rank of another Tandem version
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
                try:
                    request = recv_frame(conn, "a step frame")
                except EOFError:
                    return  # the replica closed the link: the group is being dropped
                try:
                    step_wire, wait_s = wire.record(request, "step frame", ("step", "wait_s"))
                    report = self._handle(RankStep.from_wire(step_wire), wire.number(wait_s, "step frame", "wait_s"))
                    reply = ("ok", report.to_wire())
                except Exception as e:  # noqa: BLE001 - reported to the replica, which rebuilds the group
                    log.exception("step failed")
                    reply = ("error", f"{type(e).__name__}: {e}")
                conn.sendall(frame(reply))
        except (OSError, ProtocolError) as e:
            if not self._closed:
                log.warning("step link closed: %s", e)
        finally:
            self.close()

    def _accept(self) -> socket.socket | None:
        """The first connection that presents the token; others (a stray client) are dropped. The replica's
        hello is answered with this rank's; a replica of another version closes the link on reading it (and
        this rank, having logged why, stops listening: its group is refused)."""
        while not self._closed:
            conn, _ = self._server.accept()
            conn.settimeout(HELLO_TIMEOUT_S)
            try:
                token = recv_exact(conn, TOKEN_BYTES)
            except OSError:
                token = None
            if token is None or not hmac.compare_digest(token, self._token):
                conn.close()
                continue
            self._server.close()
            try:
                peer = recv_frame(conn, "the replica's hello")
                conn.sendall(frame(wire.hello(LINK, self._version)))
                wire.check_hello(peer, LINK, self._version, "the decode replica")
            except (OSError, EOFError, ProtocolError) as e:
                log.error("step link refused: %s", e)
                conn.close()
                return None
            conn.settimeout(None)
            no_delay(conn)
            self._conn = conn
            return conn
        return None


class StepLink:
    """Replica side: one connection to one rank. `call` sends a step now and returns a future of its
    report; reports come in step order."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, name: str):
        self.name = name
        self._reader, self._writer = reader, writer
        self._waiting: collections.deque[asyncio.Future] = collections.deque()
        self._broken: StepLinkError | None = None
        self._reading = asyncio.ensure_future(self._read())

    @staticmethod
    async def open(address: tuple[str, int], token: bytes, name: str, timeout_s: float,
                   version: int = STEP_LINK_VERSION) -> "StepLink":
        """Connects and exchanges hellos: ProtocolVersionError if the rank speaks another version,
        StepLinkError if it cannot be reached or closes the link unanswered (a wrong token)."""
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(*address), timeout_s)
        except (OSError, asyncio.TimeoutError) as e:
            raise StepLinkError(f"cannot reach {name} at {address[0]}:{address[1]}: {e}") from e
        try:
            no_delay(writer.get_extra_info("socket"))
            writer.write(token + frame(wire.hello(LINK, version)))
            hello = await asyncio.wait_for(read_frame(reader, f"{name}'s hello"), timeout_s)
            wire.check_hello(hello, LINK, version, name)
        except (asyncio.IncompleteReadError, OSError, asyncio.TimeoutError) as e:
            writer.close()
            raise StepLinkError(f"{name} closed its step link unanswered: {type(e).__name__}") from e
        except ProtocolError:
            writer.close()
            raise
        return StepLink(reader, writer, name)

    def call(self, step: RankStep, wait_s: float = 0.0) -> asyncio.Future:
        """The future of the rank's StepReport (RemoteStepError if its step raised)."""
        fut = asyncio.get_running_loop().create_future()
        if self._broken is not None:
            fut.set_exception(self._broken)
            return fut
        self._waiting.append(fut)
        self._writer.write(frame((step.to_wire(), wait_s)))
        return fut

    def close(self) -> None:
        self._fail(StepLinkError(f"the link to {self.name} was closed"))
        self._reading.cancel()
        self._writer.close()

    async def _read(self) -> None:
        try:
            while True:
                kind, value = wire.record(await read_frame(self._reader, f"{self.name}'s report"), "reply frame",
                                          ("kind", "value"))
                if not self._waiting:
                    raise StepLinkError(f"{self.name} answered a step nobody sent")
                fut = self._waiting.popleft()
                if fut.done():
                    continue  # its caller gave up (the group is being replaced)
                if kind == "ok":
                    try:
                        fut.set_result(StepReport.from_wire(value))
                    except ProtocolError as e:  # this step's report only: the frames around it are whole
                        fut.set_exception(e)
                else:
                    fut.set_exception(RemoteStepError(str(value)))
        except asyncio.CancelledError:
            raise
        except asyncio.IncompleteReadError:
            self._fail(StepLinkError(f"{self.name} closed its step link (it died or was stopped)"))
        except (OSError, StepLinkError, ProtocolError) as e:
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
