"""StepTurns: a rank runs the group's steps in their order (RankStep.seq), whatever order the calls reach it.

A rank actor serves calls on several threads, and the decode replica keeps the next step queued at the
ranks while they run the current one (DecodeConfig.steps_in_flight): a step that arrives early waits here
for its predecessors. A step that never arrives is a lost call: its successors fail after `timeout_s`
rather than hang, and the replica rebuilds the group.
"""
from __future__ import annotations

import contextlib
import threading


class StepTurns:
    def __init__(self, timeout_s: float = 600.0):
        self.timeout_s = timeout_s
        self.next_seq = 0
        self._cv = threading.Condition()

    @contextlib.contextmanager
    def turn(self, seq: int):
        """Waits until every step numbered below `seq` has run, runs the body, then lets `seq + 1` go (also
        if the body raised: the group is rebuilt after a failure, but nothing may hang meanwhile)."""
        with self._cv:
            if not self._cv.wait_for(lambda: self.next_seq >= seq, timeout=self.timeout_s):
                raise RuntimeError(f"step {self.next_seq} never came (step {seq} waited {self.timeout_s:.0f}s)")
            if self.next_seq != seq:
                raise RuntimeError(f"step {seq} came twice")
        try:
            yield
        finally:
            with self._cv:
                self.next_seq += 1
                self._cv.notify_all()
