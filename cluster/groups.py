"""Standalone torch.distributed process groups built from a store, without `init_process_group`.

A group here is just a ProcessGroup object: pairwise channels and tensor-parallel groups can be made
and dropped at any time, by any actors, with no global world. The backend is a small strategy object:
gloo for CPU tensors, NCCL for CUDA tensors (siblings behind `GroupBackend`).

Gloo fixes an operation's deadline when the group is built, and an operation that times out closes
the connection for good. Groups are therefore built with a long `idle_timeout` (a channel may sit idle
for hours) and callers pass explicit deadlines to `Work.wait` where an operation must not hang.
"""
from __future__ import annotations

import secrets
import threading
from abc import ABC, abstractmethod
from datetime import timedelta

import torch
import torch.distributed as dist

from cluster.errors import ChannelError
from cluster.nccl_env import pin_nccl_sockets
from cluster.rendezvous import handshake, node_ip

IDLE_TIMEOUT = timedelta(days=7)
PROOF_BYTES = 16
PROOF_TAG = 0x7A6E  # the p2p tag of the proofs: no other message is in flight while a group forms


class GroupBackend(ABC):
    """Builds process groups for one kind of device."""

    name: str

    @abstractmethod
    def build(self, store: dist.Store, rank: int, size: int, timeout: timedelta) -> dist.ProcessGroup: ...

    @property
    @abstractmethod
    def device(self) -> torch.device: ...


class GlooBackend(GroupBackend):
    name = "gloo"

    def build(self, store, rank, size, timeout):
        # Gloo's pairs listen on the address its device resolves, by default the hostname's (a routable one);
        # bound to this node's address they stay on loopback in the embedded default (runtime.py).
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=node_ip())]
        group = dist.ProcessGroupGloo(store, rank, size, opts)
        prove_members(store, group, rank, size)
        return group

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")


def prove_members(store: dist.Store, group: dist.ProcessGroup, rank: int, size: int) -> None:
    """Every pair of a gloo group leads to the member the store says it does, or ChannelError.

    Gloo's listener hands an incoming connection to whichever pair waits for the sequence number it writes first
    (a small counter; gloo `transport/tcp/listener.cc`), with no credential: a stranger who reaches the port while
    the group forms can take a pair's place and write into it. So before anything goes over the group, each
    member sends every other one, over their pair, a random proof it put in the store, which only members reach
    (cluster/rendezvous.py: through Ray); a pair that delivers anything else, or nothing, fails the group.
    """
    mine = secrets.token_bytes(PROOF_BYTES)
    store.set(f"proof/{rank}", mine)
    peers = [r for r in range(size) if r != rank]
    outgoing = torch.frombuffer(bytearray(mine), dtype=torch.uint8)
    received = {r: torch.empty(PROOF_BYTES, dtype=torch.uint8) for r in peers}
    works = [group.send([outgoing], r, PROOF_TAG) for r in peers]
    works += [group.recv([received[r]], r, PROOF_TAG) for r in peers]
    for work in works:
        work.wait()  # bounded by the caller: build_group runs this on a helper thread it waits for
    for r in peers:
        if received[r].numpy().tobytes() != store.get(f"proof/{r}"):
            raise ChannelError(f"the gloo pair to rank {r} leads to someone else (a stranger took its place while "
                               f"the group formed): refused")


class NcclBackend(GroupBackend):
    name = "nccl"

    def __init__(self, device: torch.device):
        if not hasattr(dist, "ProcessGroupNCCL"):
            raise ChannelError("this torch build has no NCCL; use the gloo backend on CPU")
        self._device = device

    def build(self, store, rank, size, timeout):
        # NCCL's bootstrap and socket transport on the interface of this node's address, as gloo's pairs are
        # (cluster/nccl_env.py); NCCL reads it when the process's first communicator forms, i.e. here.
        pin_nccl_sockets(node_ip())
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        pg = dist.ProcessGroupNCCL(store, rank, size, opts)
        # Connect now, on the transfer device, rather than lazily inside the first send.
        pg.eager_connect_single_device(self._device)
        return pg

    @property
    def device(self) -> torch.device:
        return self._device


def backend_for(device: torch.device | str) -> GroupBackend:
    device = torch.device(device)
    if device.type == "cuda":
        return NcclBackend(device)
    return GlooBackend()


def build_group(store: dist.Store, prefix: str, rank: int, size: int, backend: GroupBackend,
                connect_timeout_s: float = 30.0, idle_timeout: timedelta = IDLE_TIMEOUT) -> dist.ProcessGroup:
    """Meet the other members under `prefix` in `store`, then build the group; ChannelError on failure.

    The build runs on a helper thread so that a peer dying between the handshake and the build costs
    `connect_timeout_s` here rather than the group's idle timeout (the helper is then abandoned).
    """
    scoped = dist.PrefixStore(prefix, store)
    handshake(scoped, rank, size, connect_timeout_s)
    result: dict = {}

    def _build() -> None:
        try:
            result["group"] = backend.build(scoped, rank, size, idle_timeout)
        except Exception as e:  # noqa: BLE001 - re-raised on the caller's thread
            result["error"] = e

    helper = threading.Thread(target=_build, name=f"build-group-{prefix}", daemon=True)
    helper.start()
    helper.join(connect_timeout_s)
    if helper.is_alive():
        raise ChannelError(f"building the {backend.name} group {prefix!r} took over {connect_timeout_s:.0f}s")
    if "error" in result:
        raise ChannelError(f"building the {backend.name} group {prefix!r} failed: {result['error']}") from result["error"]
    return result["group"]


def destroy_group(group: dist.ProcessGroup | None) -> None:
    """Abort pending operations (they raise on their threads) and drop the group's connections."""
    if group is None:
        return
    try:
        group.abort()
    except Exception:  # noqa: BLE001 - an already broken group may refuse; it is being dropped anyway
        pass
