"""Shared-memory hand-over transport: which transport two ends agree on, and the shared file's life.

The channel's content tests (tests/cluster/test_channel.py, test_channel_ray.py) run over both gloo and
shared memory; these check what is particular to the latter. CUDA IPC is the same protocol with another
handle kind; it is tested on a GPU in tests/integration/.
"""
from __future__ import annotations

import os
import threading

import pytest
import torch

from cluster.errors import ChannelError
from cluster.ipc import Place, choose_transport
from cluster.testing import wait_for
from tests.support.channel import open_pair, transfer

HOST_A, HOST_B = "node-a/boot-1", "node-b/boot-2"


@pytest.mark.parametrize("a, b, network, expected", [
    (Place(HOST_A, "cpu"), Place(HOST_A, "cpu"), "gloo", "gloo"),  # auto keeps gloo on CPU
    (Place(HOST_A, "cpu", "ipc"), Place(HOST_A, "cpu"), "gloo", "ipc"),  # one end asking is enough
    (Place(HOST_A, "cpu", "ipc"), Place(HOST_B, "cpu", "ipc"), "gloo", "gloo"),  # two hosts: no shared memory
    (Place(HOST_A, "GPU-1"), Place(HOST_A, "GPU-1"), "nccl", "ipc"),  # one GPU: NCCL cannot, IPC must
    (Place(HOST_A, "GPU-1"), Place(HOST_A, "GPU-2"), "nccl", "nccl"),  # two GPUs: NCCL (NVLink/PCIe P2P)
    (Place(HOST_A, "GPU-1"), Place(HOST_B, "GPU-1"), "nccl", "nccl"),  # same UUID string, other host
    (Place(HOST_A, "GPU-1", "network"), Place(HOST_A, "GPU-1", "ipc"), "nccl", "nccl"),  # network wins
])
def test_both_ends_choose_the_same_transport(a, b, network, expected):
    assert choose_transport(a, b, network) == choose_transport(b, a, network) == expected


def test_a_cpu_end_and_a_cuda_end_are_refused():
    with pytest.raises(ChannelError, match="both must be CPU or CUDA"):
        choose_transport(Place(HOST_A, "cpu"), Place(HOST_A, "GPU-1"), "gloo")


def test_place_round_trips_and_names_this_host():
    here = Place.here(torch.device("cpu"), "ipc")
    assert Place.from_wire(here.to_wire()) == here
    assert here.device == "cpu" and here.host


def test_preference_of_either_end_decides():
    for tx_pref, rx_pref, expected in [("ipc", "auto", "ipc"), ("auto", "ipc", "ipc"), ("ipc", "network", "gloo")]:
        tx, rx = open_pair(tx_pref, rx_pref)
        try:
            assert tx.transport == rx.transport == expected
        finally:
            tx.close()
            rx.close()


@pytest.fixture()
def shm_pair():
    tx, rx = open_pair("ipc")
    yield tx, rx
    tx.close()
    rx.close()


def test_the_shared_file_grows_and_its_name_is_gone_once_mapped(shm_pair):
    tx, rx = shm_pair
    small = torch.arange(64, dtype=torch.float32)
    got = transfer(tx, rx, {"i": 0}, [small])
    assert torch.equal(got["payload"][0], small)
    first = tx._shared.path
    assert first is not None and not os.path.exists(first), "the receiver drops the name once it has mapped it"
    big = torch.randn(1 << 16)  # past the segment: the sender makes a bigger one
    got = transfer(tx, rx, {"i": 1}, [big, small])
    assert torch.equal(got["payload"][0], big) and torch.equal(got["payload"][1], small)
    assert tx._shared.path != first and tx._shared.size >= big.numel() * 4
    assert not os.path.exists(tx._shared.path)
    assert tx.stats.messages == 2  # the opening probe is not counted


def test_a_payload_the_receiver_cannot_read_fails_both_ends(shm_pair):
    tx, rx = shm_pair
    big = torch.randn(1 << 15)
    errors: dict = {}
    probe_segment = tx._shared.path

    def _receive():
        msg = rx.recv_header()
        rx.answer(True)
        # The sender makes a bigger segment for this payload; remove it before this end can map it, as if
        # the receiver lived in another container. (Done here: the sender's handle frame may wait for us.)
        path = wait_for(lambda: tx._shared.path != probe_segment and tx._shared.path, "the sender's new segment")
        os.unlink(path)
        try:
            rx.recv_payload(msg, timeout_s=10)
        except ChannelError as e:
            errors["rx"] = str(e)

    t = threading.Thread(target=_receive)
    t.start()
    tx.send_header({"i": 0}, [big])
    assert tx.wait_answer(10)
    pending = tx.post_payload([big])
    with pytest.raises(ChannelError, match="could not read the shared payload"):
        tx.finish_payload(pending, 10)
    t.join(10)
    assert "cannot open the sender's shared memory" in errors["rx"]
    assert not tx.usable and not rx.usable


def test_closing_the_sender_removes_its_file():
    tx, rx = open_pair("ipc")
    tx._shared._create(8192)  # a segment the receiver has not mapped yet still has its name
    path = tx._shared.path
    assert os.path.exists(path)
    tx.close()
    rx.close()
    assert not os.path.exists(path)


def test_a_peer_cannot_make_the_receiver_open_or_delete_other_files(tmp_path):
    from cluster.ipc import HostSegment

    victim = tmp_path / "tandem-kv-0123abcd"
    victim.write_bytes(b"x" * 4096)
    for path in [str(victim), "/dev/shm/../etc/passwd", "/dev/shm/other-file", "/dev/shm/tandem-kv-../../x"]:
        with pytest.raises(ChannelError, match="refusing shared memory"):
            HostSegment().copy_into([path, 4096, [[0, 16]]], [torch.empty(16, dtype=torch.uint8)])
    assert victim.exists()
