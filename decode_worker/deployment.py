"""DecodeServer: the decode Serve deployment. A replica owns one RankGroup (a placement group of
`tp` DecodeRank actors), runs the lockstep step loop and fans each step's tokens out to the routers.
If the group dies, in-flight requests end with an error and the replica builds a new group.

A router calls `open` per request (the answer says where the prefill sends the KV), reads ONE feed per
decode replica for all its requests (a FeedBatch of (request id, TokenDelta | StreamError) per step:
decode_worker/feed.py says why), and calls `cancel` for a request it gives up on. The feed goes over a feed
link (`feed_link`: a TCP connection, cluster/feed_link.py) or, where a router is configured so, as a Serve
stream (`feed`).
"""
from __future__ import annotations

import dataclasses

import asyncio
import collections
import logging
import time

from cluster.errors import WorkerDiedError
from cluster.feed_link import FeedLinkAddress, FeedLinkServer
from cluster.placement import RankResources
from cluster.protocol import DecodeOpened, StreamError
from cluster.protocol.load import DecodeLoad
from cluster.rendezvous import node_ip
from cluster.runtime import replica_id
from decode_worker.callers import CallerWatch
from decode_worker.config import DecodeConfig
from decode_worker.controller import DecodeController
from decode_worker.feed import Feed
from decode_worker.group import GroupSpec, RankGroup

log = logging.getLogger(__name__)

IDLE_POLL_S = 0.05  # long-poll of the ranks while hand-overs are expected and nothing decodes
PING_TIMEOUT_S = 5.0  # an idle group's liveness probe, well inside Serve's health-check timeout


def group_spec(c: DecodeConfig) -> GroupSpec:
    """The rank group a replica builds (and rebuilds): its size, mode and each rank's bundle."""
    resources = RankResources(num_cpus=c.rank_num_cpus, num_gpus=c.rank_gpus(), custom=dict(c.rank_resources))
    return GroupSpec(engine=c, tp_size=c.tp, resources=resources, attention_dp=c.attention_dp > 1,
                     step_timeout_s=c.step_timeout_s)


def _group_prefix_cache(reports, attention_dp: bool) -> dict[str, int]:
    """The group's prefix-cache counters: under TP every rank holds the same blocks and admits alike, so rank
    0's; under attention data parallelism each rank caches its own requests' blocks, so the sum."""
    if not attention_dp:
        return dict(reports[0].prefix_cache)
    total: dict[str, int] = {}
    for r in reports:
        for name, n in r.prefix_cache:
            total[name] = total.get(name, 0) + n
    return total


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
        self._prefix_cache: dict[str, int] = {}  # the group's engine prefix-cache counters, from the last reports
        self._last_error: str | None = None
        self._lost: str | None = None  # an idle group found dead by check_health; the loop rebuilds it
        self._loop = asyncio.create_task(self._run())
        self.replica = replica_id()
        self._feeds: dict[str, Feed] = {}  # router actor name ("" when unnamed) -> its feed
        self._callers_of: dict[str, str] = {}  # open request id -> its router's feed key
        self._feed_batches = self._feed_items = 0  # stream items sent on feeds, and the request items in them
        self._orphans_ended = 0  # requests ended because their router's feed link closed
        self.callers = CallerWatch(self._caller_died, on_gone=self._router_gone)
        self._watch = asyncio.create_task(self.callers.run())
        self.links = FeedLinkServer(node_ip(), self._subscription, self._link_closed)

    # ------------------------------------------------------------------ requests and their router's feed
    async def open(self, request_id: str, num_prompt_tokens: int = 0, caller: str | None = None,
                   prompt_token_ids: list[int] | None = None, cache_salt: str | None = None, avoid: str | None = None,
                   local: tuple | None = None):
        """Expect a request's hand-over: a DecodeOpened (this replica, and the ranks the prefill sends to), or
        a StreamError. Its token deltas then go out on `caller`'s feed. num_prompt_tokens: the prompt's
        length (it weighs the placement); caller: the Serve actor name of the router (its death cancels
        its requests). prompt_token_ids (and the request's cache_salt): with prefix caching on, the ranks
        that will own the request pin the leading blocks of it they hold (a lockstep PIN at the group's next
        step) and the target says so (DecodeTarget.pinning): the prefill asks them how many before it packs the
        payload, and sends the rest. avoid: a routing hint only (the replica a resumed request's worker died on,
        which the request router ranks last: router/policy.py demote).
        local: (the request's PrefillRequest wire form, the most uncached prompt tokens this group may prefill
        itself): when its ranks hold all but that many of the prompt, the group prefills it and the answer says
        `local` (no prefill is asked, no hand-over comes: decode_worker/controller.py expect). A malformed
        request is a ProtocolError (the router built it), refused parameters an InvalidRequestError."""
        admit = None
        if local is not None and self.config.enable_prefix_caching:
            from cluster.protocol import PrefillRequest

            wire_request, max_tokens = local
            admit = (PrefillRequest.from_wire(wire_request), int(max_tokens))
        group = await self._current_group(self.config.handover_timeout_s)
        if group is None:
            return StreamError(f"the decode group is restarting after a failure ({self._last_error}); retry")
        feed = self._feed(caller)
        pin = None
        if prompt_token_ids and self.config.enable_prefix_caching and len(prompt_token_ids) > self.config.block_size:
            pin = (tuple(prompt_token_ids), cache_salt)
        ranks = self.ctrl.expect(request_id, feed.sink(request_id), -(-num_prompt_tokens // self.config.block_size),
                                 pin, admit if pin else None)
        self._callers_of[request_id] = caller or ""
        self.callers.opened(request_id, caller)
        self._wake.set()
        target = group.target_for(ranks)
        tracked = self.ctrl.requests[request_id]
        if tracked.local:
            return DecodeOpened(self.replica, target, local=True, seed=tracked.seed)
        return DecodeOpened(self.replica, dataclasses.replace(target, pinning=True) if pin else target)

    async def feed_link(self, caller: str | None = None, replica: str | None = None) -> FeedLinkAddress:
        """Where `caller` reads its feed (cluster/feed_link.py): FeedBatches of (request id, TokenDelta |
        StreamError), everything for its requests, one per step that had any. `replica`: the replica
        the router means (its request router sends the call there while Serve lists it); another replica
        refuses, so that the router learns that the one it meant is gone (and its requests with it) instead
        of reading someone else's feed. A newer subscription of the same caller takes over from an older."""
        self._check_replica(replica)
        await self.links.start()
        return self.links.offer(caller or "")

    async def feed(self, caller: str | None = None, replica: str | None = None):
        """The same feed as a Serve stream (a router with feed_link off): about 1.5-2 ms more CPU per step on
        each side."""
        self._check_replica(replica)
        async for batch in self._subscription(caller or ""):
            yield batch

    def _check_replica(self, replica: str | None) -> None:
        if replica is not None and replica != self.replica:
            raise LookupError(f"decode replica {replica} is gone (this is {self.replica})")

    async def _subscription(self, key: str):
        caller = key or None
        self.callers.subscribed(caller)
        try:
            async for batch in self._feed(caller).batches():
                self._feed_batches += 1
                self._feed_items += len(batch.items)
                yield batch
        finally:
            self.callers.unsubscribed(caller)

    def _link_closed(self, key: str) -> None:
        """The router reading `key`'s feed closed its link and no other is open: it died, is stopping, or its
        reader failed (and it answered those requests with a 503 already). Nobody will read their tokens, so
        they end now, not when Ray confirms a death, which takes seconds: hundreds of steps decoded for
        nobody. Each gets an error in the feed, in case the router is alive and a request of its opened just
        as the link broke (a new link delivers it). Ray is asked about the router at once."""
        feed = self._feeds.get(key)
        orphans = [rid for rid, caller in self._callers_of.items() if caller == key]  # all on `feed` (open())
        for rid in orphans:
            self.ctrl.cancel(rid)
            feed.put(rid, StreamError("the router's feed link closed while the request was decoding; retry"))
            # (its end, _ended, forgets the request)
        if orphans:
            self._orphans_ended += len(orphans)
            log.warning("the feed link of router %s closed with %d request(s) open here: ended them",
                        key or "(unnamed)", len(orphans))
            self._wake.set()
        self.callers.check_now(key or None)
        if feed is not None and feed.idle:
            del self._feeds[key]

    async def cancel(self, request_id: str, replica: str | None = None) -> None:
        """The router is done with the request (client gone, stop string, prefill failure): abort it and
        free its blocks. Unknown ids are ignored (it ended meanwhile, or this is not its replica)."""
        caller = self._callers_of.pop(request_id, None)
        if caller is None:
            return
        self.callers.closed(request_id)
        feed = self._feeds.get(caller)
        if feed is not None:
            feed.forget(request_id)
        self.ctrl.cancel(request_id)
        self._wake.set()

    def _feed(self, caller: str | None) -> Feed:
        key = caller or ""
        feed = self._feeds.get(key)
        if feed is None:
            feed = self._feeds[key] = Feed(self._ended)
        return feed

    def _ended(self, request_id: str) -> None:
        self._callers_of.pop(request_id, None)
        self.callers.closed(request_id)

    def _caller_died(self, request_id: str, caller: str) -> None:
        """The router reading this request's feed is dead: abort the request (freeing its blocks); once none
        of its requests is left, drop its feed (nobody will read what waits there)."""
        self._callers_of.pop(request_id, None)
        self.ctrl.cancel(request_id)
        self._wake.set()
        feed = self._feeds.get(caller)
        if feed is not None:
            feed.forget(request_id)
            if not feed.requests:
                del self._feeds[caller]
                feed.close()

    def _router_gone(self, caller: str) -> None:
        """After its requests (_caller_died): a dead router's feed ends, also one that had no request open."""
        feed = self._feeds.pop(caller, None)
        if feed is not None:
            feed.close()

    async def _current_group(self, timeout_s: float = float("inf")) -> RankGroup | None:
        deadline = time.monotonic() + timeout_s
        while self.group is None and time.monotonic() < deadline:  # being rebuilt after a failure
            await asyncio.sleep(0.05)
        return self.group

    # ------------------------------------------------------------------ the step loop
    async def _run(self) -> None:
        # Group steps submitted and not yet reported, oldest first. While requests decode the replica keeps
        # `steps_in_flight` of them at the ranks, so that each rank finds its next step waiting when it ends
        # one instead of idling while this replica reads the report and sends the next (a Ray round trip plus
        # the controller's work): the controller's commands then land a step later, which it tolerates (it
        # never assumes a command has been applied before the report that says so).
        in_flight: collections.deque[asyncio.Future] = collections.deque()
        while True:
            if self._lost is not None and not in_flight:
                reason, self._lost = self._lost, None
                await self._recover(self.group, reason)
                continue
            group = self.group
            while self.ctrl.has_work and len(in_flight) < self.config.steps_in_flight:
                if in_flight and not self.ctrl.decoding:
                    break  # hand-overs only: one step at a time, long-polling the ranks
                work = self.ctrl.next_step()
                busy = in_flight or any(w.commands for w in work) or self.ctrl.decoding
                in_flight.append(group.submit(work, 0.0 if busy else IDLE_POLL_S))
            if not in_flight:
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                reports = await in_flight.popleft()
            except WorkerDiedError as e:
                for later in in_flight:  # they fail alike: the group is being replaced
                    later.cancel()
                in_flight.clear()
                await self._recover(group, str(e))
                continue
            self._steps += 1
            self._step_seconds += max(r.step_seconds for r in reports)
            self.ctrl.on_reports(reports)
            self._prefix_cache = _group_prefix_cache(reports, self.spec.attention_dp)

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
    def stats(self, replica: str | None = None) -> dict:
        """replica: this replica's id, to address one replica of several (the request router honours it)."""
        handovers = self.ctrl.handovers[-64:]
        return {
            "replica": replica_id(),
            "group_id": self.group.group_id if self.group else None,
            "max_num_seqs": self.config.max_num_seqs,
            "groups_started": self.groups_started,
            "routers_lost": self.callers.callers_lost,
            "requests_ended_link_closed": self._orphans_ended,
            "feed_subscriptions": sum(self.callers.subscribers.values()),  # routers' feeds open (named)
            "feed_links": self.links.open_links,
            "tp_size": self.config.tp,
            "attention_dp": self.config.attention_dp,
            # per rank: (requests placed there since start, KV blocks in use, KV blocks, running requests)
            "dp_ranks": tuple((placed, load.kv_blocks_used, load.kv_blocks_total, load.num_running)
                              for placed, load in zip(self.ctrl.placed_total, self.ctrl.rank_loads)),
            "dp_placed_for_prefix": self.ctrl.placed_for_prefix,  # placed on a rank for the prompt blocks it held
            "num_requests": len(self.ctrl.requests),
            "num_running": self.ctrl.num_running,
            "kv_blocks_used": self.ctrl.kv_blocks_used,
            "kv_blocks_total": self.ctrl.kv_blocks_total,
            "steps": self._steps,
            "rank_step_seconds": self._step_seconds,
            "handovers_total": self.ctrl.handovers_total,
            "handovers_stocked": self.ctrl.handovers_stocked,
            "handovers_committed_on_landing": self.ctrl.handovers_committed_on_landing,
            "handover_blocks_reused": self.ctrl.handover_blocks_reused,  # prompt blocks found pinned, not received
            "local_prefills": self.ctrl.local_prefills,  # requests the group prefilled itself (no hand-over)
            "local_prefill_tokens": self.ctrl.local_prefill_tokens,  # the uncached remainders they computed
            "grammar": dict(self.ctrl.grammar_stats),
            "overlapped_steps": self.ctrl.overlapped_steps,
            # the group's engine counters, and the prompt blocks hand-overs did not carry (the ranks held them)
            "prefix_cache": ({**self._prefix_cache, "handover_reused_blocks": self.ctrl.handover_blocks_reused,
                              "local_prefills": self.ctrl.local_prefills,
                              "local_prefill_tokens": self.ctrl.local_prefill_tokens}
                             if self._prefix_cache else {}),
            "feed_batches": self._feed_batches,
            "feed_items": self._feed_items,
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
        """A DecodeLoad's wire form (cluster/protocol/load.py): Serve polls it and hands it to every router."""
        s = self.stats()
        return DecodeLoad(replica=s["replica"], group_id=s["group_id"], last_error=s["last_error"],
                          max_num_seqs=s["max_num_seqs"], num_requests=s["num_requests"],
                          num_running=s["num_running"], kv_blocks_used=s["kv_blocks_used"],
                          kv_blocks_total=s["kv_blocks_total"], steps=s["steps"], dp_ranks=s["dp_ranks"],
                          grammar=tuple(s["grammar"].items()),
                          prefix_cache=tuple(s["prefix_cache"].items()),
                          **dict(zip(("block_size", "prefix_model", "cached_blocks"), self.ctrl.group_view()))
                          ).to_wire()

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
        if getattr(self, "links", None) is not None:
            self.links.close()
        if getattr(self, "group", None) is not None:
            self.group.kill()

