"""DecodeController: the decode replica's bookkeeping between lockstep steps (no Ray, no threads).

Each request it serves goes EXPECTED (its stream is open, its hand-over is on the way) -> RESERVING
(every rank has the header; blocks are reserved and the payload is coming) -> RUNNING (committed on
every rank; its tokens flow to its stream). The controller turns the ranks' step reports into the
next step's commands and the per-request stream events. A request whose client went away is dropped
before its blocks exist, or aborted after its payload landed (never while a payload is being written
into its blocks, which could by then belong to someone else).
"""
from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass, field

from decode_worker.protocol import Command, CommandKind, StepReport, TokenDelta


@dataclass(frozen=True, slots=True)
class StreamError:
    """Ends a request's stream with an error (a typed value: the router maps it to a response)."""
    message: str
    error_type: str = "unavailable_error"
    status: int = 503


class Phase(enum.Enum):
    EXPECTED = "expected"
    RESERVING = "reserving"
    RUNNING = "running"


@dataclass(slots=True, eq=False)
class Tracked:
    request_id: str
    sink: asyncio.Queue  # TokenDelta | StreamError items
    deadline: float  # for the header to reach every rank
    phase: Phase = Phase.EXPECTED
    arrived: set[int] = field(default_factory=set)
    landed: set[int] = field(default_factory=set)
    failed: set[int] = field(default_factory=set)  # ranks whose payload transfer broke
    cancelled: bool = False
    handover_seconds: float = 0.0  # payload receive time of the slowest rank
    unpack_seconds: float = 0.0
    handover_bytes: int = 0  # over all ranks


class DecodeController:
    def __init__(self, tp_size: int, handover_timeout_s: float = 60.0):
        self.tp_size = tp_size
        self.handover_timeout_s = handover_timeout_s
        self.requests: dict[str, Tracked] = {}
        self._commands: list[Command] = []
        self.kv_blocks_used = 0
        self.kv_blocks_total = 0
        self.num_running = 0
        self.handovers: list[tuple[float, float, int]] = []  # recent (receive s, unpack s, bytes) per request
        self.handovers_total = 0

    # ------------------------------------------------------------------ from streams
    def expect(self, request_id: str, sink: asyncio.Queue) -> None:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already being decoded")
        self.requests[request_id] = Tracked(request_id, sink, time.monotonic() + self.handover_timeout_s)

    def cancel(self, request_id: str) -> None:
        """The stream is gone (client disconnect, stop string, prefill failure)."""
        t = self.requests.get(request_id)
        if t is None:
            return
        if t.phase is Phase.EXPECTED:
            del self.requests[request_id]
            self._commands.append(Command(CommandKind.DROP, request_id))
        elif t.phase is Phase.RESERVING:
            t.cancelled = True  # aborted once the payload has landed (or failed)
        else:
            del self.requests[request_id]
            self._commands.append(Command(CommandKind.ABORT, request_id))

    # ------------------------------------------------------------------ the step loop
    @property
    def has_work(self) -> bool:
        return bool(self.requests) or bool(self._commands)

    @property
    def decoding(self) -> bool:
        return self.num_running > 0

    def next_commands(self, now: float | None = None) -> list[Command]:
        now = time.monotonic() if now is None else now
        for t in list(self.requests.values()):
            if t.phase is Phase.EXPECTED and now > t.deadline:
                self._fail(t, f"the hand-over did not reach the decode group within {self.handover_timeout_s:.0f}s",
                           Command(CommandKind.DROP, t.request_id))
        commands, self._commands = self._commands, []
        return commands

    def on_reports(self, reports: list[StepReport]) -> None:
        lead = reports[0]
        self.kv_blocks_used, self.kv_blocks_total = lead.kv_blocks_used, lead.kv_blocks_total
        self.num_running = lead.num_running
        for d in lead.deltas:
            self._deliver(d)
        for rep in reports:
            for rid, reason in rep.failed:
                self._on_failed(rid, rep.tp_rank, reason)
            for rid in rep.arrived:
                self._on_arrived(rid, rep.tp_rank)
            for rid in rep.deferred:
                t = self.requests.get(rid)
                if t is not None and rep.tp_rank == 0:
                    t.phase = Phase.EXPECTED  # no free blocks now (on any rank): ask again after the next step
            for rid, seconds, unpack, nbytes in rep.handover_seconds:
                t = self.requests.get(rid)
                if t is not None:
                    t.handover_seconds = max(t.handover_seconds, seconds)
                    t.unpack_seconds = max(t.unpack_seconds, unpack)
                    t.handover_bytes += nbytes
            for rid in rep.landed:
                self._on_landed(rid, rep.tp_rank)
        for t in list(self.requests.values()):
            if t.phase is Phase.EXPECTED and len(t.arrived) == self.tp_size:
                if t.cancelled:
                    del self.requests[t.request_id]
                    self._commands.append(Command(CommandKind.DROP, t.request_id))
                else:
                    t.phase = Phase.RESERVING
                    self._commands.append(Command(CommandKind.RESERVE, t.request_id))

    def fail_all(self, message: str) -> None:
        """The group died: every stream ends with an error; the next group starts clean."""
        for t in list(self.requests.values()):
            t.sink.put_nowait(StreamError(message))
        self.requests.clear()
        self._commands.clear()
        self.num_running = 0
        self.kv_blocks_used = 0

    # ------------------------------------------------------------------ internals
    def _on_arrived(self, rid: str, rank: int) -> None:
        t = self.requests.get(rid)
        if t is None or t.phase is not Phase.EXPECTED:
            self._commands.append(Command(CommandKind.DROP, rid))  # nobody waits for it any more
            return
        t.arrived.add(rank)

    def _on_landed(self, rid: str, rank: int) -> None:
        t = self.requests.get(rid)
        if t is None:
            return
        t.landed.add(rank)
        self._settle(t)

    def _on_failed(self, rid: str, rank: int, reason: str) -> None:
        t = self.requests.get(rid)
        if t is None:
            return
        if t.phase is Phase.EXPECTED:  # no blocks yet: refuse the header wherever it is parked
            self._fail(t, f"hand-over failed on rank {rank}: {reason}", Command(CommandKind.DROP, rid))
            return
        if not t.cancelled:
            t.sink.put_nowait(StreamError(f"hand-over failed on rank {rank}: {reason}"))
        t.cancelled = True
        t.failed.add(rank)
        self._settle(t)

    def _settle(self, t: Tracked) -> None:
        """Once every rank's payload has landed or failed, commit, or abort (which frees the blocks)."""
        if len(t.landed | t.failed) < self.tp_size:
            return
        if t.cancelled:
            del self.requests[t.request_id]
            self._commands.append(Command(CommandKind.ABORT, t.request_id))
            return
        self.handovers.append((t.handover_seconds, t.unpack_seconds, t.handover_bytes))
        self.handovers_total += 1
        del self.handovers[:-512]
        t.phase = Phase.RUNNING
        self._commands.append(Command(CommandKind.COMMIT, t.request_id))

    def _deliver(self, delta: TokenDelta) -> None:
        t = self.requests.get(delta.request_id)
        if t is None or t.phase is not Phase.RUNNING:
            return
        t.sink.put_nowait(delta)
        if delta.finished:
            del self.requests[delta.request_id]

    def _fail(self, t: Tracked, message: str, *commands: Command) -> None:
        t.sink.put_nowait(StreamError(message))
        self.requests.pop(t.request_id, None)
        self._commands.extend(commands)
