"""TCPStore rendezvous: a store server per receiving actor, clients per peer, and a handshake.

Building a gloo/NCCL group blocks until every member has published its address in the store, for as
long as the group's timeout. Groups that carry hand-overs use a long timeout (an idle channel must not
time out), so before building one both sides meet in the store under a short deadline: a peer that
never shows up costs `connect_timeout`, not the group's timeout.

A TCPStore answers any client that reaches it (torch has no credential for it), so (docs/reliability.md,
"Exposure"):
- the server listens on this node's address only: loopback in the embedded default (cluster/runtime.py
  keeps Ray on loopback there), never the wildcard address torch binds by itself;
- every participant reads and writes through `SignedStore`, keyed by a per-store secret (handed to peers
  through Ray, whose control plane checks its token): keys live under a namespace derived from the secret,
  every value is encrypted and carries an HMAC of its key and ciphertext. A stranger can list the keys
  (torch's TCPStore answers `list_keys` to anyone) but reads only ciphertext: no address, port or NCCL unique
  id (whose bootstrap address and magic would let it into the group's set-up); and a forged or replayed entry
  (a value copied under another key, or from another store) is refused with `RendezvousForgeryError` before
  anyone trusts the address in it. What a stranger still can do is delete or overwrite entries: a group then
  fails to form (a ChannelError, never a wrong peer), so on a cluster the stores stay inside its firewall.

The cipher is HMAC-SHA256 in counter mode under a key derived from the secret, with a fresh 16-byte nonce per
value (a PRF keystream: no dependency beyond the standard library; values are a few hundred bytes, written
once per group).
"""
from __future__ import annotations

import hashlib
import hmac
import secrets
import socket
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING

from cluster.errors import ChannelError

if TYPE_CHECKING:
    import torch.distributed as dist

# torch.distributed loads with the first store, not with this module: the wire protocol's StoreAddress
# lives here, and the router reads the protocol without torch.


SECRET_BYTES = 32
MAC_BYTES = 32  # HMAC-SHA256
NONCE_BYTES = 16  # per value: a keystream is never reused, even for a key written twice


class RendezvousForgeryError(ChannelError):
    """A rendezvous entry whose MAC does not match: written by someone without the store's secret, or
    copied from another key. Nothing in it is trusted."""


@dataclass(frozen=True, slots=True)
class StoreAddress:
    host: str
    port: int
    secret: bytes = field(default=b"", repr=False)  # the store's signing secret; travels only through Ray


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
    """A TCPStore master on an ephemeral port of `host` (this node's address by default) with a fresh
    secret; peers connect to `address` with `connect_store`, and `store` is this side's signed view."""

    def __init__(self, host: str | None = None, timeout_s: float = 30.0):
        import torch.distributed as dist

        host = host or node_ip()
        # torch binds a TCPStore master to every interface; a socket bound here and handed over as
        # master_listen_fd keeps it on `host` alone.
        self._listener = socket.create_server((host, 0), backlog=128)
        port = self._listener.getsockname()[1]
        master = dist.TCPStore(host, port, None, True, timedelta(seconds=timeout_s), wait_for_workers=False,
                               master_listen_fd=self._listener.fileno())
        self.address = StoreAddress(host, port, secrets.token_bytes(SECRET_BYTES))
        self.store = SignedStore(master, self.address.secret)


def connect_store(address: StoreAddress, timeout_s: float = 30.0) -> dist.Store:
    import torch.distributed as dist

    if len(address.secret) != SECRET_BYTES:
        raise ChannelError(f"the store address {address.host}:{address.port} carries no secret: it was not made by "
                           f"a StoreServer of this Tandem version")
    try:
        client = dist.TCPStore(address.host, address.port, None, False, timedelta(seconds=timeout_s))
    except (RuntimeError, dist.DistError) as e:
        raise ChannelError(f"cannot reach the store at {address.host}:{address.port}: {e}") from e
    return SignedStore(client, address.secret)


def _signed_store_class():
    """`SignedStore` subclasses torch's Store (so gloo and NCCL build groups on it), and torch loads only
    when the first store is made: the class is built then."""
    import torch.distributed as dist

    class _SignedStore(dist.Store):
        """A store's keys under a secret namespace; each value stored as nonce + ciphertext + HMAC(secret, key,
        nonce + ciphertext)."""

        def __init__(self, inner: dist.Store, secret: bytes):
            super().__init__()
            self._inner = inner
            self._secret = secret
            self._cipher_key = hmac.new(secret, b"tandem-rendezvous-cipher", hashlib.sha256).digest()
            self._ns = hashlib.sha256(b"tandem-rendezvous-namespace/" + secret).hexdigest()[:32] + "/"

        def _mac(self, key: str, sealed: bytes) -> bytes:
            return hmac.new(self._secret, key.encode() + b"\0" + sealed, hashlib.sha256).digest()

        def _xor_keystream(self, nonce: bytes, data: bytes) -> bytes:
            blocks = b"".join(hmac.new(self._cipher_key, nonce + i.to_bytes(8, "big"), hashlib.sha256).digest()
                              for i in range(-(-len(data) // 32)))
            return (int.from_bytes(data, "big") ^ int.from_bytes(blocks[:len(data)], "big")).to_bytes(len(data), "big")

        def set(self, key: str, value) -> None:
            value = value.encode() if isinstance(value, str) else bytes(value)
            nonce = secrets.token_bytes(NONCE_BYTES)
            sealed = nonce + self._xor_keystream(nonce, value)
            self._inner.set(self._ns + key, sealed + self._mac(key, sealed))

        def get(self, key: str) -> bytes:
            raw = bytes(self._inner.get(self._ns + key))
            sealed, mac = raw[:-MAC_BYTES], raw[-MAC_BYTES:]
            if len(raw) < NONCE_BYTES + MAC_BYTES or not hmac.compare_digest(mac, self._mac(key, sealed)):
                raise RendezvousForgeryError(f"the rendezvous entry {key!r} is not signed with this store's secret "
                                             f"(forged, or copied from another key): refused")
            return self._xor_keystream(sealed[:NONCE_BYTES], sealed[NONCE_BYTES:])

        def add(self, key: str, amount: int) -> int:  # counters carry no address: namespaced only
            return self._inner.add(self._ns + key, amount)

        def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
            keys = [self._ns + k for k in keys]
            if timeout is None:
                self._inner.wait(keys)
            else:
                self._inner.wait(keys, timeout)

        def check(self, keys: list[str]) -> bool:
            return self._inner.check([self._ns + k for k in keys])

        def delete_key(self, key: str) -> bool:
            return self._inner.delete_key(self._ns + key)

        def num_keys(self) -> int:
            return self._inner.num_keys()

        def set_timeout(self, timeout: timedelta) -> None:
            self._inner.set_timeout(timeout)

        def compare_set(self, key: str, expected, desired) -> bytes:
            raise NotImplementedError("compare_set on a signed store (no caller in Tandem needs it)")

    return _SignedStore


_SIGNED_STORE = None


def SignedStore(inner: dist.Store, secret: bytes) -> dist.Store:  # noqa: N802 - a class, built lazily
    global _SIGNED_STORE
    if _SIGNED_STORE is None:
        _SIGNED_STORE = _signed_store_class()
    return _SIGNED_STORE(inner, secret)


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
