"""Continuous batching: FCFS admission, a per-step token budget, chunked prefill, prefill and decode
in the same step, a cap on running requests, and preemption by recompute when blocks run out.

A request whose grammar still compiles (`grammar_ready` False) runs its prompt but not the chunk that
would sample: its last prompt token waits for the grammar (the compile overlaps the prompt's forward).

schedule() decides, for each request, how many of its not-yet-computed tokens run this step; the
model runner computes them and the engine then advances `num_computed_tokens`. A request samples
when its computed tokens reach its total (the end of its prompt, or its newest token). With
speculation, a request's drafts extend its tokens to compute (the engine rewinds the rejected ones),
and a request that samples also holds `num_lookahead_slots` KV slots for the draft chain.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from engine.core.block_manager import BlockManager
from engine.core.prefix_cache import DEFER, PrefixCache
from engine.core.request import Request, RequestStatus


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # tokens computed this step, starting at request.num_computed_tokens + ahead
    sample: bool  # this step produces the request's next token
    # Overlapped scheduling (engine/runner/overlap.py): this step was planned while the step before it still ran,
    # relative to the host's state then (valid until that step's outputs are applied). ahead: that step's
    # rows of this request (computed before this step's rows, counted as if all its drafts are accepted);
    # carried: that step samples this request, so this step's inputs (its new token and drafts) are that
    # step's outputs, gathered on the device, and its positions move back by the drafts that step
    # rejects; emitted_max: the most tokens that step can emit for it.
    ahead: int = 0
    carried: bool = False
    emitted_max: int = 0

    @property
    def start(self) -> int:
        """First position this step computes (optimistic while the step before is in flight)."""
        return self.request.num_computed_tokens + self.ahead

    @property
    def num_tokens(self) -> int:
        """The request's tokens before this step's drafts (optimistic while the step before is in flight)."""
        return self.request.num_tokens + self.emitted_max


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    preempted: list[Request]
    num_batched_tokens: int

    @property
    def empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_chunked_prefill: bool = True, num_lookahead_slots: int = 0,
                 prefix_cache: PrefixCache | None = None):
        self.blocks = block_manager
        self.prefix_cache = prefix_cache  # None: every prompt computed from its first token
        self.num_lookahead_slots = num_lookahead_slots
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        self.waiting.append(req)

    def add_running(self, req: Request) -> None:
        """A request whose KV already exists (a received hand-over) joins the running batch."""
        req.status = RequestStatus.RUNNING
        self.running.append(req)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def remove(self, req: Request) -> None:
        """Take a request out of the queues (finished, aborted or parked); its blocks stay with the caller
        (the engine frees them on finish and keeps them for a parked request's hand-over)."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)

    def schedule(self, inflight: dict[str, tuple[int, bool, int]] | None = None,
                 drafts_for=None) -> SchedulerOutput | None:
        """This step's rows per request. `inflight`: request id -> (rows, samples, drafts verified) of a step
        still running when this one is planned (engine/runner/overlap.py); then nothing is preempted and
        None says that only a step planned after reading it can go on. A request the running step samples
        continues with 1 + `drafts_for(req, emitted_max)` rows, at positions that assume every draft of
        the running step is accepted; its KV is held for that case. Without a running step, a request
        whose KV does not fit preempts the newest running ones (itself last)."""
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []
        now = time.monotonic()
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            i += 1
            prev = inflight.get(req.request_id) if inflight else None
            s = self._plan(req, budget, prev, drafts_for)
            if s is None:
                continue
            if not self.blocks.allocate(req.request_id, self.slots_needed(req, s.num_new_tokens, s.ahead, s.emitted_max)):
                if inflight is not None:
                    return None
                if not self._preempt_for(req, s.num_new_tokens, preempted):
                    break
            self._first_scheduled(req, now)
            scheduled.append(s)
            budget -= s.num_new_tokens
        # New requests only when nobody had to give way this step (FCFS: no overtaking).
        if not preempted:
            budget = self._admit(scheduled, budget, now)
        return SchedulerOutput(scheduled, preempted, self.max_num_batched_tokens - budget)

    def _plan(self, req: Request, budget: int, prev: tuple[int, bool, int] | None, drafts_for) -> ScheduledRequest | None:
        """A running request's rows this step (None: none); `prev`: its rows in the step in flight."""
        if prev is None:  # not in a running step: the host knows its state
            n = self._until_grammar(req, min(self._uncomputed(req), budget))
            return ScheduledRequest(req, n, sample=req.num_computed_tokens + n >= req.num_tokens) if n > 0 else None
        ahead, sampled, num_drafts = prev
        if sampled:
            emitted = num_drafts + 1
            return ScheduledRequest(req, min(1 + drafts_for(req, emitted), budget), True, ahead, True, emitted)
        # mid-prompt: the next chunk, known on the host
        n = self._until_grammar(req, min(req.num_tokens - req.num_computed_tokens - ahead, budget), ahead)
        if n <= 0:
            return None
        return ScheduledRequest(req, n, req.num_computed_tokens + ahead + n >= req.num_tokens, ahead)

    def _preempt_for(self, req: Request, n: int, preempted: list[Request]) -> bool:
        """The newest running requests give way until `req`'s n tokens fit; False when `req` itself had to."""
        while True:
            victim = self.running.pop()
            self._preempt(victim)
            preempted.append(victim)
            if victim is req:
                return False
            if self.blocks.allocate(req.request_id, self.slots_needed(req, n)):
                return True

    def _admit(self, scheduled: list[ScheduledRequest], budget: int, now: float) -> int:
        """Waiting requests join in arrival order while budget, seats and blocks last; -> the budget left.
        A request held back for its grammar lets the ones behind it pass."""
        j = 0
        while j < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[j]
            reused = self.prefix_cache.admit(req) if self.prefix_cache is not None else 0
            if reused == DEFER:  # a running request is computing its prefix: admitted later, as a hit
                j += 1
                continue
            remaining = req.num_tokens - req.num_computed_tokens
            n = self._until_grammar(req, min(remaining, budget))
            if n <= 0 or (n < remaining and not self.enable_chunked_prefill and not req.grammar_ready):
                j += 1  # it keeps the cached blocks it found: it runs from there once its grammar is in
                continue
            if (n < remaining and not self.enable_chunked_prefill) or \
                    not self.blocks.allocate(req.request_id, self.slots_needed(req, n)):
                if reused:  # it waits holding nothing, and looks its prefix up again when it is admitted
                    self.prefix_cache.cancel(req, reused)
                break
            del self.waiting[j]
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self._first_scheduled(req, now)
            scheduled.append(ScheduledRequest(req, n, sample=req.num_computed_tokens + n >= req.num_tokens))
            budget -= n
        return budget

    @staticmethod
    def _uncomputed(req: Request) -> int:
        """A running request's tokens (and drafts) not computed yet."""
        return req.num_tokens + len(req.spec_token_ids) - req.num_computed_tokens

    @staticmethod
    def _until_grammar(req: Request, n: int, ahead: int = 0) -> int:
        """`n` cut so that a request whose grammar is not compiled yet does not sample this step."""
        start = req.num_computed_tokens + ahead
        if req.grammar_ready or start + n < req.num_tokens:
            return n
        return req.num_tokens - 1 - start

    def slots_needed(self, req: Request, n: int, ahead: int = 0, emitted: int = 0) -> int:
        """KV slots a request holds to compute n tokens after its computed ones (and `ahead` more, of
        which `emitted` are its own sampled tokens), with the draft chain's lookahead when it samples."""
        end = req.num_computed_tokens + ahead + n
        if end < req.num_tokens + emitted or not self.num_lookahead_slots:
            return end
        return max(end, min(end + self.num_lookahead_slots, req.max_total_tokens))

    @staticmethod
    def _first_scheduled(req: Request, now: float) -> None:
        if req.metrics.first_scheduled_time is None:
            req.metrics.first_scheduled_time = now

    def _preempt(self, req: Request) -> None:
        """Recompute later: drop the KV, keep the tokens (prompt and output so far)."""
        if self.prefix_cache is not None:
            self.prefix_cache.forget(req)
        self.blocks.free(req.request_id)
        req.num_computed_tokens = req.num_cached_blocks = 0
        req.draft_holes_from = None  # recomputed from its prompt, whose rows always fill the head's KV
        req.spec_token_ids = []  # the recomputed prompt's last chunk samples anew, then drafts anew
        req.status = RequestStatus.WAITING
        req.metrics.num_preemptions += 1
        self.waiting.appendleft(req)
