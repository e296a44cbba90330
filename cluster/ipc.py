"""Same-machine payload transport: the receiver reads the sender's memory instead of a socket or NCCL.

Two processes on one GPU cannot use NCCL between them (NCCL refuses two ranks on one device), and two
processes on one host gain nothing from a loopback socket. Here the sender shares its packed payload
and the receiver copies it straight into its KV blocks:
  - CUDA: a CUDA IPC handle of the payload's allocation (torch's `_share_cuda_`, the mechanism
    torch.multiprocessing uses), opened by the receiver with `_new_shared_cuda`; one device-to-device
    copy, no host round trip;
  - CPU: a file in /dev/shm that the sender owns and reuses (grown when a payload does not fit); the
    receiver maps it once and unlinks its name, so a killed sender leaves nothing behind.
Handles travel as msgpack over the channel's gloo control group (never pickle: a control port must not
run code). Per message: sender -> receiver the handles, receiver -> sender an acknowledgement once its
copy is complete on the device; the sender keeps the payload alive until then.

Which transport a channel uses is agreed when it opens (`choose_transport`, the same pure function on
both ends over both ends' `Place`), then proved with one small probe message before it is trusted.
"""
from __future__ import annotations

import mmap
import os
import socket
import uuid
from dataclasses import dataclass
from typing import Literal

import msgpack
import torch

from cluster.errors import ChannelError

TransportPreference = Literal["auto", "ipc", "network"]
_ALIGN = 256  # payload parts start on cache-line-and-then-some boundaries in the shared file


@dataclass(frozen=True, slots=True)
class Place:
    """Where one end of a channel keeps its payloads: a host (boot-unique) and a device."""
    host: str
    device: str  # "cpu" or the GPU's UUID (CUDA_VISIBLE_DEVICES renumbers, the UUID does not)
    preference: str = "auto"

    @staticmethod
    def here(device: torch.device, preference: TransportPreference = "auto") -> "Place":
        return Place(_host_id(), _device_id(device), preference)

    def to_wire(self) -> bytes:
        return msgpack.packb([self.host, self.device, self.preference])

    @staticmethod
    def from_wire(data: bytes) -> "Place":
        host, device, preference = msgpack.unpackb(data)
        return Place(host, device, preference)


def _host_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def _device_id(device: torch.device) -> str:
    if device.type != "cuda":
        return "cpu"
    return str(torch.cuda.get_device_properties(device).uuid)


def choose_transport(a: Place, b: Place, network: str) -> str:
    """'ipc' or `network` ('gloo' on CPU, 'nccl' on CUDA); symmetric, so both ends choose the same.

    - either end asks for 'network': network;
    - both ends on one GPU: ipc (NCCL cannot join two ranks on one device, so this is the only way);
    - both on one host's CPU: ipc when either end asks for it ('auto' keeps gloo there);
    - otherwise network.
    """
    if (a.device == "cpu") != (b.device == "cpu"):
        raise ChannelError(f"a channel joins a {a.device} end and a {b.device} end; both must be CPU or CUDA")
    if "network" in (a.preference, b.preference):
        return network
    if a.host == b.host and a.device == b.device:
        if a.device != "cpu" or "ipc" in (a.preference, b.preference):
            return "ipc"
    return network


# ------------------------------------------------------------------------------------------ handles
class CudaHandles:
    """Payload views shared as CUDA IPC handles of their allocations."""

    def __init__(self, device: torch.device):
        self.device = device

    def share(self, views: list[torch.Tensor]) -> list:
        wire = []
        for v in views:
            storage = v.untyped_storage()
            (dev, handle, size, offset, ref_handle, ref_offset, event, event_sync) = storage._share_cuda_()
            wire.append([dev, handle, size, offset, ref_handle, ref_offset, event, event_sync,
                         v.storage_offset() * v.element_size(), v.numel() * v.element_size()])
        return wire

    def copy_into(self, wire: list, out: list[torch.Tensor]) -> None:
        # The receiver's own device index: the sender's is its own, which may differ under
        # CUDA_VISIBLE_DEVICES; the UUIDs matched when the channel opened.
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        sources = []
        for (_dev, handle, size, offset, ref_handle, ref_offset, event, event_sync, start, nbytes), dst in zip(
                wire, out, strict=True):
            # Waits (on this stream) for the event the sender recorded when it shared the memory.
            storage = torch.UntypedStorage._new_shared_cuda(index, handle, size, offset, ref_handle, ref_offset,
                                                            event, event_sync)
            src = torch.empty(0, dtype=torch.uint8, device=self.device).set_(storage, start, (nbytes,), (1,))
            dst.copy_(src)
            sources.append(src)
        torch.cuda.current_stream(self.device).synchronize()
        # Only now drop the mappings (each drop releases the sender's reference count of its block).
        sources.clear()

    def close(self) -> None:
        pass


class HostSegment:
    """Sender: one reusable /dev/shm file; receiver: its mapping (re-made when the sender grows it)."""

    def __init__(self):
        self.path: str | None = None
        self.map: mmap.mmap | None = None
        self.size = 0

    # sender
    def share(self, views: list[torch.Tensor]) -> list:
        offsets, total = [], 0
        for v in views:
            offsets.append(total)
            total += -(-v.numel() * v.element_size() // _ALIGN) * _ALIGN
        if total > self.size:
            self._create(max(total, 2 * self.size))
        buf = torch.frombuffer(self.map, dtype=torch.uint8)
        parts = []
        for v, off in zip(views, offsets):
            n = v.numel() * v.element_size()
            buf[off:off + n].copy_(v.reshape(-1).view(torch.uint8))
            parts.append([off, n])
        del buf  # an exported buffer would keep the map from being closed
        return [self.path, self.size, parts]

    def _create(self, size: int) -> None:
        self.close()
        path = os.path.join(_shm_root(), f"{_PREFIX}{uuid.uuid4().hex}")
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
            self.map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.path, self.size = path, size

    # receiver
    def copy_into(self, wire: list, out: list[torch.Tensor]) -> None:
        path, size, parts = wire
        if path != self.path:
            self._attach(path, size)
        buf = torch.frombuffer(self.map, dtype=torch.uint8)
        for (off, n), dst in zip(parts, out, strict=True):
            dst.copy_(buf[off:off + n])
        del buf

    def _attach(self, path: str, size: int) -> None:
        # The name comes from the peer and is unlinked below: only ever one of our own segment files.
        name = os.path.basename(path)
        if os.path.dirname(path) != _shm_root() or not name.startswith(_PREFIX) or not name[len(_PREFIX):].isalnum():
            raise ChannelError(f"refusing shared memory outside {_shm_root()}/{_PREFIX}*: {path!r}")
        self.close()
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as e:
            raise ChannelError(f"cannot open the sender's shared memory {path}: {e}") from e
        try:
            self.map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.path, self.size = path, size
        # Both ends hold it mapped now: drop the name so that nothing outlives the two processes.
        self._unlink()

    def _unlink(self) -> None:
        if self.path is not None:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def close(self) -> None:
        self._unlink()
        if self.map is not None:
            self.map.close()
        self.map, self.path, self.size = None, None, 0


_PREFIX = "tandem-kv-"


def _shm_root() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else os.environ.get("TMPDIR", "/tmp")


def handles_for(device: torch.device) -> CudaHandles | HostSegment:
    return CudaHandles(device) if device.type == "cuda" else HostSegment()
