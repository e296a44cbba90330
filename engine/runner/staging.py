"""A step's host arrays reach the device in one copy.

Each step's inputs are a dozen or more small host arrays (token ids, positions, KV slots, block tables, lengths,
sampling columns). Copied one by one from pageable memory, each costs a `cudaMemcpyAsync` and a staging copy
on the host: about 18 per batch-1 step on an H200, where the step is host-bound (bench/results/gpu_check_cuda.md).
Here they are packed into one pinned buffer, copied once, and handed out as typed views of one device buffer
(vLLM keeps persistent pinned input buffers for the same reason). Measured there, this alone moved no figure
beyond the run-to-run spread (bench/results/staging_ab_cuda.md): the host's time goes elsewhere first.

Pinned buffers are reused round robin, each only after the copy that last read it has finished (an event per
buffer), so async scheduling may build the next step while the current one still runs. A CUDA graph's static inputs
keep the same layout (engine/runner/graphs.py), so a replay moves them in one device-to-device copy too.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

_ALIGN = 16  # every view starts at a multiple of the widest element (int64 / float32 need 8 and 4)
_RING = 4  # pinned buffers per device: the host can run this many steps ahead of the copies


class _PinnedRing:
    def __init__(self, device: torch.device):
        self.device = device
        self.buffers: list[torch.Tensor | None] = [None] * _RING
        self.events: list[torch.cuda.Event | None] = [None] * _RING
        self.next = 0

    def take(self, nbytes: int) -> tuple[torch.Tensor, int]:
        i = self.next
        self.next = (i + 1) % _RING
        if self.events[i] is not None:
            self.events[i].synchronize()  # the copy that last read this buffer is done (normally long ago)
        buf = self.buffers[i]
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(max(nbytes, 2 * (buf.numel() if buf is not None else 4096)), dtype=torch.uint8,
                              pin_memory=True)
            self.buffers[i] = buf
        return buf, i

    def copied(self, i: int) -> None:
        event = self.events[i] or torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        self.events[i] = event


_rings: dict[torch.device, _PinnedRing] = {}


class Staged(NamedTuple):
    buffer: torch.Tensor  # the packed uint8 buffer on the device
    tensors: list[torch.Tensor]  # one view of it per array
    layout: tuple[int, ...]  # each array's byte offset, then the size: equal layouts, equal views


def to_device(arrays: list[np.ndarray], device: torch.device) -> Staged:
    """The arrays on `device`, same shapes and dtypes (numpy's), through one host-to-device copy."""
    arrays = [np.ascontiguousarray(a) for a in arrays]
    offsets, total = layout(arrays)
    if device.type != "cuda":  # one packed buffer on a CPU too: the same views, so CPU tests cover them
        buf = torch.empty(total, dtype=torch.uint8)
        pack(arrays, offsets, buf.numpy())
        return Staged(buf, views(buf, arrays, offsets), (*offsets, total))
    ring = _rings.get(device)
    if ring is None:
        ring = _rings[device] = _PinnedRing(device)
    host, i = ring.take(total)
    pack(arrays, offsets, host.numpy())
    dev = torch.empty(total, dtype=torch.uint8, device=device)
    dev.copy_(host[:total], non_blocking=True)
    ring.copied(i)
    return Staged(dev, views(dev, arrays, offsets), (*offsets, total))


def layout(arrays: list[np.ndarray]) -> tuple[list[int], int]:
    """Each array's byte offset in the packed buffer, and the buffer's size (never 0)."""
    offsets, total = [], 0
    for a in arrays:
        offsets.append(total)
        total += -(-a.nbytes // _ALIGN) * _ALIGN
    return offsets, max(total, _ALIGN)


def pack(arrays: list[np.ndarray], offsets: list[int], flat: np.ndarray) -> None:
    for a, off in zip(arrays, offsets):
        flat[off : off + a.nbytes] = a.reshape(-1).view(np.uint8)


def views(buf: torch.Tensor, arrays: list[np.ndarray], offsets: list[int]) -> list[torch.Tensor]:
    """Typed views of the packed uint8 buffer, one per array (shape and dtype of the array)."""
    return [buf[off : off + a.nbytes].view(_TORCH[a.dtype]).view(a.shape) for a, off in zip(arrays, offsets)]


_TORCH = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32, np.dtype(np.float32): torch.float32,
          np.dtype(np.bool_): torch.bool, np.dtype(np.uint8): torch.uint8}



def in_buffer(t: torch.Tensor, buf: torch.Tensor) -> bool:
    """`t` is a view of the packed buffer `buf` (its storage)."""
    return t.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()


def rebase(t: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
    """The view of `buf` (another packed buffer of the same layout) that `t` is of its own buffer."""
    off = t.storage_offset() * t.element_size()  # a packed buffer starts its storage
    return buf[off : off + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
