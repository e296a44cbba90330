"""DecodeController: the decode replica's bookkeeping between lockstep steps (no Ray, no threads).

Each request it serves goes EXPECTED (its stream is open, its hand-over is on the way) -> RESERVING
(every rank has the header; blocks are reserved and the payload is coming) -> RUNNING (committed on
every rank; its tokens flow to its stream). A rank reserves a header's blocks itself, from its hand-over
stock, when it can ("reserved"), else parks it ("arrived"); only if some rank parked it does the request
get a lockstep RESERVE (on all its ranks, so that their pools change alike: decode_worker/stock.py). The controller turns the ranks' step reports into the
next step's work for each rank (a RankStep: its commands, and whether the group runs a forward) and the
per-request stream events. A request is placed on ranks (under tensor parallelism: every rank, and rank 0
reports its tokens; under attention data parallelism: the one rank that owns its KV, chosen by load);
its commands go to those ranks only, and every rank gets a RankStep each step, with or without commands
of its own, so that the ranks step in lockstep. A request whose client went away is dropped
before its blocks exist, or aborted after its payload landed (never while a payload is being written
into its blocks, which could by then belong to someone else).
"""
from __future__ import annotations

import asyncio
import enum
import random
import time
from dataclasses import dataclass, field

from cluster.protocol import Command, CommandKind, PrefillRequest, RankStep, StepReport, StreamError, TokenDelta
from cluster.protocol.block_filter import BlockFilter, union
from engine.core.prefix_hash import reusable_prompt_hashes

Placement = tuple[int, ...]  # the ranks that hold a request, in order; the first reports its tokens


class Phase(enum.Enum):
    EXPECTED = "expected"
    RESERVING = "reserving"
    RUNNING = "running"


@dataclass(slots=True, eq=False)
class Tracked:
    request_id: str
    sink: asyncio.Queue  # TokenDelta | StreamError items
    deadline: float  # for the header to reach every rank
    ranks: Placement
    prompt_blocks: int = 0  # KV blocks its prompt will take (the placement's estimate before it lands)
    phase: Phase = Phase.EXPECTED
    arrived: set[int] = field(default_factory=set)  # ranks that parked its header
    reserved: set[int] = field(default_factory=set)  # ranks that reserved from their stock
    landed: set[int] = field(default_factory=set)
    failed: set[int] = field(default_factory=set)  # ranks whose payload transfer broke
    cancelled: bool = False
    handover_seconds: float = 0.0  # payload receive time of the slowest rank
    unpack_seconds: float = 0.0
    handover_bytes: int = 0  # over all ranks
    local: bool = False  # admitted to prefill here (ADMIT), not handed over
    seed: int | None = None  # a local request's sampling seed


# How a rank reports an ADMIT the engine refused as a bad request (a 400 for the client, not a worker failure).
ADMIT_REFUSED = "refused: "

# ADP placement by prefix: the rank holding a prompt's blocks gets it unless it is this share of its KV pool
# busier than the least loaded rank (a popular prefix must not pile every request onto one rank).
IMBALANCE_SHARE = 0.25


@dataclass(frozen=True, slots=True)
class RankLoad:
    """One rank's load as its last StepReport gave it."""
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    num_running: int = 0


class DecodeController:
    def __init__(self, tp_size: int, handover_timeout_s: float = 60.0, attention_dp: bool = False):
        """attention_dp: each request lives on one rank (least loaded), not on all of them."""
        self.tp_size = tp_size
        self.handover_timeout_s = handover_timeout_s
        self.attention_dp = attention_dp
        self.requests: dict[str, Tracked] = {}
        self._commands: list[list[Command]] = [[] for _ in range(tp_size)]  # per rank, for the next step
        self.rank_loads = [RankLoad() for _ in range(tp_size)]
        # ADP: what each rank's prefix cache holds (block size, hash namespace model, filter), from its reports
        self.rank_views: list[tuple[int, str, BlockFilter] | None] = [None] * tp_size
        self._group_view: tuple[int, str, bytes] | None = None  # their union, until a rank sends a new view
        self.placed_for_prefix = 0  # ADP placements that went to a rank for the prompt blocks it holds
        self.placed_total = [0] * tp_size  # requests placed on each rank since the controller started
        self.kv_blocks_used = 0  # over the group (each block counted once: under TP every rank holds a slice)
        self.kv_blocks_total = 0
        self.num_running = 0
        self.grammar_stats: dict[str, int] = {}  # the lead rank's engine: compiles, cache hits, deserializations
        self.overlapped_steps = 0  # the lead rank's engine steps launched ahead (async scheduling)
        self.handovers: list[tuple[float, float, int]] = []  # recent (receive s, unpack s, bytes) per request
        self.handovers_total = 0
        self.handovers_stocked = 0  # of those, reserved from the ranks' stocks (no lockstep RESERVE)
        self.handovers_committed_on_landing = 0  # of those, committed by a one-rank group itself (no COMMIT wait)
        self.handover_blocks_reused = 0  # prompt blocks reserved hand-overs did not carry (the ranks held them: PIN)
        self.local_prefills = 0  # requests the group prefilled itself (ADMIT: the prefix was here)
        self.local_prefill_tokens = 0  # the uncached remainders they computed (as the placement estimated them)
        self._seeds = random.Random()

    # ------------------------------------------------------------------ from streams
    def expect(self, request_id: str, sink: asyncio.Queue, prompt_blocks: int = 0,
               prompt: tuple[tuple[int, ...], str | None] | None = None,
               admit: tuple[PrefillRequest, int] | None = None) -> Placement:
        """A stream opened: track the request and place it. prompt_blocks: the KV blocks its prompt needs
        (the router knows the prompt's length), so that requests placed between two reports spread out.
        prompt: (token ids, cache salt): its ranks PIN the leading blocks of it they hold (the prefill asks
        them how many before it packs the payload: DecodeRank.pinned).
        admit: (the request, the most uncached tokens the group prefills itself): when the placed ranks hold
        the prompt's leading blocks and at most that many of its tokens are not cached, the group prefills it
        (an ADMIT: conditional disaggregation, Dynamo's name) and no hand-over comes; `Tracked.local` says so.
        The estimate is the ranks' last prefix views (a Bloom filter, up to 0.5 s old): blocks evicted since, or
        a false positive, only make the group compute more of the prompt, never a wrong token."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already being decoded")
        held = [0] * self.tp_size
        if prompt is not None and (self.attention_dp or admit is not None):  # hashing the prompt costs a little
            held = self._held_blocks(prompt)
        ranks = self._place(prompt_blocks, held)
        for r in ranks:
            self.placed_total[r] += 1
        t = Tracked(request_id, sink, time.monotonic() + self.handover_timeout_s, ranks, prompt_blocks)
        self.requests[request_id] = t
        remainder = self._local_remainder(ranks[0], len(prompt[0]), held, admit) if prompt is not None else None
        if remainder is not None:
            request = admit[0]
            t.local, t.phase = True, Phase.RUNNING
            t.seed = _seed_of(request, self._seeds)
            self.local_prefills += 1
            self.local_prefill_tokens += remainder
            for rank in ranks:
                self._commands[rank].append(Command(CommandKind.ADMIT, request_id, admit=request, seed=t.seed))
        elif prompt is not None:
            for rank in ranks:
                self._commands[rank].append(Command(CommandKind.PIN, request_id, tuple(prompt[0]), prompt[1]))
        return ranks

    def _local_remainder(self, lead: int, known: int, held: list[int],
                         admit: tuple[PrefillRequest, int] | None) -> int | None:
        """Of the `known` tokens (prompt and continuation), those the group would compute itself if it admitted
        `admit` with `lead` as its lead rank, or None when it should not: nothing of the prompt is held there (a
        prompt is disaggregated unless its prefix is here: that is what keeps long prefills off the decode
        step), or more than the allowed remainder is missing."""
        if admit is None or not held[lead]:
            return None
        remainder = known - held[lead] * self.rank_views[lead][0]
        return remainder if remainder <= admit[1] else None

    def _place(self, prompt_blocks: int, held: list[int]) -> Placement:
        """Under TP every rank holds every request (its KV-head slice) and rank 0 reports the tokens all
        ranks compute. Under ADP one rank holds it: the least loaded, counting against a rank twice each
        leading prompt block it holds already (a held block takes no new memory and is not sent: the prefill
        router's rule, router/policy.py rank_prefill), unless that rank is already busier than the
        least loaded by more than IMBALANCE_SHARE of its pool; ties: fewest requests (TensorRT-LLM's ADP
        router orders ranks by active tokens, then active requests), then rank. A rank's load is its last
        report plus what was placed on it since and has not landed yet, so a burst between two steps spreads.
        held: per rank, the prompt's leading blocks its prefix view holds."""
        if not self.attention_dp:
            return tuple(range(self.tp_size))
        blocks = [load.kv_blocks_used for load in self.rank_loads]
        count = [load.num_running for load in self.rank_loads]
        for t in self.requests.values():
            if t.phase is Phase.EXPECTED:  # its blocks are not reserved yet (RESERVING ones are in the report)
                blocks[t.ranks[0]] += t.prompt_blocks
            if t.phase is not Phase.RUNNING:
                count[t.ranks[0]] += 1
        ranks = range(self.tp_size)
        least = min(ranks, key=lambda r: (blocks[r], count[r], r))
        best = min(ranks, key=lambda r: (blocks[r] - 2 * held[r], count[r], r))
        total = self.rank_loads[best].kv_blocks_total
        if best != least and blocks[best] - blocks[least] <= IMBALANCE_SHARE * total:
            self.placed_for_prefix += 1
            return (best,)
        return (least,)

    def group_view(self) -> tuple[int, str, bytes]:
        """What the group's prefix caches hold, for the router: (block size, hash namespace model, filter
        bits), the union of its ranks' views (under TP rank 0's, which holds what every rank holds). Serve
        polls it twice a second; it is rebuilt only after a rank sent a new view."""
        if self._group_view is None:
            views = [v for v in self.rank_views if v is not None and v[0]]
            self._group_view = ((views[0][0], views[0][1], union([v[2].bits for v in views])) if views
                                else (0, "", b""))
        return self._group_view

    def _held_blocks(self, prompt: tuple[tuple[int, ...], str | None]) -> list[int]:
        """Per rank: how many of the prompt's leading blocks its last prefix view holds (0 without one)."""
        tokens, salt = prompt
        held, hashes = [], {}
        for view in self.rank_views:
            if view is None or not view[0] or not view[2].bits:
                held.append(0)
                continue
            block_size, model, filt = view
            key = (block_size, model)
            if key not in hashes:  # the ranks share one engine config: hashed once
                hashes[key] = reusable_prompt_hashes(tokens, block_size, model, salt)
            held.append(filt.leading_matches(hashes[key]))
        return held

    def cancel(self, request_id: str) -> None:
        """The stream is gone (client disconnect, stop string, prefill failure)."""
        t = self.requests.get(request_id)
        if t is None:
            return
        if t.phase is Phase.EXPECTED:
            del self.requests[request_id]
            self._send(CommandKind.DROP, t)
        elif t.phase is Phase.RESERVING:
            t.cancelled = True  # aborted once the payload has landed (or failed)
        else:
            del self.requests[request_id]
            self._send(CommandKind.ABORT, t)

    # ------------------------------------------------------------------ the step loop
    @property
    def has_work(self) -> bool:
        return bool(self.requests) or any(self._commands)

    @property
    def decoding(self) -> bool:
        return self.num_running > 0

    def next_step(self, now: float | None = None) -> list[RankStep]:
        """One RankStep per rank, in rank order (a rank without commands still steps with the group)."""
        now = time.monotonic() if now is None else now
        for t in list(self.requests.values()):
            if t.phase is Phase.EXPECTED and now > t.deadline:
                self._fail(t, f"the hand-over did not reach the decode group within {self.handover_timeout_s:.0f}s",
                           CommandKind.DROP)
        running = [t for t in self.requests.values() if t.phase is Phase.RUNNING]
        reporters = {t.ranks[0] for t in running}
        steps = [RankStep(tuple(commands), forward=bool(running), reports_tokens=rank in reporters)
                 for rank, commands in enumerate(self._commands)]
        self._commands = [[] for _ in range(self.tp_size)]
        return steps

    def on_reports(self, reports: list[StepReport]) -> None:
        self.rank_loads = [RankLoad(r.kv_blocks_used, r.kv_blocks_total, r.num_running) for r in reports]
        for r, rep in enumerate(reports):
            if rep.prefix_view is not None:
                self.rank_views[r] = (rep.prefix_view[0], rep.prefix_view[1], BlockFilter(rep.prefix_view[2]))
                self._group_view = None
        self.overlapped_steps = reports[0].overlapped_steps
        if self.attention_dp:  # each rank holds its own requests and blocks, and deserializes its own grammars
            self.kv_blocks_used = sum(r.kv_blocks_used for r in reports)
            self.kv_blocks_total = sum(r.kv_blocks_total for r in reports)
            self.num_running = sum(r.num_running for r in reports)
            grammar: dict[str, int] = {}
            for r in reports:
                for event, n in r.grammar:
                    grammar[event] = grammar.get(event, 0) + n
            self.grammar_stats = grammar
        else:
            lead = reports[0]  # under TP every rank holds the same requests and blocks
            self.kv_blocks_used, self.kv_blocks_total = lead.kv_blocks_used, lead.kv_blocks_total
            self.num_running = lead.num_running
            self.grammar_stats = dict(lead.grammar)
        for rep in reports:
            self.handovers_committed_on_landing += rep.committed_on_landing
            for rid, reused in rep.reused:
                t = self.requests.get(rid)
                if t is not None and rep.tp_rank == t.ranks[0]:  # under TP every rank reserved alike
                    self.handover_blocks_reused += reused
            for rid, reason in rep.failed:
                self._on_failed(rid, rep.tp_rank, reason)
            for rid in rep.arrived:
                self._on_arrived(rid, rep.tp_rank)
            for rid in rep.reserved:
                self._on_arrived(rid, rep.tp_rank, stocked=True)
            for rid in rep.deferred:
                t = self.requests.get(rid)
                if t is not None and rep.tp_rank == t.ranks[0]:
                    t.phase = Phase.EXPECTED  # no free blocks now (on any rank): ask again after the next step
            for rid, seconds, unpack, nbytes in rep.handover_seconds:
                t = self.requests.get(rid)
                if t is not None:
                    t.handover_seconds = max(t.handover_seconds, seconds)
                    t.unpack_seconds = max(t.unpack_seconds, unpack)
                    t.handover_bytes += nbytes
            for rid in rep.landed:
                self._on_landed(rid, rep.tp_rank)
        # Tokens after the hand-over events: a one-rank group commits a request on landing, so one report
        # can carry its landing and its first tokens, which only a RUNNING request delivers.
        for rep in reports:
            for d in rep.deltas:
                self._deliver(d, rep.tp_rank)
        for t in list(self.requests.values()):
            if t.phase is Phase.EXPECTED and (t.arrived | t.reserved).issuperset(t.ranks):
                if t.cancelled:
                    del self.requests[t.request_id]
                    self._send(CommandKind.DROP, t)
                else:
                    t.phase = Phase.RESERVING
                    if t.arrived:  # some rank parked it: every rank reserves in lockstep
                        self._send(CommandKind.RESERVE, t)

    def fail_all(self, message: str) -> None:
        """The group died: every stream ends with an error; the next group starts clean."""
        for t in list(self.requests.values()):
            t.sink.put_nowait(StreamError(message))
        self.requests.clear()
        self._commands = [[] for _ in range(self.tp_size)]
        self.num_running = 0
        self.kv_blocks_used = 0
        self.rank_loads = [RankLoad() for _ in range(self.tp_size)]
        self.rank_views = [None] * self.tp_size  # a new group's caches start empty
        self._group_view = None

    # ------------------------------------------------------------------ internals
    def _on_arrived(self, rid: str, rank: int, stocked: bool = False) -> None:
        t = self.requests.get(rid)
        if t is None or t.phase is not Phase.EXPECTED:
            # Nobody waits for it any more. Where the other ranks' copies are is unknown (it is not tracked):
            # every rank drops it, which is a no-op on a rank that never got it.
            self._send(CommandKind.DROP, rid, range(self.tp_size))
            return
        (t.reserved if stocked else t.arrived).add(rank)

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
        if t.local:  # its ADMIT failed on that rank: nothing was sent yet; every rank of it drops what it has
            refused = reason.startswith(ADMIT_REFUSED)
            t.sink.put_nowait(StreamError(f"the decode group could not admit the request: {reason}",
                                          *(("invalid_request_error", 400) if refused else ())))
            self.requests.pop(rid, None)
            self._send(CommandKind.ABORT, t)
            return
        if t.phase is Phase.EXPECTED:  # no blocks yet: refuse the header wherever it is parked
            self._fail(t, f"hand-over failed on rank {rank}: {reason}", CommandKind.DROP)
            return
        if not t.cancelled:
            t.sink.put_nowait(StreamError(f"hand-over failed on rank {rank}: {reason}"))
        t.cancelled = True
        t.failed.add(rank)
        self._settle(t)

    def _settle(self, t: Tracked) -> None:
        """Once every rank's payload has landed or failed, commit, or abort (which frees the blocks)."""
        if not (t.landed | t.failed).issuperset(t.ranks):
            return
        if t.cancelled:
            del self.requests[t.request_id]
            self._send(CommandKind.ABORT, t)
            return
        self.handovers.append((t.handover_seconds, t.unpack_seconds, t.handover_bytes))
        self.handovers_total += 1
        self.handovers_stocked += not t.arrived
        del self.handovers[:-512]
        t.phase = Phase.RUNNING
        self._send(CommandKind.COMMIT, t)

    def _deliver(self, delta: TokenDelta, rank: int) -> None:
        t = self.requests.get(delta.request_id)
        if t is None or t.phase is not Phase.RUNNING or rank != t.ranks[0]:
            return
        t.sink.put_nowait(delta)
        if delta.finished:
            del self.requests[delta.request_id]

    def _fail(self, t: Tracked, message: str, kind: CommandKind) -> None:
        t.sink.put_nowait(StreamError(message))
        self.requests.pop(t.request_id, None)
        self._send(kind, t)

    def _send(self, kind: CommandKind, t: Tracked | str, ranks=None) -> None:
        """Queue a command for the next step on the ranks that hold the request (or `ranks`)."""
        rid = t if isinstance(t, str) else t.request_id
        for rank in (t.ranks if ranks is None else ranks):
            self._commands[rank].append(Command(kind, rid))


def _seed_of(request: PrefillRequest, draw: random.Random) -> int:
    """The seed a locally prefilled request samples with: a continuation's, the request's own, else one drawn
    here (as a prefill replica would draw it), the same for every rank of the group."""
    if request.continuation is not None:
        return request.continuation.seed
    return request.params.seed if request.params.seed is not None else draw.getrandbits(63)
