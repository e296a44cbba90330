"""Shared-memory collectives for tensor-parallel ranks of one CPU host.

Gloo's all-reduce of a decode step's small activations costs 0.4-0.7 ms of wall time and 0.25-0.45 ms of CPU
in each rank on a 2-core x86 host, against 17-46 us here (bench/results/shm_collectives_cpu.md): the call
goes through gloo's worker and transport threads and the loopback TCP stack. A tp=2 step of the zoo target makes ~26 of them
(two per layer, the vocab-parallel logits, and the draft head's), several times the step's own compute. The
ranks of a CPU decode group normally share a host: then every rank copies its tensor into its slot of one
shared mapping, publishes the collective's number, waits until every rank has published it, and reads the
result from all slots: a few microseconds of copies and no system call while the ranks run in step. vLLM's
and SGLang's CPU backends do the same with C++ spin loops; here the wait spins briefly, then yields the core,
then sleeps, so a rank that is behind (descheduled on a small shared host) is not starved by its partner.

Every rank computes the reduction over the same slots in the same order, so all ranks get bit-identical
results (what the tensor-parallel engine needs: its ranks must take the same sampling decisions).

Two buffers alternate by collective number: a rank writes collective n + 1 while a slower one still reads n,
and cannot reach n + 2 (the buffer of n) before every rank has published n + 1, which each does only after
reading n. Publication order relies on the x86 memory model (stores are seen in program order, loads are not
reordered with loads); other machines use gloo (`available()`). A tensor larger than a slot also goes
through gloo; all ranks see the same shapes, so they all take the same path.
"""
from __future__ import annotations

import logging
import mmap
import os
import platform
import secrets
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

LINE = 128  # bytes per rank's counter: ranks never write the same cache line
NONCE = 16
DEFAULT_SLOT_BYTES = 4 * 2**20
MAX_SLOT_BYTES = 32 * 2**20  # per rank and buffer; larger collectives (long prefill chunks) go through gloo
SPIN_S = 50e-6  # busy-wait this long (ranks in step meet within microseconds)
YIELD_S = 2e-3  # then yield the core to whoever is runnable (often the rank being waited for)
SLEEP_S = 50e-6  # then poll at this period: a rank that is far behind costs its partner nothing


class ShmCollectivesError(RuntimeError):
    """A rank did not reach a collective within the deadline (it died, or is stuck)."""


def available() -> bool:
    return platform.system() == "Linux" and platform.machine() in ("x86_64", "AMD64") and os.path.isdir("/dev/shm")


class ShmCollectives:
    """One mapping shared by `size` ranks: counters, then two buffers of `size` slots."""

    def __init__(self, mapping: mmap.mmap, rank: int, size: int, slot_bytes: int, timeout_s: float):
        self.rank, self.size, self.slot_bytes, self.timeout_s = rank, size, slot_bytes, timeout_s
        self._map = mapping
        self._counters = np.ndarray((size, LINE // 8), dtype=np.int64, buffer=mapping, offset=NONCE)[:, 0]
        data = torch.frombuffer(mapping, dtype=torch.uint8, offset=_data_offset(size),
                                count=2 * size * slot_bytes)
        self._buffers = data.view(2, size, slot_bytes)
        self._n = 0  # collectives done (the same on every rank)

    @staticmethod
    def nbytes(size: int, slot_bytes: int) -> int:
        return _data_offset(size) + 2 * size * slot_bytes

    @property
    def calls(self) -> int:
        """Collectives made so far."""
        return self._n

    def fits(self, x: torch.Tensor) -> bool:
        return x.device.type == "cpu" and x.numel() * x.element_size() <= self.slot_bytes

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of every rank's x, in place (x's shape and dtype on every rank; fits(x))."""
        parts = self._exchange(x)
        if x.is_contiguous():
            torch.sum(parts, dim=0, out=x)
        else:
            x.copy_(parts.sum(dim=0))
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x, concatenated along the last dimension in rank order (a new tensor: the slots are
        reused two collectives later)."""
        parts = self._exchange(x)  # [size, *shape]
        out = x.new_empty(*x.shape[:-1], self.size * x.shape[-1])
        out.view(*x.shape[:-1], self.size, x.shape[-1]).copy_(parts.movedim(0, -2))
        return out

    def all_gather_rows(self, out: torch.Tensor, x: torch.Tensor) -> None:
        """Attention data parallelism's row exchange: rank r's x [P, ...] into out[r * P:(r + 1) * P]
        (out [size * P, ...]; fits(x))."""
        parts = self._exchange(x)  # [size, P, ...]
        out.view(self.size, *x.shape).copy_(parts)

    def reduce_scatter_rows(self, out: torch.Tensor, x: torch.Tensor) -> None:
        """out [P, ...] = the sum over ranks of their x[rank * P:(rank + 1) * P] (x [size * P, ...]; fits(x)).
        Each rank sums only its own rows, in rank order."""
        parts = self._exchange(x).view(self.size, self.size, *out.shape)  # [from rank, to rank, P, ...]
        torch.sum(parts[:, self.rank], dim=0, out=out)

    def _exchange(self, x: torch.Tensor) -> torch.Tensor:
        """Publish x and wait for every rank's; a view [size, *x.shape] of all of them (valid until the
        collective after next)."""
        self._n += 1
        n = self._n
        nbytes = x.numel() * x.element_size()
        slots = self._buffers[n & 1][:, :nbytes].view(x.dtype).view(self.size, *x.shape)
        slots[self.rank].copy_(x)
        self._counters[self.rank] = n
        self._wait(n)
        return slots

    def _wait(self, n: int) -> None:
        counters = self._counters
        if counters.min() >= n:
            return
        start = time.perf_counter()
        while counters.min() < n:
            waited = time.perf_counter() - start
            if waited < SPIN_S:
                continue
            if waited < YIELD_S:
                os.sched_yield()
                continue
            if waited > self.timeout_s:
                late = [r for r in range(self.size) if counters[r] < n]
                raise ShmCollectivesError(f"tp rank(s) {late} did not reach collective {n} within "
                                          f"{self.timeout_s:.0f}s (rank died or is stuck)")
            time.sleep(SLEEP_S)


def slot_bytes_for(rows: int, width: int, itemsize: int = 4) -> int:
    """A slot for a step of `rows` rows of `width` values (the widest of the hidden size and a rank's share
    of the vocabulary), within [1 MiB, MAX_SLOT_BYTES]."""
    return min(MAX_SLOT_BYTES, max(2**20, -(-rows * width * itemsize // 4096) * 4096))


def _data_offset(size: int) -> int:
    return -(-(NONCE + size * LINE) // 4096) * 4096  # page-aligned slots


def connect(store: dist.Store, prefix: str, rank: int, size: int, slot_bytes: int = DEFAULT_SLOT_BYTES,
            timeout_s: float = 60.0) -> ShmCollectives | None:
    """Set up shared-memory collectives for the ranks meeting under `prefix` in `store`, or None on every
    rank if any rank cannot map the segment (another host or container, no /dev/shm space, not x86): the
    caller then keeps its process group for everything. Collective over the ranks (each must call it)."""
    store = dist.PrefixStore(f"{prefix}shm/", store)  # the caller's store keeps its own timeout

    def get(key: str) -> bytes:
        store.wait([key], timedelta(seconds=timeout_s))
        return store.get(key)

    mapping, error = None, "not x86 Linux with /dev/shm" if not available() else "rank 0 has no segment"
    if rank == 0:
        name, nonce = f"tandem-tp-{secrets.token_hex(8)}", secrets.token_bytes(NONCE)
        try:
            mapping = _create(name, nonce, ShmCollectives.nbytes(size, slot_bytes)) if available() else None
        except OSError as e:
            error = str(e)
        store.set("name", name if mapping is not None else "")
        store.set("nonce", nonce)
    else:
        name, nonce = get("name").decode(), get("nonce")
        if name and available():
            try:
                mapping = _attach(name, nonce, ShmCollectives.nbytes(size, slot_bytes))
            except OSError as e:
                error = str(e)
    store.set(f"ok/{rank}", b"" if mapping is not None else error.encode())
    answers = [get(f"ok/{r}").decode() for r in range(size)]  # every rank has tried to attach by now
    if rank == 0 and mapping is not None:  # nobody opens it by name again: unlink (no leak after a crash)
        try:
            os.unlink(f"/dev/shm/{name}")
        except OSError:
            pass
    refusals = [f"rank {r}: {a}" for r, a in enumerate(answers) if a]
    if refusals:
        if mapping is not None:
            mapping.close()
        log.warning("tp ranks under %r cannot share memory (%s); their collectives go through the process "
                    "group", prefix, "; ".join(refusals))
        return None
    return ShmCollectives(mapping, rank, size, slot_bytes, timeout_s)


def _create(name: str, nonce: bytes, nbytes: int) -> mmap.mmap:
    path = f"/dev/shm/{name}"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        # Reserve the pages now: a tmpfs too small for the segment fails here with ENOSPC, not later with
        # SIGBUS at the first touch of a missing page.
        os.posix_fallocate(fd, 0, nbytes)
        mapping = mmap.mmap(fd, nbytes)
    except OSError:
        os.close(fd)
        os.unlink(path)
        raise
    os.close(fd)
    mapping[:NONCE] = nonce
    return mapping


def _attach(name: str, nonce: bytes, nbytes: int) -> mmap.mmap:
    fd = os.open(f"/dev/shm/{name}", os.O_RDWR)
    try:
        mapping = mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)
    if mapping[:NONCE] != nonce:  # a file of that name, but not rank 0's segment (another /dev/shm)
        mapping.close()
        raise OSError(f"/dev/shm/{name} is not the segment rank 0 created")
    return mapping
