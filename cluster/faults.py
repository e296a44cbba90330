"""Fault points: named places in the serving path where a real fault can be made to happen at a chosen
moment, so that tests and `bench.soak --faults` can hit windows a kill from outside only hits by luck
(a decode rank dying between a hand-over's header and its payload, a payload that stalls past its
deadline).

Off unless armed: a deployment arms the points its `fault_points` setting names (empty by default), and
an armed point still fires only for a request whose id contains the point's name (the router takes the
client's X-Request-Id into the request id), so one armed server serves every other request normally; and only
for its first attempt: the router's resumption of it after the fault (`<id>~r<n>`, router/generation.py) runs
as any request would, so a test sees what one fault does.

The setting lists `point=action`, comma-separated; an action may end in `@text`, and then fires only where
the point's `where` (e.g. the channel's name, which names the decode rank: `-r1-`) contains that text:

    handover.send_payload=stall:8          the prefill's sender waits 8 s between the headers and the payload
    handover.recv_payload=kill@-r1-        decode rank 1 SIGKILLs itself after answering "send", before
                                           reading the payload

    handover.send_header=stall:30          the prefill's sender waits 30 s before opening channels and
                                           sending the headers (the first token is already out)

Points: `handover.send_header`, `handover.send_payload` (prefill_worker/handover.py),
`handover.recv_payload` (decode_worker/receiver.py).
"""
from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass

from cluster.protocol.prefill import RESUMED_MARK

log = logging.getLogger(__name__)

POINTS = ("handover.send_header", "handover.send_payload", "handover.recv_payload")


@dataclass(frozen=True, slots=True)
class FaultAction:
    kind: str  # "stall" | "kill"
    seconds: float = 0.0  # stall only
    where: str = ""  # fire only where the point's context contains this

    @staticmethod
    def parse(text: str) -> "FaultAction":
        action, _, where = text.partition("@")
        kind, _, arg = action.partition(":")
        if kind == "kill" and not arg:
            return FaultAction("kill", where=where)
        if kind == "stall":
            try:
                return FaultAction("stall", float(arg), where)
            except ValueError:
                pass
        raise ValueError(f"fault action {text!r}: expected 'kill' or 'stall:SECONDS', optionally '@WHERE'")


class FaultPoints:
    """The armed points of one process (empty: every `hit` is a no-op)."""

    def __init__(self, spec: str = ""):
        self.actions: dict[str, FaultAction] = {}
        for item in filter(None, (s.strip() for s in (spec or "").split(","))):
            point, sep, action = item.partition("=")
            if not sep or point not in POINTS:
                raise ValueError(f"fault point {item!r}: expected POINT=ACTION with POINT one of {POINTS}")
            self.actions[point] = FaultAction.parse(action)
        self.fired = 0

    def __bool__(self) -> bool:
        return bool(self.actions)

    def hit(self, point: str, request_id: str, where: str = "") -> None:
        """Make the fault armed at `point` happen now, if it is armed and `request_id` asks for it."""
        action = self.actions.get(point)
        if action is None or point not in request_id or action.where not in where or RESUMED_MARK in request_id:
            return
        self.fired += 1
        log.warning("fault point %s fires for %s (%s): %s", point, request_id, where, action)
        if action.kind == "stall":
            time.sleep(action.seconds)
        else:  # the process dies here as it would from an OOM kill: no clean-up, no goodbye to peers
            os.kill(os.getpid(), signal.SIGKILL)
