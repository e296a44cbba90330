"""HandoverReceiver: the incoming channels of one decode rank, each served by its own thread.

Per message the thread reads the header (a cluster.protocol.HandoverHeader; one it cannot read is
refused, and its request fails with the reason). If the rank's HandoverStock (decode_worker/stock.py)
has the request's blocks, the thread takes them at once ("reserved") and lets the payload in; otherwise
it parks the header as an arrival and waits for the rank's step thread to either reserve blocks in
lockstep (`provide_blocks`) or refuse it (`drop`). Either way the payload is then received, by name, and
written into the blocks while decoding goes on. Blocks from the stock stay the receiver's until the rank
takes them at commit (`take_stocked`), or go back to the stock if the request is dropped.
"""
from __future__ import annotations

import logging
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from cluster.channel import KVChannel, Message
from cluster.errors import ChannelError, HandoverHeaderError
from cluster.faults import FaultPoints
from cluster.protocol import HandoverHeader, HandoverPayload
from decode_worker.stock import HandoverStock
from engine.handover import HandoverDrafts
from kernels.kv_transfer import unpack_kv

log = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class _Arrival:
    header: HandoverHeader
    message: Message
    channel: KVChannel
    decided: threading.Event = field(default_factory=threading.Event)
    block_ids: list[int] | None = None  # None with `decided` set: dropped
    stocked: bool = False  # its blocks came from the stock (no lockstep reserve needed)
    dropped: bool = False  # stocked and dropped while its payload was coming: the blocks go back on landing


def _client_text(error: Exception) -> str:
    """The reason a request's client gets: gloo's source locations and troubleshooting advice stay in the log."""
    text = re.sub(r"\[[^\]]*\.(?:cc|cpp|h):\d+\] ", "", str(error))
    return re.split(r"\. This is typically caused by", text)[0]


def _read_header(message: Message) -> HandoverHeader:
    header = HandoverHeader.from_wire(message.header)
    if len(header.parts) != len(message.payload):
        raise HandoverHeaderError(f"the header names payload parts {[p.value for p in header.parts]} but "
                                  f"{len(message.payload)} tensors follow", request_id=header.request_id)
    return header


class HandoverReceiver:
    def __init__(self, kv_cache: torch.Tensor, payload_timeout_s: float = 60.0, stock: HandoverStock | None = None,
                 faults: FaultPoints | None = None, on_header: Callable[[HandoverHeader], None] | None = None):
        """on_header: called on the channel thread with each header read, before it is parked (the rank
        loads the request's grammar there, off the step thread); its errors are logged and ignored."""
        self.kv_cache = kv_cache  # [num_layers, planes, num_blocks, block_size, local kv heads, head_dim]
        self.on_header = on_header
        self.payload_timeout_s = payload_timeout_s
        self.faults = faults or FaultPoints()
        self.stock = stock
        self._lock = threading.Condition()
        self._pending: dict[str, _Arrival] = {}  # parked, or stocked until the rank takes the blocks
        self._arrived: list[str] = []
        self._reserved: list[str] = []  # took their blocks from the stock
        self._landed: list[str] = []
        self._failed: list[tuple[str, str]] = []
        self._timings: list[tuple[str, float, float, int]] = []  # (rid, receive s, unpack s, bytes)
        self._drafts: dict[str, HandoverDrafts] = {}  # request id -> its first drafts (speculation)
        self._channels: list[KVChannel] = []
        self._stopping = False

    # ------------------------------------------------------------------ called by the rank
    def add_channel(self, channel: KVChannel) -> None:
        with self._lock:
            self._channels.append(channel)
        threading.Thread(target=self._serve, args=(channel,), daemon=True, name=f"handover-rx-{channel.name}").start()

    def header(self, request_id: str) -> HandoverHeader:
        with self._lock:
            return self._pending[request_id].header

    def provide_blocks(self, request_id: str, block_ids: list[int]) -> None:
        with self._lock:
            arrival = self._pending[request_id]
        arrival.block_ids = block_ids
        arrival.decided.set()

    def is_stocked(self, request_id: str) -> bool:
        with self._lock:
            arrival = self._pending.get(request_id)
            return arrival is not None and arrival.stocked

    def take_stocked(self, request_id: str) -> tuple[HandoverHeader, list[int]] | None:
        """At commit: a landed request's header and the stock blocks holding its KV, now the caller's
        (None: its blocks did not come from the stock)."""
        with self._lock:
            arrival = self._pending.get(request_id)
            if arrival is None or not arrival.stocked:
                return None
            del self._pending[request_id]
            return arrival.header, arrival.block_ids

    def landed_in_stock(self) -> list[str]:
        """Requests whose payload has landed in stock blocks and that the rank has not taken yet."""
        with self._lock:
            return [rid for rid, a in self._pending.items() if a.stocked and a.decided.is_set() and not a.dropped]

    def take_drafts(self, request_id: str) -> HandoverDrafts | None:
        """At commit: a landed request's first drafts, with their distributions (None: none came)."""
        with self._lock:
            return self._drafts.pop(request_id, None)

    def drop(self, request_id: str) -> None:
        with self._lock:
            self._drafts.pop(request_id, None)
            arrival = self._pending.pop(request_id, None)
            if arrival is not None and arrival.stocked:
                if arrival.decided.is_set():  # landed: its blocks go back now
                    self.stock.give(arrival.block_ids)
                else:  # its payload is still being written into them: the channel thread gives them back
                    arrival.dropped = True
                return
        if arrival is not None:
            arrival.decided.set()

    def take_events(self):
        """(arrived, reserved, landed, failed, timings) since the last call."""
        with self._lock:
            out = self._arrived, self._reserved, self._landed, self._failed, self._timings
            self._arrived, self._reserved, self._landed, self._failed, self._timings = [], [], [], [], []
        return out

    def wait_for_event(self, timeout_s: float) -> None:
        """Block until an arrival, landing or failure is reported, or the timeout passes."""
        with self._lock:
            if not (self._arrived or self._reserved or self._landed or self._failed):
                self._lock.wait(timeout_s)

    def close(self) -> None:
        with self._lock:
            self._stopping = True
            channels, self._channels = self._channels, []
            pending = list(self._pending.values())
        for a in pending:
            a.decided.set()
        for ch in channels:
            ch.close()

    @property
    def num_channels(self) -> int:
        with self._lock:
            return sum(ch.usable for ch in self._channels)

    # ------------------------------------------------------------------ the channel thread
    def _serve(self, channel: KVChannel) -> None:
        rid = None
        try:
            while True:
                message = channel.recv_header()
                if message is None:
                    return
                try:
                    header = _read_header(message)
                except HandoverHeaderError as e:
                    self._refuse(channel, e)
                    continue
                rid = header.request_id
                if self.on_header is not None:
                    try:
                        self.on_header(header)
                    except Exception:  # noqa: BLE001 - a warm-up only: the rank's reserve decides
                        log.exception("hand-over header hook failed for %s", rid)
                arrival = _Arrival(header, message, channel)
                stocked = self._from_stock(header)
                with self._lock:
                    if self._stopping:
                        if stocked is not None:
                            self.stock.give(stocked)
                        return
                    self._pending[rid] = arrival
                    if stocked is not None:
                        arrival.block_ids, arrival.stocked = stocked, True
                        self._reserved.append(rid)
                    else:
                        self._arrived.append(rid)
                    self._lock.notify_all()
                if not arrival.stocked:
                    arrival.decided.wait()
                if self._stopping:
                    return
                if arrival.block_ids is None:
                    channel.answer(False, self.payload_timeout_s)
                    rid = None
                    continue
                # gloo writes the answer only once the sender waits for it: a sender stalled after the
                # header holds this send, so it gets the payload's deadline, not the channel's default.
                channel.answer(True, self.payload_timeout_s)
                self.faults.hit("handover.recv_payload", rid, channel.name)
                start = time.perf_counter()
                try:
                    payload = HandoverPayload.assemble(
                        header.parts, channel.recv_payload(message, timeout_s=self.payload_timeout_s))
                    received = time.perf_counter()
                    self._write(arrival.block_ids, payload)
                except BaseException:
                    self._unstock(rid, arrival)
                    raise
                unpacked = time.perf_counter()
                with self._lock:
                    if arrival.stocked:
                        arrival.decided.set()  # landed: kept for the rank's commit, unless it was dropped meanwhile
                        if arrival.dropped:
                            self.stock.give(arrival.block_ids)
                            rid = None
                            continue
                    else:
                        self._pending.pop(rid, None)
                    if header.drafts is not None:
                        self._drafts[rid] = header.drafts.with_probs(payload.draft_probs)
                    self._landed.append(rid)
                    self._timings.append((rid, received - start, unpacked - received, payload.nbytes))
                    self._lock.notify_all()
                rid = None
        except (ChannelError, ValueError) as e:
            self._fail_channel(channel, rid, _client_text(e))

    def _from_stock(self, header: HandoverHeader) -> list[int] | None:
        """The request's blocks from the stock, if it has them and the header fits this rank's cache (a
        header that does not fit takes the lockstep path, where the engine refuses it with the reason)."""
        req = header.request
        L, P, _, S, _, D = self.kv_cache.shape  # layers, planes, -, block size, -, head width
        if self.stock is None or (req.cache_layers, req.cache_planes, req.block_size,
                                  req.cache_head_dim) != (L, P, S, D):
            return None
        return self.stock.take(req.num_blocks - req.reused_blocks)  # the reused ones are pinned in the engine

    def _unstock(self, rid: str, arrival: _Arrival) -> None:
        """A stocked payload that did not land: its blocks go back to the stock."""
        if not arrival.stocked:
            return
        with self._lock:
            if self._pending.get(rid) is arrival:
                del self._pending[rid]
            arrival.decided.set()
        self.stock.give(arrival.block_ids)

    def _refuse(self, channel: KVChannel, error: HandoverHeaderError) -> None:
        """A header this rank cannot read: no payload is let in (the channel stays usable), and the request,
        when the header names it, fails with the reason instead of waiting for its hand-over deadline."""
        log.warning("hand-over header refused on channel %s: %s", channel.name, error.message)
        channel.answer(False)
        if error.request_id is not None:
            with self._lock:
                self._failed.append((error.request_id, f"bad hand-over header: {error.message}"))
                self._lock.notify_all()

    def _write(self, block_ids: list[int], payload: HandoverPayload) -> None:
        kv = payload.kv  # [num_layers, planes, n_blocks, block_size, local kv heads (MLA: the latent), head_dim]
        expected = self.kv_cache[:, :, : len(block_ids)].shape
        if kv.shape != expected or kv.dtype != self.kv_cache.dtype:
            raise ValueError(f"hand-over KV {kv.dtype}{list(kv.shape)} does not fit this rank's cache "
                             f"{self.kv_cache.dtype}{list(expected)}")
        index = torch.tensor(block_ids, dtype=torch.long, device=self.kv_cache.device)
        unpack_kv(kv.to(self.kv_cache.device), self.kv_cache, index)

    def _fail_channel(self, channel: KVChannel, rid: str | None, reason: str) -> None:
        """The channel is unusable: every request still waiting on it fails, and the channel goes."""
        log.warning("hand-over channel %s failed: %s", channel.name, reason)
        channel.close()
        with self._lock:
            # Parked headers on this channel can no longer get their payload; stocked ones that landed can.
            stranded = [r for r, a in self._pending.items()
                        if a.channel is channel and not (a.stocked and a.decided.is_set())]
            if rid is not None and rid not in stranded:
                stranded.append(rid)
            for r in stranded:
                arrival = self._pending.pop(r, None)
                if arrival is not None and arrival.stocked and not arrival.decided.is_set():
                    # its payload never landed (e.g. the answer could not be sent): the blocks go back
                    arrival.decided.set()
                    self.stock.give(arrival.block_ids)
                self._failed.append((r, reason))
            if channel in self._channels:
                self._channels.remove(channel)
            self._lock.notify_all()
