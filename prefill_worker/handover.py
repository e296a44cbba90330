"""HandoverSender: packs a parked request's KV blocks and sends them to every rank of its decode
group, on a thread of its own, over channels it opens on demand and keeps per (group, rank).

A decode rank with tp > 1 gets only its KV-head slice of each block (RankEndpoint.kv_heads), or the whole block
when the model's cache cannot be sliced (MLA: one latent row per token, replicated on every TP rank). The blocks
are packed into a contiguous buffer first and released right away, so the prefill's cache is never held by a slow
transfer. Headers go to every rank before any payload: a rank lets the payload in only after every
rank of its group has the header (lockstep reserve), so sending rank by rank could deadlock.

One thread sends them all, in order, so a hand-over that cannot go must not hold the others up: one whose
caller gave up (the router cancelled it, e.g. to resume the request elsewhere) is dropped unsent, and a group
found gone (its rank actor dead when a channel to it is opened) is remembered, so that every later hand-over
to it fails at once instead of waiting out a connect timeout each.
"""
from __future__ import annotations

import collections
import logging
import queue
import threading
import time
import uuid
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from typing import Callable

import ray
import torch

from cluster.channel import SENDER, KVChannel, connect_channel
from cluster.errors import ChannelError
from cluster.faults import FaultPoints
from cluster.groups import backend_for
from cluster.protocol import (DecodeTarget, DraftsHandover, GrammarHandover, HandoverHeader, HandoverPayload,
                              RankEndpoint)
from engine import Handover
from kernels.kv_transfer import pack_kv

log = logging.getLogger(__name__)

# How long a decode rank may take to apply the PIN its open queued, once the prompt is prefilled (it is applied
# at the group's next step; past this the whole prompt travels).
PIN_WAIT_S = 2.0


def _grammar(handover: Handover) -> GrammarHandover | None:
    structured = handover.request.params.structured_output
    if structured is None:
        return None
    return GrammarHandover.of(structured.key(), handover.compiled_grammar, structured.plan.backend)


def pack_blocks(kv_cache: torch.Tensor, block_ids: list[int], heads: tuple[int, int]) -> torch.Tensor:
    """[L, P, n, S, h, D] contiguous copy of `block_ids` (and KV heads [start, start + h)) of
    kv_cache [L, P, N, S, H, D] (P planes: 2 for K and V, 1 for MLA's latent)."""
    index = torch.tensor(block_ids, dtype=torch.long, device=kv_cache.device)
    start, count = heads
    return pack_kv(kv_cache, index, head_start=start, head_end=start + count)


@dataclass(slots=True)
class HandoverTiming:
    request_id: str
    pack_seconds: float
    answer_seconds: float  # headers out -> every rank answered (waiting for lockstep reserve)
    payload_seconds: float
    payload_bytes: int
    dropped: bool


class HandoverSender:
    def __init__(self, kv_cache: torch.Tensor, release: Callable[[str], None], name: str,
                 transfer_timeout_s: float = 60.0, connect_timeout_s: float = 30.0, transport: str = "auto",
                 faults: FaultPoints | None = None):
        self.kv_cache = kv_cache
        self.release = release
        self.name = name
        self.transfer_timeout_s = transfer_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.faults = faults or FaultPoints()
        self.backend = backend_for(kv_cache.device)
        self.transport = transport  # cluster.ipc.TransportPreference; the decode rank states its own
        self.by_transport: collections.Counter[str] = collections.Counter()  # sent hand-overs by what carried them
        self.channels: dict[tuple[str, int], KVChannel] = {}
        self.timings: collections.deque[HandoverTiming] = collections.deque(maxlen=512)
        self.failures = 0
        self.total = 0  # hand-overs attempted (timings keeps the most recent)
        self._jobs: queue.Queue = queue.Queue()
        self._gone: collections.OrderedDict[str, None] = collections.OrderedDict()  # decode groups found dead
        self.dropped = 0  # hand-overs dropped unsent: their caller had given up
        self._thread = threading.Thread(target=self._serve, daemon=True, name="handover-tx")
        self._thread.start()

    def submit(self, handover: Handover, target: DecodeTarget) -> Future:
        """Queue a hand-over; the future ends when it was sent (None) or failed (the error)."""
        done: Future = Future()
        self._jobs.put((handover, target, done))
        return done

    @property
    def queued(self) -> int:
        return self._jobs.qsize()

    def close(self) -> None:
        self._jobs.put(None)
        for ch in self.channels.values():
            ch.close(notify_peer=True)
        self.channels.clear()

    # ------------------------------------------------------------------ the sending thread
    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            handover, target, done = job
            self.total += 1
            rid = handover.request.request_id
            released = False
            try:
                if done.cancelled():  # nobody waits for it (the router resumed the request elsewhere)
                    self.dropped += 1
                    continue
                if target.group_id in self._gone:
                    raise ChannelError(f"decode group {target.group_id} is gone")
                handover = self._reusing(handover, target)
                payloads, pack_s = self._pack(handover, target)
                self.release(rid)
                released = True
                self._send(handover, target, payloads, pack_s)
                _settle(done)
            except (ChannelError, ray.exceptions.RayError) as e:
                # The decode side sees the same broken channel (or dead group) and fails the request there.
                self.failures += 1
                log.warning("hand-over of %s to group %s failed: %s", rid, target.group_id, e)
                self._forget_group(target.group_id)
                if isinstance(e, (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)):
                    self._mark_gone(target.group_id)  # a rank's actor is dead (asked for its pinned blocks)
                _settle(done, e)
            except Exception as e:  # noqa: BLE001 - keep the thread serving; this request is lost
                self.failures += 1
                log.exception("hand-over of %s failed", rid)
                _settle(done, e)
            finally:
                if not released:
                    self.release(rid)

    def _reusing(self, handover: Handover, target: DecodeTarget) -> Handover:
        """The hand-over without the leading blocks every rank of the target holds already (DecodeRank.pinned:
        the smallest answer counts; a rank that pinned more gives the rest back at reserve)."""
        if not target.pinning:
            return handover
        rid = handover.request.request_id
        answers = [rank.actor.pinned.remote(rid, PIN_WAIT_S) for rank in target.ranks]
        try:
            held = ray.get(answers, timeout=PIN_WAIT_S + self.connect_timeout_s)
        except ray.exceptions.GetTimeoutError:
            held = [0]
        return handover.reusing(min(held))

    def _pack(self, handover: Handover, target: DecodeTarget) -> tuple[list[HandoverPayload], float]:
        """One payload per rank of `target`, in rank order."""
        start = time.perf_counter()
        block_ids = handover.payload_block_ids  # past the blocks the decode rank holds already (reused_blocks)
        by_slice: dict[tuple[int, int], torch.Tensor] = {}
        # With speculation the cache's extra layers hold the draft's KV (same heads, same slices; DeepSeek-V3's MTP
        # layer: its latent rows), and a sampled request's first drafts' distributions travel along whole to every
        # rank (the drafts themselves ride in the header). Ranks holding the same heads (a replicated MLA latent)
        # share one packed buffer.
        drafts = handover.drafts
        probs = drafts.probs.contiguous() if drafts is not None and drafts.probs is not None else None
        payloads = []
        for rank in target.ranks:
            if rank.kv_heads not in by_slice:
                by_slice[rank.kv_heads] = pack_blocks(self.kv_cache, block_ids, rank.kv_heads)
            payloads.append(HandoverPayload(kv=by_slice[rank.kv_heads], draft_probs=probs))
        if self.kv_cache.device.type == "cuda":
            torch.cuda.current_stream(self.kv_cache.device).synchronize()
        return payloads, time.perf_counter() - start

    def _send(self, handover: Handover, target: DecodeTarget, payloads: list[HandoverPayload], pack_s: float) -> None:
        rid = handover.request.request_id
        self.faults.hit("handover.send_header", rid)
        channels = [self._channel(target, rank) for rank in target.ranks]
        start = time.perf_counter()
        header = HandoverHeader(handover.request, payloads[0].parts, _grammar(handover),  # same for every rank
                                DraftsHandover.of(handover.drafts)).to_wire()
        for ch, payload in zip(channels, payloads):
            ch.send_header(header, payload.tensors, self.transfer_timeout_s)
        self.faults.hit("handover.send_payload", rid, channels[0].name)
        # Each rank's payload starts as soon as that rank answers, and all of them move at once.
        pending, answers = [], []
        for ch, payload in zip(channels, payloads):
            go = ch.wait_answer(self.transfer_timeout_s)
            answers.append(go)
            if go:
                pending.append((ch, ch.post_payload(payload.tensors)))
        answered = time.perf_counter()
        for ch, p in pending:
            ch.finish_payload(p, self.transfer_timeout_s)
        nbytes = sum(v.numel() for _, p in pending for v in p.views)
        done = time.perf_counter()
        if pending:
            self.by_transport[channels[0].transport] += 1
        self.timings.append(HandoverTiming(rid, pack_s, answered - start, done - answered, nbytes, not any(answers)))

    def _channel(self, target: DecodeTarget, rank: RankEndpoint) -> KVChannel:
        key = (target.group_id, rank.tp_rank)
        ch = self.channels.get(key)
        if ch is not None and ch.usable:
            return ch
        if ch is not None:
            ch.close()
        # A rank that died takes its store with it: connecting would wait the whole connect timeout. Its actor
        # answers at once if alive, and Ray says at once if it is dead.
        try:
            ray.get(rank.actor.address.remote(), timeout=self.connect_timeout_s)
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
            self._mark_gone(target.group_id)
            raise ChannelError(f"decode rank {rank.tp_rank} of group {target.group_id} is gone") from e
        channel_id = f"{self.name}-{target.group_id}-r{rank.tp_rank}-{uuid.uuid4().hex[:8]}"
        accepted = rank.actor.accept.remote(channel_id, self.connect_timeout_s)
        try:
            ch = connect_channel(rank.store, channel_id, SENDER, self.backend, self.connect_timeout_s,
                                 self.transport)
            ray.get(accepted, timeout=self.connect_timeout_s)
        except ray.exceptions.GetTimeoutError as e:
            raise ChannelError(f"decode rank {rank.tp_rank} of group {target.group_id} did not accept") from e
        self.channels[key] = ch
        return ch

    def _mark_gone(self, group_id: str) -> None:
        self._gone[group_id] = None
        while len(self._gone) > 64:  # group ids are never reused: the oldest can go
            self._gone.popitem(last=False)

    def _forget_group(self, group_id: str) -> None:
        for key in [k for k in self.channels if k[0] == group_id]:
            self.channels.pop(key).close()


def _settle(done: Future, error: BaseException | None = None) -> None:
    """End a hand-over's future, unless its caller gave up on it (cancelled) meanwhile."""
    try:
        if error is None:
            done.set_result(None)
        else:
            done.set_exception(error)
    except InvalidStateError:
        pass
