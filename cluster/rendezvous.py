"""Rendezvous over Ray: a key-value store held by a receiving actor, reached by its peers through Ray calls
only, and the handshake that makes group creation fail fast.

Building a gloo/NCCL group blocks until every member has published its address in the store, for as
long as the group's timeout. Groups that carry hand-overs use a long timeout (an idle channel must not
time out), so before building one both sides meet in the store under a short deadline: a peer that
never shows up costs `connect_timeout`, not the group's timeout.

Why not torch's TCPStore (issue 39; docs/reliability.md, "Exposure"): it has no credential, so anyone who
reaches its port lists, reads, overwrites and deletes entries, and can stall a group while it forms. Here
nothing listens. A store is a table in the memory of the actor that owns it (a DecodeRank, a ChannelProbe):
that process reads and writes it directly, and a peer reaches it with `__ray_call__` on the owner's actor
handle, a call Ray's control plane takes only from holders of the cluster's token. torch accepts a store
written in Python (a `dist.Store` subclass): gloo's and NCCL's process groups and `PrefixStore` call it.

An owner declares the concurrency group `RENDEZVOUS_GROUP` (`ray.remote(concurrency_groups=
RENDEZVOUS_CONCURRENCY)`), so its peers' calls never queue behind its own calls: a DecodeRank's `join` blocks
inside the very rendezvous its peers are calling into. A blocking read waits on the owner for at most
`WAIT_SLICE_S` per call and the peer calls again until its own deadline: a peer that dies mid-wait holds an
owner's thread for one slice, not for its deadline.
"""
from __future__ import annotations

import socket
import threading
import time
import uuid
import weakref
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

from cluster.errors import ChannelError

if TYPE_CHECKING:
    import torch.distributed as dist

# torch.distributed loads with the first store, not with this module: the wire protocol's StoreAddress
# lives here, and the router reads the protocol without torch.

RENDEZVOUS_GROUP = "tandem_rendezvous"
RENDEZVOUS_CONCURRENCY = {RENDEZVOUS_GROUP: 16}  # peers waiting at once: tp - 1 ranks plus channels opening
WAIT_SLICE_S = 1.0
CALL_TIMEOUT_S = 60.0  # one call to the owner: a slice of waiting plus a loaded machine's scheduling delays
DEFAULT_TIMEOUT_S = 30.0
# No rendezvous wait is longer. A group's own timeout (days: an idle channel must not time out) reaches the store
# as gloo's wait deadline, and a build abandoned after its peer went away would otherwise call the owner once a
# WAIT_SLICE_S for days.
LONGEST_WAIT = timedelta(minutes=10)


class StoreOwnerGone(ChannelError):
    """The actor holding a store died, or holds no store of that name (it restarted)."""


@dataclass(frozen=True, slots=True)
class StoreAddress:
    owner: object  # ray.actor.ActorHandle of the actor holding the store; None: only its own process reaches it
    name: str  # the store's name inside the owner's process


def node_ip() -> str:
    """This node's address as other nodes reach it (Ray's view when Ray is up, else loopback)."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:  # pragma: no cover - ray is a dependency
        pass
    return "127.0.0.1"


class StoreTable:
    """A store's entries, in the owner's process. Values are bytes; `add` keeps a counter as decimal text, as
    torch's stores do (a `get` of a counter reads it)."""

    def __init__(self) -> None:
        self._entries: dict[str, bytes] = {}
        self._changed = threading.Condition()

    def set(self, key: str, value: bytes) -> None:
        with self._changed:
            self._entries[key] = value
            self._changed.notify_all()

    def get(self, key: str, wait_s: float = 0.0) -> bytes | None:
        """The entry, waiting up to `wait_s` for it (None if it is not there by then)."""
        with self._changed:
            self._changed.wait_for(lambda: key in self._entries, max(wait_s, 0.0))
            return self._entries.get(key)

    def add(self, key: str, amount: int) -> int:
        with self._changed:
            total = int(self._entries.get(key, b"0")) + amount
            self._entries[key] = str(total).encode()
            self._changed.notify_all()
            return total

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        """torch's semantics: swap when the entry equals `expected` (or is absent and `expected` is empty);
        returns the entry afterwards (`expected` itself when absent and not swapped)."""
        with self._changed:
            current = self._entries.get(key)
            if current == expected or (current is None and expected == b""):
                self._entries[key] = desired
                self._changed.notify_all()
                return desired
            return expected if current is None else current

    def wait(self, keys: list[str], wait_s: float) -> bool:
        """Whether every key is present, waiting up to `wait_s` for them."""
        with self._changed:
            return self._changed.wait_for(lambda: all(k in self._entries for k in keys), max(wait_s, 0.0))

    def check(self, keys: list[str]) -> bool:
        with self._changed:
            return all(k in self._entries for k in keys)

    def delete_key(self, key: str) -> bool:
        with self._changed:
            return self._entries.pop(key, None) is not None

    def num_keys(self) -> int:
        with self._changed:
            return len(self._entries)


# The tables this process owns, by name: what a peer's `__ray_call__` finds them by. Weak: a table lives as
# long as its StoreServer.
_TABLES: weakref.WeakValueDictionary[str, StoreTable] = weakref.WeakValueDictionary()
_OPS = frozenset({"set", "get", "add", "compare_set", "wait", "check", "delete_key", "num_keys"})


def _on_owner(_actor, name: str, op: str, *args):
    """Runs in the owner's process (through `__ray_call__`): one operation on one of its tables."""
    table = _TABLES.get(name)
    if table is None:
        raise StoreOwnerGone(f"no rendezvous store {name!r} here (its owner restarted or closed it)")
    if op not in _OPS:
        raise ValueError(f"not a store operation: {op!r}")
    if op in ("wait", "get"):  # (keys or key, seconds): one slice at most
        return getattr(table, op)(args[0], min(args[1], WAIT_SLICE_S))
    return getattr(table, op)(*args)


class _RemoteTable:
    """A peer's view of a table held by another actor: each operation is one Ray call to the owner."""

    def __init__(self, address: StoreAddress):
        self._owner, self._name = address.owner, address.name

    def _call(self, op: str, *args):
        import ray

        method = self._owner.__ray_call__.options(concurrency_group=RENDEZVOUS_GROUP)
        try:
            return ray.get(method.remote(_on_owner, self._name, op, *args), timeout=CALL_TIMEOUT_S)
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
            raise StoreOwnerGone(f"the owner of rendezvous store {self._name!r} is gone: {e}") from e
        except ray.exceptions.GetTimeoutError as e:
            raise ChannelError(f"the owner of rendezvous store {self._name!r} did not answer within "
                               f"{CALL_TIMEOUT_S:.0f}s") from e
        except ray.exceptions.RayTaskError as e:
            cause = e.as_instanceof_cause()
            raise (cause if isinstance(cause, ChannelError) else ChannelError(str(e))) from e

    def set(self, key: str, value: bytes) -> None:
        self._call("set", key, value)

    def get(self, key: str, wait_s: float = 0.0) -> bytes | None:
        return self._call("get", key, min(wait_s, WAIT_SLICE_S))

    def add(self, key: str, amount: int) -> int:
        return self._call("add", key, amount)

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        return self._call("compare_set", key, expected, desired)

    def wait(self, keys: list[str], wait_s: float) -> bool:
        return self._call("wait", keys, min(wait_s, WAIT_SLICE_S))

    def check(self, keys: list[str]) -> bool:
        return self._call("check", keys)

    def delete_key(self, key: str) -> bool:
        return self._call("delete_key", key)

    def num_keys(self) -> int:
        return self._call("num_keys")


def _store_class():
    """`RayStore` subclasses torch's Store, and torch loads only when the first store is made: the class is
    built then."""
    import torch.distributed as dist

    class RayStore(dist.Store):
        """torch's Store API over a StoreTable, held here or by another actor. `get` and `wait` block until
        the keys are there or the timeout passes (DistStoreError, as torch's own stores raise)."""

        def __init__(self, table, timeout: timedelta):
            super().__init__()
            self._table = table
            self._timeout = timeout

        def set(self, key: str, value) -> None:
            self._table.set(key, value.encode() if isinstance(value, str) else bytes(value))

        def get(self, key: str) -> bytes:
            timeout = min(self._timeout, LONGEST_WAIT)
            deadline = time.monotonic() + timeout.total_seconds()
            while (value := self._table.get(key, deadline - time.monotonic())) is None:
                if time.monotonic() >= deadline:
                    raise dist.DistStoreError(f"rendezvous: key {key!r} not set within "
                                              f"{timeout.total_seconds():.0f}s")
            return value

        def add(self, key: str, amount: int) -> int:
            return self._table.add(key, int(amount))

        def compare_set(self, key: str, expected, desired) -> bytes:
            as_bytes = lambda v: v.encode() if isinstance(v, str) else bytes(v)  # noqa: E731
            return self._table.compare_set(key, as_bytes(expected), as_bytes(desired))

        def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
            timeout = min(self._timeout if timeout is None else timeout, LONGEST_WAIT)
            deadline = time.monotonic() + timeout.total_seconds()
            while not self._table.wait(list(keys), deadline - time.monotonic()):
                if time.monotonic() >= deadline:
                    raise dist.DistStoreError(f"rendezvous: keys {list(keys)} not set within "
                                              f"{timeout.total_seconds():.0f}s")

        def check(self, keys: list[str]) -> bool:
            return self._table.check(list(keys))

        def delete_key(self, key: str) -> bool:
            return self._table.delete_key(key)

        def num_keys(self) -> int:
            return self._table.num_keys()

        def set_timeout(self, timeout: timedelta) -> None:
            self._timeout = timeout

    return RayStore


_RAY_STORE = None


def _store(table, timeout_s: float) -> dist.Store:
    global _RAY_STORE
    if _RAY_STORE is None:
        _RAY_STORE = _store_class()
    return _RAY_STORE(table, timedelta(seconds=timeout_s))


def _current_actor():
    """This process's actor handle when it is a Ray actor, else None."""
    try:
        import ray
    except ImportError:  # pragma: no cover - ray is a dependency
        return None
    if not ray.is_initialized() or ray.get_runtime_context().get_actor_id() is None:
        return None
    return ray.get_runtime_context().current_actor


class StoreServer:
    """A store held in this process: `store` is this side's view, `address` what peers `connect_store` to
    (through Ray when this process is an actor, else from this process only).

    The actor must declare RENDEZVOUS_CONCURRENCY: Ray 2.60 ends an actor's process when a call names a
    concurrency group the actor lacks (a failed check in its concurrency_group_manager.cc), which its peers then
    see as StoreOwnerGone. An actor cannot read its own groups back, so this is not checked here."""

    def __init__(self, timeout_s: float = DEFAULT_TIMEOUT_S):
        self._table = StoreTable()
        name = uuid.uuid4().hex
        _TABLES[name] = self._table
        self.address = StoreAddress(_current_actor(), name)
        self.store = _store(self._table, timeout_s)


def connect_store(address: StoreAddress, timeout_s: float = DEFAULT_TIMEOUT_S) -> dist.Store:
    """A peer's view of the store at `address`. Each operation on it raises StoreOwnerGone once its owner is
    dead (Ray says so at once)."""
    table = _TABLES.get(address.name)
    if table is not None:  # held by this very process
        return _store(table, timeout_s)
    if address.owner is None:
        raise ChannelError(f"rendezvous store {address.name!r} is held by a process outside Ray: only that "
                           f"process can use it")
    return _store(_RemoteTable(address), timeout_s)  # a dead owner: StoreOwnerGone from the first call


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
    return free_ports_on(host, 1)[0]


_HANDED_OUT: set[int] = set()  # ports this process has given out: a later call never gives one again


def free_ports_on(host: str, count: int) -> list[int]:
    """`count` distinct ports, free now. The sockets are held open together while choosing, because a port
    taken and let go at once is free again for the kernel's next pick: two one-at-a-time picks for one Ray node
    can return the same port (Ray then refuses to start: "trying to use a port number ... used by other
    components"). Ports this process handed out before are skipped too, for nodes started one after another."""
    held: list[socket.socket] = []
    ports: list[int] = []
    try:
        for _ in range(count + 64):
            if len(ports) == count:
                break
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            held.append(s)
            s.bind((host, 0))
            port = s.getsockname()[1]
            if port not in _HANDED_OUT:
                ports.append(port)
        if len(ports) < count:
            raise OSError(f"found {len(ports)} of {count} free ports on {host or 'every address'}")
        _HANDED_OUT.update(ports)
        return ports
    finally:
        for s in held:
            s.close()
