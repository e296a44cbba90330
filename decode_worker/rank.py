"""DecodeRank: one rank of a decode group (a tensor-parallel shard, or under attention data parallelism
the owner of its own requests with the MLP sharded over the group), as a Ray actor.

The rank holds an LLMEngine built with (tp_size, tp_rank, tp_group) and the receiving ends of its
hand-over channels. Its state changes only inside `step`, which applies its RankStep's commands in order
and then takes part in the group's forward. Under tensor parallelism every rank gets the same commands,
so all of them hold the same requests and the same block tables and call the collectives of a step
together; only the rank told to report tokens turns the engine's outputs into TokenDeltas.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from datetime import timedelta

import ray
import torch

from cluster.channel import RECEIVER, open_channel
from cluster.faults import FaultPoints
from cluster.groups import backend_for, build_group
from cluster.prefix_view import PrefixView
from cluster.protocol import Command, CommandKind, KVLayout, RankStep, StepReport, TokenDelta
from cluster.protocol.load import prefix_cache_counts
from cluster.rendezvous import RENDEZVOUS_CONCURRENCY, StoreAddress, StoreServer, connect_store, node_ip
from cluster.settings import EngineSettings
from cluster.step_link import StepListener
from decode_worker.controller import ADMIT_REFUSED
from decode_worker.receiver import HandoverReceiver
from decode_worker.stock import HandoverStock
from decode_worker.turns import StepTurns
from engine import CapacityError, InvalidRequestError, LLMEngine, ModelConfig, TandemError
from engine.distributed import shm_collectives
from structured.request import SerializedGrammar

log = logging.getLogger(__name__)


class DecodeRank:
    """Created through `ray.remote(...)` by decode_worker.group with the rank's resources."""

    def __init__(self, settings: EngineSettings, tp_rank: int, tp_size: int, attention_dp: bool = False):
        if settings.torch_threads and settings.device == "cpu":
            torch.set_num_threads(settings.torch_threads)
        self.settings = settings
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.attention_dp = attention_dp and tp_size > 1
        self.server = StoreServer()
        self.engine: LLMEngine | None = None
        self.receiver: HandoverReceiver | None = None
        self.stock: HandoverStock | None = None
        self.tp_group = None
        self.tp_shm = None  # shared-memory collectives of a CPU group on one host
        self._sent: dict[str, int] = {}  # request id -> output tokens already reported
        self._turns = StepTurns()  # runs the group's steps in order (several may be queued here)
        self._committed_early: set[str] = set()  # committed on landing, the replica's COMMIT still to come
        self._reused: list[tuple[str, int]] = []  # this step's reserves: (request id, blocks its hand-over reused)
        # PIN answers for the prefill to read (`pinned`, on an actor thread): request id -> blocks held
        self._pin_cv = threading.Condition()
        self._pin_answers: dict[str, int] = {}
        self._pin_abandoned: set[str] = set()  # asked for and not answered in time: a late PIN pins nothing
        self._link: StepListener | None = None
        # Rebuilt at most twice a second: a decoding rank registers blocks at almost every step.
        self._view = PrefixView(min_interval_s=0.5)

    # ------------------------------------------------------------------ setup
    def address(self) -> StoreAddress:
        return self.server.address

    def pid(self) -> int:
        return os.getpid()

    def join(self, tp_store: StoreAddress, group_id: str, timeout_s: float = 120.0) -> KVLayout:
        """Build the TP group (rank 0's store is the rendezvous) and the engine shard."""
        # No rank keeps text: the router detokenizes the reporting rank's tokens and applies stop strings.
        cfg = self.settings.engine_config(tp_size=self.tp_size, tp_rank=self.tp_rank, detokenize=False,
                                          attention_dp=self.tp_size if self.attention_dp else 1,
                                          expert_parallel=getattr(self.settings, "expert_parallel", False))
        cpu_group = None
        if self.tp_size > 1:
            store = self.server.store if self.tp_rank == 0 else connect_store(tp_store, timeout_s)
            self.tp_group = build_group(store, f"tp/{group_id}/", self.tp_rank, self.tp_size,
                                        backend_for(cfg.device), timeout_s,
                                        idle_timeout=timedelta(seconds=timeout_s))
            if self.attention_dp and cfg.device != "cpu":
                # ADP's per-step agreement is a host-side all-gather: on GPUs it gets a gloo group of its own.
                cpu_group = build_group(store, f"adp/{group_id}/", self.tp_rank, self.tp_size, backend_for("cpu"),
                                        timeout_s, idle_timeout=timedelta(seconds=timeout_s))
            self.tp_shm = self._shm_collectives(cfg, store, group_id, timeout_s)
        self.engine = LLMEngine(cfg, tp_group=self.tp_group, cpu_group=cpu_group, tp_shm=self.tp_shm)
        share = getattr(self.settings, "handover_stock", 0.0)
        stocked = self.engine.blocks.set_aside(int(self.engine.blocks.pool.num_blocks * share)) if share else None
        self.stock = HandoverStock(stocked) if stocked else None
        self.receiver = HandoverReceiver(self.engine.kv_cache, self.settings.transfer_timeout_s, self.stock,
                                         FaultPoints(self.settings.fault_points), on_header=self._warm_grammar)
        # Cache layers: the target's, then the draft's when speculation shares the cache.
        return KVLayout.of(self.engine)

    def _shm_collectives(self, cfg, store, group_id: str, timeout_s: float):
        """Shared-memory collectives for a CPU group whose ranks share a host (engine/distributed/shm_collectives.py), or
        None (GPU, switched off, or the ranks cannot share a segment: gloo carries them)."""
        if cfg.device != "cpu" or not getattr(self.settings, "tp_shm", True):
            return None
        m = ModelConfig.from_dir(cfg.model)
        rows = cfg.max_num_seqs * (1 + (cfg.speculative.k if cfg.speculative else 0))
        if self.attention_dp:  # the MLP's row exchanges: every rank's rows, hidden wide (reduce-scatter input)
            rows, width = rows * self.tp_size, m.hidden_size
        else:  # all-reduces of hidden-wide rows and the vocab-parallel logits' gather
            width = max(m.hidden_size, -(-m.vocab_size // self.tp_size))
        return shm_collectives.connect(store, f"tp/{group_id}/", self.tp_rank, self.tp_size,
                                       shm_collectives.slot_bytes_for(rows, width), timeout_s)

    def accept(self, channel_id: str, timeout_s: float = 30.0) -> None:
        """The receiving end of a prefill's channel (the prefill calls `connect` at the same time)."""
        channel = open_channel(self.server.store, channel_id, RECEIVER, backend_for(self.engine.cfg.device),
                               timeout_s, self.settings.handover_transport)
        self.receiver.add_channel(channel)

    def open_step_link(self, token: bytes) -> tuple[str, int]:
        """Listen for the replica's step link (cluster/step_link.py): the group's steps come that way, not as
        Ray calls. -> the address to connect to, on this node's address (the one hand-overs reach)."""
        if self._link is not None:
            raise RuntimeError("this rank already has a step link")
        self._link = StepListener(node_ip(), token, self.step, name=f"step-link-rank{self.tp_rank}")
        return self._link.address

    # ------------------------------------------------------------------ the lockstep step
    def step(self, work: RankStep, wait_s: float = 0.0) -> StepReport:
        """Runs `work` once every earlier step of the group has run here. Steps come over the step link in
        order, the next one already waiting in its socket while this one runs (that is what keeps the rank
        busy while the replica turns the previous report into the next step); StepTurns keeps the order
        for anyone calling `step` directly too."""
        with self._turns.turn(work.seq):
            return self._step(work, wait_s)

    def _step(self, work: RankStep, wait_s: float) -> StepReport:
        start = time.perf_counter()
        eng = self.engine
        deferred: list[str] = []
        failed: list[tuple[str, str]] = []
        self._refill_stock()
        for cmd in work.commands:
            self._apply(cmd, deferred, failed)
        if not work.commands and not work.forward and not eng.has_unfinished() and wait_s > 0:
            self.receiver.wait_for_event(wait_s)  # long-poll: nothing to compute, wait for hand-overs
        early = self._commit_landed(failed) if self.tp_size == 1 and self.stock is not None else 0
        deltas = []
        # Under ADP every rank steps the engine every group step: the engine's own agreement (one all-gather)
        # decides whether anybody runs a forward, and a rank without rows runs the idle forward, so the
        # collectives match whatever this rank's view of the group is. Under TP every rank holds the same
        # requests: they are all idle at once, and an idle step has nothing to match.
        if eng.has_unfinished() or self.attention_dp:
            outputs = eng.step()
            # A one-rank group reports its tokens always: it may run requests it committed on landing
            # (_commit_landed) before the replica counts them as running.
            if work.reports_tokens or self.tp_size == 1:
                deltas = [self._delta(o) for o in outputs]
            else:
                for o in outputs:
                    if o.finished:
                        self._sent.pop(o.request_id, None)
        arrived, reserved, landed, broken, timings = self.receiver.take_events()
        stats = eng.stats()
        # Blocks waiting in the hand-over stock are free for the next hand-over, not in use.
        used = stats["kv_blocks_used"] - (self.stock.num_free if self.stock is not None else 0)
        return StepReport(
            tp_rank=self.tp_rank, deltas=tuple(d for d in deltas if d is not None), arrived=tuple(arrived),
            reserved=tuple(reserved), landed=tuple(landed), failed=tuple(failed + broken), deferred=tuple(deferred),
            kv_blocks_used=used, kv_blocks_total=stats["kv_blocks_total"],
            num_running=stats["num_running"], step_seconds=time.perf_counter() - start,
            handover_seconds=tuple(timings), grammar=tuple(stats.get("grammar", {}).items()),
            overlapped_steps=stats["overlapped_steps"], committed_on_landing=early,
            prefix_cache=prefix_cache_counts(stats), reused=self._take_reused(), prefix_view=self._prefix_view(eng, idle=stats["num_running"] == 0))

    def _prefix_view(self, eng, idle: bool) -> tuple[int, str, bytes] | None:
        """What this rank's prefix cache holds, when that changed: under ADP every rank's (the controller places
        requests by it), under TP rank 0's (every rank holds the same blocks); the router routes by the
        group's (DecodeLoad)."""
        if not self.attention_dp and self.tp_rank != 0:
            return None
        bits = self._view.changed(eng, force=idle)  # idle: no report may follow for a while
        if bits is None:
            return None
        pc = eng.prefix_cache
        return (0, "", b"") if pc is None else (pc.block_size, pc.model, bits)

    def _take_reused(self) -> tuple[tuple[str, int], ...]:
        reused, self._reused = tuple(self._reused), []
        return reused

    def pinned(self, request_id: str, timeout_s: float) -> int:
        """The prefill asks before packing a hand-over: how many leading prompt blocks this rank pinned for it
        (its PIN's answer). Waits for the PIN to be applied (the open queued it; the prefill's compute usually
        outlasts it); 0 after timeout_s, and a PIN applied later then pins nothing (the payload carries all)."""
        with self._pin_cv:
            if not self._pin_cv.wait_for(lambda: request_id in self._pin_answers, timeout_s):
                self._pin_abandoned.add(request_id)
                return 0
            return self._pin_answers.pop(request_id)

    def _answer_pin(self, request_id: str, held: int | None) -> None:
        """Record a PIN's answer for `pinned` (None: the request is reserved or gone, forget it)."""
        with self._pin_cv:
            if held is None:
                self._pin_answers.pop(request_id, None)
                self._pin_abandoned.discard(request_id)
            else:
                self._pin_answers[request_id] = held
                self._pin_cv.notify_all()

    def _apply(self, cmd: Command, deferred: list[str], failed: list[tuple[str, str]]) -> None:
        eng, rid = self.engine, cmd.request_id
        if cmd.kind is CommandKind.RESERVE:
            # Sent to every rank of the request when some rank parked its header. A rank whose blocks came
            # from the stock reserves all the same, so that every rank's pool changes alike; it swaps the
            # blocks at commit.
            header = self.receiver.header(rid)
            try:
                block_ids = eng.reserve(header.request, _compiled(header))
            except CapacityError:
                deferred.append(rid)
                return
            except TandemError as e:
                self.receiver.drop(rid)
                failed.append((rid, f"cannot reserve: {e}"))
                return
            self._sent[rid] = len(header.request.output_token_ids)
            self._reserved(rid, header)
            if not self.receiver.is_stocked(rid):
                self.receiver.provide_blocks(rid, block_ids)
        elif cmd.kind is CommandKind.COMMIT:
            if rid in self._committed_early:  # done when its payload landed (_commit_landed)
                self._committed_early.discard(rid)
                return
            self._commit(rid, failed)
        elif cmd.kind is CommandKind.ABORT:
            self._committed_early.discard(rid)
            eng.abort(rid)
            eng.handovers.unpin(rid)  # a prefix pinned for a hand-over that will not come
            self._answer_pin(rid, None)
            self.receiver.drop(rid)
        elif cmd.kind is CommandKind.PIN:
            with self._pin_cv:
                late = rid in self._pin_abandoned
            held = 0
            if not late:  # a late PIN would hold blocks nobody reserves or drops
                try:
                    held = eng.handovers.pin(rid, list(cmd.prompt_token_ids), cmd.cache_salt)
                except TandemError as e:  # its id is in use here (a replayed open): it reuses nothing
                    log.warning("cannot pin the prefix of %s: %s", rid, e)
            self._answer_pin(rid, held)
        elif cmd.kind is CommandKind.ADMIT:
            self._admit(cmd, failed)
        elif cmd.kind is CommandKind.DROP:
            if rid in self._committed_early:  # the replica no longer tracks it, but it runs here: end it
                self._committed_early.discard(rid)
                eng.abort(rid)
            eng.handovers.unpin(rid)
            self._answer_pin(rid, None)
            self.receiver.drop(rid)

    def _admit(self, cmd: Command, failed: list[tuple[str, str]]) -> None:
        """A request the group prefills itself (its prefix is cached here; decode_worker/controller.py): it joins
        the engine's queue as any new request, its prompt admitted at its longest cached prefix, the seed the
        replica chose for every rank."""
        r = cmd.admit
        try:
            self.engine.add_request(r.request_id, list(r.prompt_token_ids), r.params, continuation=r.continuation,
                                    seed=cmd.seed)
        except InvalidRequestError as e:
            failed.append((r.request_id, f"{ADMIT_REFUSED}{e}"))
            return
        except TandemError as e:
            failed.append((r.request_id, f"cannot admit: {e}"))
            return
        self._sent[r.request_id] = len(r.continuation.output_token_ids) if r.continuation is not None else 0

    def _commit(self, rid: str, failed: list[tuple[str, str]]) -> None:
        eng = self.engine
        if not self._adopt_stocked(rid, failed):
            return
        eng.commit(rid, drafts=self.receiver.take_drafts(rid))

    def _commit_landed(self, failed: list[tuple[str, str]]) -> int:
        """A one-rank group commits each stocked hand-over whose payload has landed at this step boundary,
        without waiting for the replica's COMMIT. That COMMIT comes two steps after the landing: the replica
        reads the report of the step the payload landed in while the next step is already queued here
        (steps_in_flight), which kept a new request out of ~2 steps (decode_worker/config.py). Nothing has to
        agree on the moment, as no other rank holds the request; the replica learns of it from the landing in
        this report or an earlier one, which it reads before this step's tokens, and its COMMIT is then a
        no-op here. Under tp > 1 every rank must commit in the same step, so the COMMIT decides."""
        landed = self.receiver.landed_in_stock()
        for rid in landed:
            self._committed_early.add(rid)  # also when the engine refuses it: the COMMIT must not retry it
            self._commit(rid, failed)
        return len(landed)

    def _adopt_stocked(self, rid: str, failed: list[tuple[str, str]]) -> bool:
        """At commit, a request whose KV landed in stock blocks gets them as its own: swapped for the blocks
        reserved in lockstep, or (no rank needed a lockstep reserve) adopted, the stock refilled from the
        engine's pool. False if the engine refuses the request (it then fails like a failed reserve)."""
        eng = self.engine
        taken = self.receiver.take_stocked(rid)
        if taken is None:
            return True
        header, stocked = taken
        if rid in eng.requests:  # reserved in lockstep: its KV is in the stock's blocks, not in these
            self.stock.give(eng.blocks.swap(rid, stocked, start=header.request.reused_blocks))
            return True
        try:
            eng.reserve(header.request, _compiled(header), block_ids=stocked)
        except TandemError as e:
            self.stock.give(stocked)
            self.receiver.drop(rid)
            failed.append((rid, f"cannot reserve: {e}"))
            return False
        self._sent[rid] = len(header.request.output_token_ids)
        self._reserved(rid, header)
        self.stock.owed += len(stocked)
        self._refill_stock()
        return True

    def _reserved(self, rid: str, header) -> None:
        self._reused.append((rid, header.request.reused_blocks))
        self._answer_pin(rid, None)

    def _refill_stock(self) -> None:
        """Top the stock up by what requests adopted from it, all or nothing (equal pools decide alike)."""
        if self.stock is not None and self.stock.owed:
            ids = self.engine.blocks.set_aside(self.stock.owed)
            if ids is not None:
                self.stock.give(ids)
                self.stock.owed = 0

    def _delta(self, out) -> TokenDelta | None:
        sent = self._sent.get(out.request_id)
        if sent is None:  # not a request this group is serving any more
            return None
        new = out.token_ids[sent:]
        if out.finished:
            del self._sent[out.request_id]
        else:
            self._sent[out.request_id] = len(out.token_ids)
        logprobs = ()
        if out.logprobs is not None:
            logprobs = tuple((lp.token_id, lp.logprob, lp.top) for lp in out.logprobs[sent:])
        return TokenDelta(out.request_id, tuple(new), out.finished, out.finish_reason, logprobs,
                          out.speculative if out.finished else None)

    def _warm_grammar(self, header) -> None:
        """The header's compiled grammar loaded on the channel thread, not at reserve on the step thread."""
        self.engine.warm_grammar(header.request.params.structured_output, _compiled(header))

    def kv_blocks(self, request_id: str):
        """[L, P, n, S, local heads, D] copy of a request's KV blocks (P planes: 2 for K and V, 1 for MLA's
        latent; for checks, not on the hot path)."""
        table = self.engine.blocks.table(request_id)
        return self.engine.kv_cache.index_select(2, torch.tensor(table, dtype=torch.long)).clone()

    def shutdown(self) -> None:
        if self._link is not None:
            self._link.close()
        if self.receiver is not None:
            self.receiver.close()


def _compiled(header) -> SerializedGrammar | None:
    return header.grammar.serialized if header.grammar is not None else None


def rank_actor_class(num_cpus: float, num_gpus: float):
    """The DecodeRank actor class with a rank's resources. Ray threads: start-up, channel accepts, pings (the
    steps run on the step link's own thread), and apart from them its peers' calls into the rank's rendezvous
    store (cluster/rendezvous.py)."""
    return ray.remote(num_cpus=num_cpus, num_gpus=num_gpus, max_concurrency=16,
                      concurrency_groups=RENDEZVOUS_CONCURRENCY)(DecodeRank)
