"""The rendezvous store: listens on its host alone, and only holders of its secret can read or write
entries anyone trusts (a stranger's writes are invisible, what it lists and reads is ciphertext, a forged or
replayed entry is refused)."""
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
from cluster.rendezvous import RendezvousForgeryError, StoreAddress, StoreServer, connect_store, handshake


def _listening(port: int) -> list[str]:
    return [c.laddr.ip for c in psutil.Process().net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port]


def _stranger(address: StoreAddress) -> dist.TCPStore:
    """A client without the secret, as anyone who reaches the port is."""
    return dist.TCPStore(address.host, address.port, None, False, timedelta(seconds=5))


def test_the_store_listens_on_its_host_only():
    server = StoreServer(host="127.0.0.1")
    assert _listening(server.address.port) == ["127.0.0.1"]  # torch alone would bind every interface


def test_peers_with_the_secret_meet_and_a_strangers_writes_change_nothing():
    server = StoreServer(host="127.0.0.1")
    stranger = _stranger(server.address)
    for key in ("hello/0", "hello/1", "tp/hello/1", "0", "1"):  # the plain names a group would use
        stranger.set(key, b"203.0.113.9:1")
    peer = connect_store(server.address, timeout_s=30)
    done = threading.Thread(target=handshake, args=(server.store, 0, 2, 30.0))
    done.start()
    handshake(peer, 1, 2, 30.0)
    done.join(30)
    assert not done.is_alive()
    peer.set("addr/1", b"127.0.0.1:4242")
    assert server.store.get("addr/1") == b"127.0.0.1:4242"
    assert stranger.get("hello/1") == b"203.0.113.9:1"  # its own write, never read by the group


def test_a_channel_forms_beside_a_stranger_in_the_store():
    server = StoreServer(host="127.0.0.1")
    _stranger(server.address).set("junk", b"x" * 64)
    cid = uuid.uuid4().hex
    ends = {}
    t = threading.Thread(target=lambda: ends.setdefault("rx", open_channel(server.store, cid, RECEIVER,
                                                                           connect_timeout_s=10, preference="network")))
    t.start()
    tx = connect_channel(server.address, cid, SENDER, connect_timeout_s=10, preference="network")
    t.join(10)
    rx, got = ends["rx"], {}

    def _receive():
        got["msg"] = rx.recv_header()
        rx.answer(True)
        got["payload"] = rx.recv_payload(got["msg"])

    try:
        assert tx.transport == "gloo"
        x = torch.arange(6.0)
        receiver = threading.Thread(target=_receive)
        receiver.start()
        tx.send_header({"request_id": "r"}, [x])
        assert tx.wait_answer(timeout_s=10)
        tx.send_payload([x])
        receiver.join(10)
        assert torch.equal(got["payload"][0], x)
    finally:
        tx.close()
        ends["rx"].close()


def test_a_stranger_lists_the_keys_but_reads_only_ciphertext():
    """Regression (issue 39): torch's TCPStore answers `list_keys` to any client, so a stranger found the
    namespaced keys and read every address (and would read an NCCL unique id) in clear."""
    server = StoreServer(host="127.0.0.1")
    secrets_written = {"addr/0": b"127.0.0.1:4242", "nccl/id": bytes(range(128)), "empty": b""}
    for key, value in secrets_written.items():
        server.store.set(key, value)
    raw = _stranger(server.address)
    (ns,) = {key.rsplit("/", 2)[0] for key in raw.list_keys() if key.endswith("addr/0")}
    for key, value in secrets_written.items():
        seen = bytes(raw.get(f"{ns}/{key}"))
        assert len(seen) == 16 + len(value) + 32  # nonce, ciphertext, MAC
        assert not value or value[:8] not in seen
    server.store.set("addr/0", b"127.0.0.1:4242")
    first = bytes(raw.get(f"{ns}/addr/0"))
    server.store.set("addr/0", b"127.0.0.1:4242")
    assert bytes(raw.get(f"{ns}/addr/0")) != first  # a fresh nonce: equal values do not show as equal
    assert {key: server.store.get(key) for key in secrets_written} == secrets_written


def test_a_forged_entry_is_refused_with_a_typed_error():
    """A stranger lists the namespace (not the secret) and overwrites an address: the reader refuses it."""
    server = StoreServer(host="127.0.0.1")
    server.store.set("addr/0", b"127.0.0.1:4242")
    raw = _stranger(server.address)
    (key,) = raw.list_keys()
    raw.set(key, b"203.0.113.9:4242" + b"\0" * 48)
    with pytest.raises(RendezvousForgeryError, match="addr/0"):
        server.store.get("addr/0")


def test_a_replayed_entry_is_refused():
    """A genuine signed value copied under another key (or from another store) is not trusted there."""
    server, other = StoreServer(host="127.0.0.1"), StoreServer(host="127.0.0.1")
    server.store.set("addr/0", b"127.0.0.1:4242")
    other.store.set("addr/0", b"127.0.0.1:4343")
    raw = _stranger(server.address)
    (key,) = raw.list_keys()
    genuine = raw.get(key)
    raw.set(key.replace("addr/0", "addr/1"), genuine)
    with pytest.raises(RendezvousForgeryError):
        server.store.get("addr/1")
    other_raw = _stranger(other.address)
    other_raw.set(other_raw.list_keys()[0], genuine)
    with pytest.raises(RendezvousForgeryError):
        other.store.get("addr/0")


def test_an_address_without_its_secret_is_refused_before_connecting():
    server = StoreServer(host="127.0.0.1")
    with pytest.raises(ChannelError, match="no secret"):
        connect_store(StoreAddress(server.address.host, server.address.port), timeout_s=5)


def test_the_secret_stays_out_of_logs():
    server = StoreServer(host="127.0.0.1")
    assert server.address.secret.hex() not in repr(server.address)
