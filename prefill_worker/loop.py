"""PrefillLoop: the prefill engine's own thread. Prompts that arrive while a step runs are batched
into the next one (the engine's scheduler packs them up to max_num_batched_tokens); each prompt
ends parked with its first token, and its hand-over goes to the sender.

The engine is touched only from this thread: other threads post adds, cancels and releases to an
inbox that is drained between steps.
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from cluster.faults import FaultPoints
from cluster.protocol import DecodeTarget, PrefillRequest, PrefillResult
from engine import TandemError

if TYPE_CHECKING:
    from engine import LLMEngine

log = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class PrefillJob:
    request: PrefillRequest
    target: DecodeTarget
    future: Future  # the PrefillResult (first token)
    handed_over: Future | None = None  # set before `future` resolves when a hand-over follows (HandoverSender)
    submitted: float = field(default_factory=time.monotonic)


class PrefillLoop:
    def __init__(self, engine: LLMEngine, sender_name: str, transfer_timeout_s: float, connect_timeout_s: float,
                 transport: str = "auto", faults: FaultPoints | None = None):
        from prefill_worker.handover import HandoverSender  # packs KV with torch: loaded with a loop, not with this module

        self.engine = engine
        self.sender = HandoverSender(engine.kv_cache, self.release, sender_name, transfer_timeout_s,
                                     connect_timeout_s, transport, faults)
        self._inbox: list[tuple[str, object]] = []
        self._cv = threading.Condition()
        self._jobs: dict[str, PrefillJob] = {}
        self._stopped = False
        self.steps = 0
        self.prompt_tokens_waiting = 0
        self.finished_here = 0  # requests whose prefill finished them (their first token was the last): no hand-over
        self._thread = threading.Thread(target=self._run, daemon=True, name="prefill-loop")
        self._thread.start()

    # ------------------------------------------------------------------ other threads
    def submit(self, request: PrefillRequest, target: DecodeTarget) -> PrefillJob:
        job = PrefillJob(request, target, Future())
        self._post("add", job)
        return job

    def cancel(self, request_id: str) -> None:
        self._post("cancel", request_id)

    def release(self, request_id: str) -> None:
        """The sender packed the request's blocks: they can be freed."""
        self._post("release", request_id)

    def stop(self) -> None:
        self._post("stop", None)
        self.sender.close()

    @property
    def num_jobs(self) -> int:
        return len(self._jobs)

    def _post(self, kind: str, item) -> None:
        with self._cv:
            self._inbox.append((kind, item))
            self._cv.notify()

    # ------------------------------------------------------------------ the engine thread
    def _run(self) -> None:
        while not self._stopped:
            with self._cv:
                if not self._inbox and not self.engine.has_unfinished():
                    self._cv.wait(0.5)
                inbox, self._inbox = self._inbox, []
            for kind, item in inbox:
                self._handle(kind, item)
            if self.engine.has_unfinished():
                try:
                    outputs = self.engine.step()
                except Exception as e:  # noqa: BLE001 - fail the batch, keep serving
                    log.exception("prefill step failed")
                    self._fail_all(e)
                    continue
                self.steps += 1
                for out in outputs:
                    self._on_output(out)

    def _handle(self, kind: str, item) -> None:
        if kind == "add":
            job: PrefillJob = item
            r = job.request
            try:
                self.engine.add_request(r.request_id, list(r.prompt_token_ids), r.params, prefill_only=True,
                                        continuation=r.continuation)
            except (TandemError, TypeError, ValueError) as e:
                job.future.set_exception(e)
                return
            self._jobs[r.request_id] = job
            self.prompt_tokens_waiting += len(r.prompt_token_ids)
        elif kind == "cancel":
            job = self._jobs.pop(item, None)
            if job is not None:
                self.engine.abort(item)
                self.prompt_tokens_waiting -= len(job.request.prompt_token_ids)
                job.future.cancel()
        elif kind == "release":
            self.engine.release(item)
        elif kind == "stop":
            self._stopped = True

    def _on_output(self, out) -> None:
        job = self._jobs.pop(out.request_id, None)
        if job is None:
            return  # cancelled meanwhile; the abort already freed it
        self.prompt_tokens_waiting -= len(job.request.prompt_token_ids)
        if out.error is not None:  # its grammar did not compile (the engine freed its blocks): a 400
            if job.future.set_running_or_notify_cancel():
                job.future.set_exception(out.error)
            return
        m = out.metrics
        queue_s = (m.first_scheduled_time or job.submitted) - job.submitted
        prefill_s = (m.first_token_time or time.monotonic()) - (m.first_scheduled_time or job.submitted)
        logprobs = [(lp.token_id, lp.logprob, lp.top) for lp in out.logprobs] if out.logprobs else []
        prompt_logprobs = [None if lp is None else (lp.token_id, lp.logprob, lp.top)
                           for lp in out.prompt_logprobs or ()]
        # A continuation's output starts with what it had streamed before: the router wants only what follows.
        done = len(job.request.continuation.output_token_ids) if job.request.continuation is not None else 0
        handover = None if out.finished else self.engine.take_handover(out.request_id)
        result = PrefillResult(out.request_id, list(out.token_ids[done:]), out.finished, out.finish_reason,
                               logprobs[done:], queue_s, prefill_s, prompt_logprobs,
                               None if handover is None else handover.request.seed)
        if handover is not None:
            job.handed_over = self.sender.submit(handover, job.target)
        elif out.finished:
            self.finished_here += 1
        if not job.future.set_running_or_notify_cancel():
            return
        job.future.set_result(result)

    def _fail_all(self, error: Exception) -> None:
        for rid, job in list(self._jobs.items()):
            self.engine.abort(rid)
            if job.future.set_running_or_notify_cancel():
                job.future.set_exception(error)
        self._jobs.clear()
        self.prompt_tokens_waiting = 0
