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

Where both ends share a device (one GPU, or one host's CPU when asked for), step 3 is instead shared
memory (cluster.ipc): the sender sends handles over the control group, the receiver copies from the
sender's memory and acknowledges. `KVChannel.transport` says which one a channel uses ('gloo', 'nccl' or
'ipc'), so a deployment can show, and a test can assert, that no silent fallback happened.
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
from cluster.ipc import Place, TransportPreference, choose_transport, handles_for
from cluster.rendezvous import StoreAddress, connect_store

SENDER, RECEIVER = 0, 1
_MAGIC_MESSAGE = 0x7A6E_4B56  # "KV" message follows
_MAGIC_CLOSE = 0x7A6E_C105  # the sender is closing the channel
_TAG_META, _TAG_HEADER, _TAG_ANSWER, _TAG_IPC, _TAG_IPC_ACK, _TAG_PAYLOAD = 1, 2, 3, 5, 6, 16


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

    def __init__(self, role: int, control: dist.ProcessGroup, data: dist.ProcessGroup | None, device: torch.device,
                 name: str = "", transport: str = "gloo"):
        self.role = role
        self.peer = RECEIVER if role == SENDER else SENDER
        self.device = device
        self.name = name
        self.transport = transport  # gloo | nccl | ipc: what the payloads actually travel over
        self.stats = TransferStats()
        self._control = control
        self._data = data  # None with ipc: payloads go through shared memory, handles over `control`
        self._shared = handles_for(device) if transport == "ipc" else None
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
        start = time.perf_counter()
        if self._shared is not None:
            body = msgpack.packb(self._shared.share(views), use_bin_type=True)
            self._guard(lambda: self._send_frame(body, _TAG_IPC, 60.0, "sending payload handles"))
            return PendingSend(views, [], start)
        works = self._guard(lambda: [self._data.send([v], self.peer, _TAG_PAYLOAD + i) for i, v in enumerate(views)])
        return PendingSend(views, works, start)

    def finish_payload(self, pending: "PendingSend", timeout_s: float = 60.0) -> None:
        def _finish():
            for w in pending.works:
                _wait(w, timeout_s, "sending the payload")
            if self._shared is not None:  # the receiver has copied out of our memory: it may be reused
                ack = torch.zeros(1, dtype=torch.int64)
                _wait(self._control.recv([ack], self.peer, _TAG_IPC_ACK), timeout_s, "waiting for the payload copy")
                if not ack.item():
                    raise ChannelError("the receiver could not read the shared payload")
            elif self.device.type == "cuda":
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
            if self._shared is not None:
                self._recv_shared(out, timeout_s)
                return
            works = [self._data.recv([_as_bytes(t)], self.peer, _TAG_PAYLOAD + i) for i, t in enumerate(out)]
            for w in works:
                _wait(w, timeout_s, "receiving the payload")
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()

        self._guard(_recv)
        self.stats.record(sum(t.numel() * t.element_size() for t in out), time.perf_counter() - start)
        return out

    def _recv_shared(self, out: list[torch.Tensor], timeout_s: float) -> None:
        body = self._recv_frame(_TAG_IPC, timeout_s, "receiving payload handles")
        try:
            self._shared.copy_into(msgpack.unpackb(body, raw=False), [_as_bytes(t) for t in out])
        except Exception as e:
            _wait(self._control.send([torch.zeros(1, dtype=torch.int64)], self.peer, _TAG_IPC_ACK), timeout_s,
                  "refusing the payload")
            raise ChannelError(f"reading the sender's shared payload failed: {e}") from e
        _wait(self._control.send([torch.ones(1, dtype=torch.int64)], self.peer, _TAG_IPC_ACK), timeout_s,
              "acknowledging the payload")

    # Payload handles travel as one fixed-size frame (length, then msgpack): one message instead of a length
    # and a body, which is most of what shared memory costs on small payloads. A hand-over has a few
    # tensors, a handle a few hundred bytes.
    _FRAME = 16384

    def _send_frame(self, body: bytes, tag: int, timeout_s: float, what: str) -> None:
        if len(body) + 8 > self._FRAME:
            raise ChannelError(f"{what}: {len(body)} bytes of handles do not fit a {self._FRAME}-byte frame")
        frame = torch.zeros(self._FRAME, dtype=torch.uint8)
        frame[:8].view(torch.int64)[0] = len(body)
        frame[8:8 + len(body)] = torch.frombuffer(bytearray(body), dtype=torch.uint8)
        _wait(self._control.send([frame], self.peer, tag), timeout_s, what)

    def _recv_frame(self, tag: int, timeout_s: float, what: str) -> bytes:
        frame = torch.empty(self._FRAME, dtype=torch.uint8)
        _wait(self._control.recv([frame], self.peer, tag), timeout_s, what)
        n = int(frame[:8].view(torch.int64)[0])
        return frame[8:8 + n].numpy().tobytes()

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
        if self._shared is not None:
            self._shared.close()

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
                 connect_timeout_s: float = 30.0, preference: TransportPreference = "auto") -> KVChannel:
    """Both ends call this concurrently with the same `channel_id` and the same store (server or client).

    The ends agree on the payload transport (cluster.ipc.choose_transport over both ends' places and
    preferences); shared memory is proved with one probe message before the channel is returned.
    """
    backend = backend or GlooBackend()
    control = build_group(store, f"chan/{channel_id}/control/", role, 2, GlooBackend(), connect_timeout_s)
    try:
        mine = Place.here(backend.device, preference)
        theirs = _exchange_places(dist.PrefixStore(f"chan/{channel_id}/place/", store), role, mine, connect_timeout_s)
        transport = choose_transport(mine, theirs, backend.name)
        if transport == "ipc":
            channel = KVChannel(role, control, None, backend.device, name=channel_id, transport="ipc")
            _probe(channel, connect_timeout_s)
            return channel
        data = control if backend.name == "gloo" else build_group(store, f"chan/{channel_id}/data/", role, 2,
                                                                   backend, connect_timeout_s)
    except Exception:
        destroy_group(control)
        raise
    return KVChannel(role, control, data, backend.device, name=channel_id, transport=backend.name)


def _exchange_places(store: dist.Store, role: int, mine: Place, timeout_s: float) -> Place:
    store.set(str(role), mine.to_wire())
    other = str(RECEIVER if role == SENDER else SENDER)
    try:
        store.wait([other], timedelta(seconds=timeout_s))
    except (RuntimeError, dist.DistError) as e:
        raise ChannelError(f"the channel's other end did not say where it is within {timeout_s:.0f}s: {e}") from e
    return Place.from_wire(store.get(other))


_PROBE_BYTES = 4096


def _probe(channel: KVChannel, timeout_s: float) -> None:
    """One small shared-memory payload both ways of the protocol: proves that the receiver can open the
    sender's memory (another container, another GPU context) before any request depends on it."""
    expected = (torch.arange(_PROBE_BYTES, dtype=torch.int64) % 251).to(torch.uint8).to(channel.device)
    if channel.role == SENDER:
        channel.finish_payload(channel.post_payload([expected]), timeout_s)
    else:
        got = channel.recv_payload(Message(b"", (TensorSpec.of(expected),)), timeout_s=timeout_s)[0]
        if not torch.equal(got, expected):
            raise ChannelError("the shared-memory probe arrived corrupted")
    channel.stats = TransferStats()  # the probe is not a hand-over


def connect_channel(address: StoreAddress, channel_id: str, role: int, backend: GroupBackend | None = None,
                    connect_timeout_s: float = 30.0, preference: TransportPreference = "auto") -> KVChannel:
    """The end that does not host the store: connect to it, then `open_channel`."""
    return open_channel(connect_store(address, connect_timeout_s), channel_id, role, backend, connect_timeout_s,
                        preference)
