"""The pairwise KV hand-over channel: rank 0 sends, rank 1 receives.

One message is:
  1. sender -> receiver: a meta frame int64[2] (magic, header length) and the msgpack header bytes,
     which carry the caller's header (a hand-over's is `cluster.protocol.HandoverHeader.to_wire()`,
     bytes the channel does not read) plus the dtype and shape of every payload tensor;
  2. receiver -> sender: an answer int64[1], 1 = "blocks are ready, send", 0 = "drop it";
  3. sender -> receiver: the payload tensors, as raw bytes, only after a "send" answer.

The answer makes the payload transfer start only when the receiver has somewhere to put it, so
payload deadlines measure transfer time, not queueing, and a dropped request costs no bandwidth. It also
keeps NCCL (whose watchdog kills a process with a long-pending operation) safe: control frames go over
gloo, payloads over the data group (the same gloo group on CPU, an NCCL group on CUDA).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

import msgpack
import torch
import torch.distributed as dist

from cluster.errors import ChannelError
from cluster.groups import GlooBackend, GroupBackend, build_group, destroy_group
from cluster.rendezvous import StoreAddress, connect_store

SENDER, RECEIVER = 0, 1
_MAGIC_MESSAGE = 0x7A6E_4B56  # "KV" message follows
_MAGIC_CLOSE = 0x7A6E_C105  # the sender is closing the channel
_TAG_META, _TAG_HEADER, _TAG_ANSWER, _TAG_PAYLOAD = 1, 2, 3, 16


@dataclass(frozen=True, slots=True)
class TensorSpec:
    dtype: torch.dtype
    shape: tuple[int, ...]

    @staticmethod
    def of(t: torch.Tensor) -> "TensorSpec":
        return TensorSpec(t.dtype, tuple(t.shape))

    def to_wire(self) -> list:
        return [str(self.dtype).removeprefix("torch."), list(self.shape)]

    @staticmethod
    def from_wire(wire: list) -> "TensorSpec":
        dtype = getattr(torch, wire[0], None)
        if not isinstance(dtype, torch.dtype):
            raise ChannelError(f"unknown dtype {wire[0]!r} in a hand-over header")
        return TensorSpec(dtype, tuple(int(d) for d in wire[1]))


@dataclass(frozen=True, slots=True)
class Message:
    header: dict | bytes  # as the sender gave it
    payload: tuple[TensorSpec, ...]


@dataclass(slots=True)
class TransferStats:
    """Payload bytes and seconds, for bandwidth reports (header/answer round trips excluded)."""
    messages: int = 0
    payload_bytes: int = 0
    payload_seconds: float = 0.0
    history: list[tuple[int, float]] = field(default_factory=list)  # (bytes, seconds) of recent payloads

    def record(self, nbytes: int, seconds: float) -> None:
        self.messages += 1
        self.payload_bytes += nbytes
        self.payload_seconds += seconds
        self.history.append((nbytes, seconds))
        del self.history[:-256]


@dataclass(slots=True)
class PendingSend:
    views: list  # the byte views being sent (kept alive until the sends complete)
    works: list
    started: float


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _wait(work, timeout_s: float | None, what: str) -> None:
    try:
        if timeout_s is None:
            work.wait()
        else:
            work.wait(timedelta(seconds=timeout_s))
    except RuntimeError as e:
        raise ChannelError(f"{what} failed: {e}") from e


class KVChannel:
    """One end of a channel. Each end is used by one thread; `close` may come from any thread."""

    def __init__(self, role: int, control: dist.ProcessGroup, data: dist.ProcessGroup, device: torch.device,
                 name: str = ""):
        self.role = role
        self.peer = RECEIVER if role == SENDER else SENDER
        self.device = device
        self.name = name
        self.stats = TransferStats()
        self._control = control
        self._data = data
        self._closed = threading.Event()
        self._broken: str | None = None

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    @property
    def usable(self) -> bool:
        return not self._closed.is_set() and self._broken is None

    # ------------------------------------------------------------------ sender
    def send_header(self, header: dict | bytes, payload: list[torch.Tensor] | tuple[TensorSpec, ...],
                    timeout_s: float = 30.0) -> None:
        specs = [p if isinstance(p, TensorSpec) else TensorSpec.of(p) for p in payload]
        body = msgpack.packb({"h": header, "p": [s.to_wire() for s in specs]}, use_bin_type=True)
        meta = torch.tensor([_MAGIC_MESSAGE, len(body)], dtype=torch.int64)
        frame = torch.frombuffer(bytearray(body), dtype=torch.uint8)
        self._guard(lambda: (_wait(self._control.send([meta], self.peer, _TAG_META), timeout_s, "sending a header"),
                             _wait(self._control.send([frame], self.peer, _TAG_HEADER), timeout_s, "sending a header")))

    def wait_answer(self, timeout_s: float) -> bool:
        """True: the receiver reserved room and waits for the payload; False: it dropped the message."""
        answer = torch.zeros(1, dtype=torch.int64)
        self._guard(lambda: _wait(self._control.recv([answer], self.peer, _TAG_ANSWER), timeout_s,
                                  "waiting for the receiver's answer"))
        return bool(answer.item())

    def send_payload(self, tensors: list[torch.Tensor], timeout_s: float = 60.0) -> None:
        self.finish_payload(self.post_payload(tensors), timeout_s)

    def post_payload(self, tensors: list[torch.Tensor]) -> "PendingSend":
        """Start sending; the transfer runs on the group's threads while the caller serves other peers."""
        views = [_as_bytes(t.contiguous()) for t in tensors]
        works = self._guard(lambda: [self._data.send([v], self.peer, _TAG_PAYLOAD + i) for i, v in enumerate(views)])
        return PendingSend(views, works, time.perf_counter())

    def finish_payload(self, pending: "PendingSend", timeout_s: float = 60.0) -> None:
        def _finish():
            for w in pending.works:
                _wait(w, timeout_s, "sending the payload")
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()

        self._guard(_finish)
        self.stats.record(sum(v.numel() for v in pending.views), time.perf_counter() - pending.started)

    # ------------------------------------------------------------------ receiver
    def recv_header(self, timeout_s: float = 30.0) -> Message | None:
        """Blocks until the next message; None once the channel is closed (by either end)."""
        meta = torch.zeros(2, dtype=torch.int64)
        try:
            if self._control is None:
                return None
            _wait(self._control.recv([meta], self.peer, _TAG_META), None, "receiving a header")
        except (ChannelError, RuntimeError) as e:
            if self._closed.is_set():
                return None
            self._broken = "the sender went away"
            raise ChannelError(f"channel {self.name}: the sender went away ({e})") from e
        magic, length = (int(v) for v in meta.tolist())
        if magic == _MAGIC_CLOSE:
            self.close()
            return None
        if magic != _MAGIC_MESSAGE:
            self._broken = f"bad frame magic {magic:#x}"
            raise ChannelError(f"channel {self.name}: {self._broken}")
        frame = torch.empty(length, dtype=torch.uint8)
        self._guard(lambda: _wait(self._control.recv([frame], self.peer, _TAG_HEADER), timeout_s, "receiving a header"))
        body = msgpack.unpackb(frame.numpy().tobytes(), raw=False, strict_map_key=False)
        return Message(body["h"], tuple(TensorSpec.from_wire(w) for w in body["p"]))

    def answer(self, send: bool, timeout_s: float = 30.0) -> None:
        flag = torch.tensor([1 if send else 0], dtype=torch.int64)
        self._guard(lambda: _wait(self._control.send([flag], self.peer, _TAG_ANSWER), timeout_s, "answering"))

    def recv_payload(self, message: Message, out: list[torch.Tensor] | None = None,
                     timeout_s: float = 60.0) -> list[torch.Tensor]:
        """Receive the payload into `out` (contiguous, matching the specs) or fresh tensors."""
        if out is None:
            out = [torch.empty(s.shape, dtype=s.dtype, device=self.device) for s in message.payload]
        for t, s in zip(out, message.payload, strict=True):
            if t.dtype != s.dtype or tuple(t.shape) != s.shape or not t.is_contiguous():
                raise ChannelError(f"payload buffer {t.dtype}{list(t.shape)} does not match {s}")
        start = time.perf_counter()

        def _recv():
            works = [self._data.recv([_as_bytes(t)], self.peer, _TAG_PAYLOAD + i) for i, t in enumerate(out)]
            for w in works:
                _wait(w, timeout_s, "receiving the payload")
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()

        self._guard(_recv)
        self.stats.record(sum(t.numel() * t.element_size() for t in out), time.perf_counter() - start)
        return out

    # ------------------------------------------------------------------ lifecycle
    def close(self, notify_peer: bool = False) -> None:
        """Drop the channel. The sender may first tell the receiver, so its thread ends quietly.

        A receiver thread blocked in `recv_header` ends when the sender closes or dies (gloo has no way
        to interrupt it locally); after a local close it then returns None rather than raising.
        """
        if self._closed.is_set():
            return
        if notify_peer and self.role == SENDER and self._broken is None:
            try:
                meta = torch.tensor([_MAGIC_CLOSE, 0], dtype=torch.int64)
                _wait(self._control.send([meta], self.peer, _TAG_META), 5.0, "closing")
            except ChannelError:
                pass
        self._closed.set()
        # Gloo cannot interrupt a pending recv on this end; dropping the last reference to a group closes
        # its sockets, which ends the peer's pending operations (and ours once the peer drops too).
        control, data, self._control, self._data = self._control, self._data, None, None
        destroy_group(control)
        if data is not control:
            destroy_group(data)

    def _guard(self, op):
        if self._closed.is_set():
            raise ChannelError(f"channel {self.name} is closed")
        if self._broken is not None:
            raise ChannelError(f"channel {self.name} is broken: {self._broken}")
        try:
            return op()
        except (ChannelError, RuntimeError) as e:  # gloo raises RuntimeError when posting on a dead pair
            self._broken = str(e)
            raise ChannelError(f"channel {self.name}: {e}") from e


def open_channel(store: dist.Store, channel_id: str, role: int, backend: GroupBackend | None = None,
                 connect_timeout_s: float = 30.0) -> KVChannel:
    """Both ends call this concurrently with the same `channel_id` and the same store (server or client)."""
    backend = backend or GlooBackend()
    control = build_group(store, f"chan/{channel_id}/control/", role, 2, GlooBackend(), connect_timeout_s)
    if backend.name == "gloo":
        data = control
    else:
        try:
            data = build_group(store, f"chan/{channel_id}/data/", role, 2, backend, connect_timeout_s)
        except ChannelError:
            destroy_group(control)
            raise
    return KVChannel(role, control, data, backend.device, name=channel_id)


def connect_channel(address: StoreAddress, channel_id: str, role: int, backend: GroupBackend | None = None,
                    connect_timeout_s: float = 30.0) -> KVChannel:
    """The end that does not host the store: connect to it, then `open_channel`."""
    return open_channel(connect_store(address, connect_timeout_s), channel_id, role, backend, connect_timeout_s)
