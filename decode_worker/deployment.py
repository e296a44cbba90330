"""DecodeServer: the decode Serve deployment. A replica owns one RankGroup (a placement group of
`tp` DecodeRank actors), runs the lockstep step loop and fans each step's tokens out to per-request
streams. If the group dies, in-flight streams end with an error and the replica builds a new group.

`generate` is a streaming method: its first item is the DecodeTarget the prefill must send to, then
lists of TokenDelta (everything that arrived since the previous item), or a StreamError at the end.
"""
from __future__ import annotations

import asyncio
import logging
import time

from cluster.errors import WorkerDiedError
from cluster.placement import RankResources
from cluster.protocol import StreamError, TokenDelta
from cluster.runtime import replica_id
from decode_worker.callers import CallerWatch
from decode_worker.config import DecodeConfig
from decode_worker.controller import DecodeController
from decode_worker.group import GroupSpec, RankGroup

log = logging.getLogger(__name__)

IDLE_POLL_S = 0.05  # long-poll of the ranks while hand-overs are expected and nothing decodes
PING_TIMEOUT_S = 5.0  # an idle group's liveness probe, well inside Serve's health-check timeout


def group_spec(c: DecodeConfig) -> GroupSpec:
    """The rank group a replica builds (and rebuilds): its size, mode and each rank's bundle."""
    resources = RankResources(num_cpus=c.rank_num_cpus, num_gpus=c.rank_gpus(), custom=dict(c.rank_resources))
    return GroupSpec(engine=c, tp_size=c.tp, resources=resources, attention_dp=c.attention_dp > 1,
                     step_timeout_s=c.step_timeout_s)


class DecodeServer:
    async def __init__(self, config: DecodeConfig | dict):
        self.config = config if isinstance(config, DecodeConfig) else DecodeConfig(**config)
        c = self.config
        self.spec = group_spec(c)
        self.ctrl = DecodeController(c.tp, c.handover_timeout_s, attention_dp=self.spec.attention_dp)
        self.group: RankGroup = await RankGroup.start(self.spec)
        self.groups_started = 1
        self._wake = asyncio.Event()
        self._steps = 0
        self._step_seconds = 0.0  # inside the ranks (engine + commands), summed over steps
        self._last_error: str | None = None
        self._lost: str | None = None  # an idle group found dead by check_health; the loop rebuilds it
        self._loop = asyncio.create_task(self._run())
        self._sinks: dict[str, asyncio.Queue] = {}  # open streams, for ending those whose router died
        self.callers = CallerWatch(self._caller_died)
        self._watch = asyncio.create_task(self.callers.run())

    # ------------------------------------------------------------------ the stream of one request
    async def generate(self, request_id: str, num_prompt_tokens: int = 0, caller: str | None = None):
        """Yields the DecodeTarget (the ranks the request is placed on), then lists of TokenDelta, or a
        StreamError; cancel to abort. num_prompt_tokens: the prompt's length (it weighs the placement);
        caller: the Serve actor name of the router reading the stream (its death ends the stream)."""
        group = await self._current_group(self.config.handover_timeout_s)
        if group is None:
            yield StreamError(f"the decode group is restarting after a failure ({self._last_error}); retry")
            return
        sink: asyncio.Queue = asyncio.Queue()
        ranks = self.ctrl.expect(request_id, sink, -(-num_prompt_tokens // self.config.block_size))
        self._wake.set()
        self._sinks[request_id] = sink
        self.callers.opened(request_id, caller)
        finished = False
        try:
            yield group.target_for(ranks)
            while not finished:
                batch = [await sink.get()]
                while not sink.empty():
                    batch.append(sink.get_nowait())
                out: list[TokenDelta] = []
                for item in batch:
                    if isinstance(item, StreamError):
                        if out:
                            yield out
                        finished = True
                        yield item
                        return
                    out.append(item)
                    finished = finished or item.finished
                yield out
        finally:
            self._sinks.pop(request_id, None)
            self.callers.closed(request_id)
            if not finished:
                self.ctrl.cancel(request_id)  # client gone, stop string, or prefill failure
                self._wake.set()

    def _caller_died(self, request_id: str, caller: str) -> None:
        """The router reading this stream is dead: abort the request (freeing its blocks) and end the
        stream, whose consumer is gone."""
        self.ctrl.cancel(request_id)
        self._wake.set()
        sink = self._sinks.get(request_id)
        if sink is not None:
            sink.put_nowait(StreamError(f"the router reading this stream ({caller}) died"))

    async def _current_group(self, timeout_s: float = float("inf")) -> RankGroup | None:
        deadline = time.monotonic() + timeout_s
        while self.group is None and time.monotonic() < deadline:  # being rebuilt after a failure
            await asyncio.sleep(0.05)
        return self.group

    # ------------------------------------------------------------------ the step loop
    async def _run(self) -> None:
        while True:
            if self._lost is not None:
                reason, self._lost = self._lost, None
                await self._recover(self.group, reason)
                continue
            if not self.ctrl.has_work:
                self._wake.clear()
                await self._wake.wait()
                continue
            group = self.group
            work = self.ctrl.next_step()
            wait_s = 0.0 if (any(w.commands for w in work) or self.ctrl.decoding) else IDLE_POLL_S
            try:
                reports = await group.step(work, wait_s)
            except WorkerDiedError as e:
                await self._recover(group, str(e))
                continue
            self._steps += 1
            self._step_seconds += max(r.step_seconds for r in reports)
            self.ctrl.on_reports(reports)

    async def _recover(self, group: RankGroup, reason: str) -> None:
        log.error("decode group %s failed, rebuilding: %s", group.group_id, reason)
        # Clients get the first line: Ray's account of a death goes on with pids, addresses and advice
        # about OOM killers that belongs in the log, not in an HTTP answer.
        reason = reason.strip().splitlines()[0] if reason.strip() else "unknown"
        self._last_error = reason
        self.group = None
        group.kill()
        self.ctrl.fail_all(f"a decode rank died; the request was ended: {reason}")
        while True:
            try:
                self.group = await RankGroup.start(self.spec)
                self.groups_started += 1
                return
            except WorkerDiedError as e:
                log.error("rebuilding the decode group failed, retrying: %s", e)
                self._last_error = str(e).strip().splitlines()[0]
                await asyncio.sleep(1.0)

    # ------------------------------------------------------------------ load, health, introspection
    def stats(self) -> dict:
        handovers = self.ctrl.handovers[-64:]
        return {
            "replica": replica_id(),
            "group_id": self.group.group_id if self.group else None,
            "max_num_seqs": self.config.max_num_seqs,
            "groups_started": self.groups_started,
            "routers_lost": self.callers.callers_lost,
            "tp_size": self.config.tp,
            "attention_dp": self.config.attention_dp,
            # per rank: (requests placed there since start, KV blocks in use, KV blocks, running requests);
            # a tuple, so that it travels in the routing stats too (one entry per rank: small)
            "dp_ranks": tuple((placed, load.kv_blocks_used, load.kv_blocks_total, load.num_running)
                              for placed, load in zip(self.ctrl.placed_total, self.ctrl.rank_loads)),
            "num_requests": len(self.ctrl.requests),
            "num_running": self.ctrl.num_running,
            "kv_blocks_used": self.ctrl.kv_blocks_used,
            "kv_blocks_total": self.ctrl.kv_blocks_total,
            "steps": self._steps,
            "rank_step_seconds": self._step_seconds,
            "handovers_total": self.ctrl.handovers_total,
            "handovers_stocked": self.ctrl.handovers_stocked,
            "grammar": dict(self.ctrl.grammar_stats),
            "handover_seconds": [s for s, _, _ in handovers],
            "handover_unpack_seconds": [u for _, u, _ in handovers],
            "handover_bytes": [b for _, _, b in handovers],
            "last_error": self._last_error if self.group is None else None,  # why no group is up
            "time": time.time(),
        }

    def handover_timings(self, last: int = 512) -> list[tuple[float, float, int]]:
        """(payload receive s and unpack s on the slowest rank, bytes over all ranks) of recent hand-overs."""
        return list(self.ctrl.handovers[-last:])

    def record_routing_stats(self) -> dict:
        """Small: Serve polls it and broadcasts it to every router."""
        return {k: v for k, v in self.stats().items() if not isinstance(v, list)}

    async def rank_pids(self) -> list[int]:
        group = await self._current_group()
        return await group.pids()

    async def check_health(self) -> None:
        if self._loop.done():
            raise RuntimeError(f"the decode step loop stopped: {self._loop.exception()!r}")
        await self._ping_idle_group()

    async def _ping_idle_group(self) -> None:
        """A group with nothing to step finds out about a lost rank (its node gone) only here: then the loop
        rebuilds it before the next request needs it, and stats say why no group is up meanwhile. Only a
        dead actor counts; a slow answer is left to the step deadline (this call must stay short, or Serve
        would replace a healthy replica)."""
        import ray

        group = self.group
        if group is None or self.ctrl.has_work or self._lost is not None:
            return
        try:
            await asyncio.wait_for(group.pids(), PING_TIMEOUT_S)
        except (asyncio.TimeoutError, ray.exceptions.ActorUnavailableError):  # maybe transient
            return
        except ray.exceptions.ActorDiedError as e:
            if self.group is group and not self.ctrl.has_work:
                self._lost = f"decode group {group.group_id}: a rank is gone: {e}"
                self._wake.set()

    def __del__(self):
        if getattr(self, "group", None) is not None:
            self.group.kill()

