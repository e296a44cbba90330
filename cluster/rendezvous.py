"""TCPStore rendezvous: a store server per receiving actor, clients per peer, and a handshake.

Building a gloo/NCCL group blocks until every member has published its address in the store, for as
long as the group's timeout. Groups that carry hand-overs use a long timeout (an idle channel must not
time out), so before building one both sides meet in the store under a short deadline: a peer that
never shows up costs `connect_timeout`, not the group's timeout.
"""
from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

from cluster.errors import ChannelError

if TYPE_CHECKING:
    import torch.distributed as dist

# torch.distributed loads with the first store, not with this module: the wire protocol's StoreAddress
# lives here, and the router reads the protocol without torch.


@dataclass(frozen=True, slots=True)
class StoreAddress:
    host: str
    port: int


def node_ip() -> str:
    """This node's address as other nodes reach it (Ray's view when Ray is up, else loopback)."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:  # pragma: no cover - ray is a dependency
        pass
    return "127.0.0.1"


class StoreServer:
    """A TCPStore master on an ephemeral port; peers connect to `address` with `connect_store`."""

    def __init__(self, host: str | None = None, timeout_s: float = 30.0):
        import torch.distributed as dist

        self.store = dist.TCPStore(
            "0.0.0.0", 0, None, True, timedelta(seconds=timeout_s), wait_for_workers=False)
        self.address = StoreAddress(host or node_ip(), self.store.port)


def connect_store(address: StoreAddress, timeout_s: float = 30.0) -> dist.TCPStore:
    import torch.distributed as dist

    try:
        return dist.TCPStore(address.host, address.port, None, False, timedelta(seconds=timeout_s))
    except (RuntimeError, dist.DistError) as e:
        raise ChannelError(f"cannot reach the store at {address.host}:{address.port}: {e}") from e


def handshake(store: dist.Store, rank: int, size: int, timeout_s: float) -> None:
    """Every member of a group-to-be announces itself and waits for the others, or ChannelError."""
    import torch.distributed as dist

    store.set(f"hello/{rank}", b"1")
    others = [f"hello/{r}" for r in range(size) if r != rank]
    try:
        store.wait(others, timedelta(seconds=timeout_s))
    except (RuntimeError, dist.DistError) as e:
        raise ChannelError(f"peer(s) did not join within {timeout_s:.0f}s: {e}") from e


def free_port_on(host: str = "") -> int:
    """A port that is free now (for servers that cannot bind port 0 themselves, like Serve's proxy)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
