"""The rendezvous store: held in its owner's memory and reached through Ray only (nothing listens), torch's
Store semantics over it (gloo groups form on it), and peers told at once when its owner is gone."""
from __future__ import annotations

import threading
import uuid
from datetime import timedelta

import psutil
import pytest
import torch
import torch.distributed as dist

from cluster.channel import RECEIVER, SENDER, connect_channel, open_channel
from cluster.errors import ChannelError
from cluster.groups import GlooBackend, build_group
from cluster.rendezvous import (RENDEZVOUS_CONCURRENCY, StoreAddress, StoreOwnerGone, StoreServer, StoreTable,
                                connect_store, handshake)
from cluster.testing import returns


def _listening() -> set[tuple[str, int]]:
    return {(c.laddr.ip, c.laddr.port) for c in psutil.Process().net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN}


class StoreOwner:
    """An actor holding one store, with a single thread for its own calls: peers get through only if their
    calls run apart from them (RENDEZVOUS_CONCURRENCY)."""

    def __init__(self, timeout_s: float = 30.0):
        self.before = _listening()
        self.server = StoreServer(timeout_s)

    def address(self) -> StoreAddress:
        return self.server.address

    def new_listeners(self) -> list[tuple[str, int]]:
        return sorted(_listening() - self.before)

    def handshake(self, rank: int, size: int, timeout_s: float) -> None:
        handshake(self.server.store, rank, size, timeout_s)

    def get(self, key: str) -> bytes:
        return self.server.store.get(key)

    def gloo_sum(self, rank: int, size: int, value: float) -> float:
        group = build_group(self.server.store, "g/", rank, size, GlooBackend(), 60.0)
        x = torch.tensor([value])
        group.allreduce([x]).wait()
        return float(x.item())


def _owner(ray, timeout_s: float = 30.0):
    cls = ray.remote(num_cpus=0, max_concurrency=1, concurrency_groups=RENDEZVOUS_CONCURRENCY)(StoreOwner)
    return cls.remote(timeout_s)


@pytest.mark.ray
def test_a_store_listens_nowhere_in_its_owner(ray_session):
    """Regression (issue 39): each store was a TCPStore on the node's address, whose keys anyone could list,
    overwrite and delete (a stranger could stall a group forming)."""
    ray = ray_session
    owner = _owner(ray)
    assert ray.get(owner.new_listeners.remote()) == []
    before = _listening()
    server = StoreServer()
    connect_store(server.address)
    assert _listening() - before == set()


@pytest.mark.ray
def test_peers_meet_through_ray_while_the_owner_is_busy_meeting(ray_session):
    ray = ray_session
    owner = _owner(ray)
    address = ray.get(owner.address.remote())
    assert address.owner is not None
    meeting = owner.handshake.remote(0, 2, 60.0)  # the owner's only thread now blocks in the rendezvous
    peer = connect_store(address, timeout_s=60)
    returns(lambda: handshake(peer, 1, 2, 60.0), "the peer's handshake")
    ray.get(meeting, timeout=120)
    peer.set("addr/1", b"127.0.0.1:4242")
    assert ray.get(owner.get.remote("addr/1"), timeout=120) == b"127.0.0.1:4242"


@pytest.mark.ray
def test_a_gloo_group_forms_on_the_store_across_processes(ray_session):
    ray = ray_session
    owner = _owner(ray)
    address = ray.get(owner.address.remote())
    summed = owner.gloo_sum.remote(0, 2, 2.0)  # the owner's only thread: from here on it builds the group
    group = returns(lambda: build_group(connect_store(address, 60), "g/", 1, 2, GlooBackend(), 60.0),
                    "the peer's gloo group")
    x = torch.tensor([5.0])
    group.allreduce([x]).wait()
    assert float(x.item()) == ray.get(summed, timeout=120) == 7.0


@pytest.mark.ray
def test_store_semantics_match_torchs_hash_store(ray_session):
    """Each operation through the owner (a Ray call) and in the owner's process gives what torch's own
    in-memory store gives."""
    ray = ray_session
    owner = _owner(ray)
    remote, server, reference = connect_store(ray.get(owner.address.remote())), StoreServer(), dist.HashStore()
    for store in (remote, server.store, reference):
        store.set("a", b"1")
        store.set("s", "text")
        got = [store.get("a"), store.get("s"), store.add("n", 2), store.add("n", 3), store.get("n"),
               store.compare_set("a", b"1", b"2"), store.compare_set("a", b"1", b"3"), store.get("a"),
               store.compare_set("new", b"", b"v"), store.check(["a", "n"]), store.check(["a", "missing"]),
               store.num_keys(), store.delete_key("a"), store.delete_key("a"), store.check(["a"])]
        assert [bytes(g) if isinstance(g, (bytes, list)) else g for g in got] == [
            b"1", b"text", 2, 5, b"5", b"2", b"2", b"2", b"v", True, False, 4, True, False, False]


def test_a_missing_key_times_out_with_torchs_error():
    server = StoreServer(timeout_s=0.5)
    with pytest.raises(dist.DistStoreError, match="not set within"):
        server.store.get("never")
    with pytest.raises(ChannelError, match="did not join"):
        handshake(server.store, 0, 2, 0.5)
    table = StoreTable()
    assert not table.wait(["k"], 0.01)
    threading.Timer(0.05, table.set, ("k", b"")).start()
    assert table.wait(["k"], 60.0)


@pytest.mark.ray
def test_a_peer_learns_at_once_that_the_owner_died(ray_session):
    """A peer waiting in a store whose owner dies gets StoreOwnerGone from Ray, not its 10-minute deadline."""
    ray = ray_session
    owner = _owner(ray, timeout_s=600)
    address = ray.get(owner.address.remote())
    peer = connect_store(address, timeout_s=600)
    waiting: dict = {}

    def _wait():
        try:
            peer.wait(["never"], timedelta(seconds=600))
        except Exception as e:  # noqa: BLE001 - the test looks at what it was
            waiting["error"] = e

    t = threading.Thread(target=_wait, daemon=True)
    t.start()
    ray.kill(owner, no_restart=True)
    t.join(120)
    assert not t.is_alive() and isinstance(waiting.get("error"), StoreOwnerGone), waiting
    with pytest.raises(StoreOwnerGone):
        connect_store(address).set("late", b"")


def test_a_store_outside_ray_is_this_process_only():
    with pytest.raises(ChannelError, match="outside Ray"):
        connect_store(StoreAddress(None, uuid.uuid4().hex))


def test_a_channel_forms_in_one_process_without_ray():
    server = StoreServer()
    cid = uuid.uuid4().hex
    ends = {}
    t = threading.Thread(target=lambda: ends.setdefault("rx", open_channel(server.store, cid, RECEIVER,
                                                                           connect_timeout_s=10, preference="network")))
    t.start()
    tx = connect_channel(server.address, cid, SENDER, connect_timeout_s=10, preference="network")
    t.join(10)
    try:
        assert tx.transport == "gloo" and ends["rx"].transport == "gloo"
    finally:
        tx.close()
        ends["rx"].close()


def test_free_ports_are_distinct_and_never_handed_out_twice():
    """A Ray node binds eight ports; picked one at a time, two could come back equal (Ray then refuses to
    start). free_ports_on holds them together and never repeats a port within a process."""
    import socket

    from cluster.rendezvous import free_port_on, free_ports_on

    first = free_ports_on("", 8)
    later = [port for _ in range(20) for port in free_ports_on("", 8)] + [free_port_on("127.0.0.1")]
    assert len(set(first)) == 8
    assert len(set(later)) == len(later) and not set(first) & set(later)
    for port in first:  # free: each binds on every address
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", port))
