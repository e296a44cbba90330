"""Channels between Ray actors in different processes: content, clean close, and dead peers."""
from __future__ import annotations

import time
import uuid

import pytest
import torch

from cluster.probe import ChannelProbe
from cluster.testing import wait_for

pytestmark = pytest.mark.ray


# Every test runs over the network transport (gloo) and over shared memory between the two processes.
@pytest.fixture(params=["network", "ipc"], ids=["gloo", "shm"])
def transport(request):
    return request.param


def _pair(ray, transport):
    tx, rx = ChannelProbe.remote(transport=transport), ChannelProbe.remote(transport=transport)
    cid = uuid.uuid4().hex[:12]
    addr = ray.get(rx.address.remote())
    accepted = rx.accept.remote(cid, 20.0)
    ray.get(tx.connect.remote(addr, cid, 20.0))
    ray.get(accepted)
    assert ray.get(tx.transport.remote(cid)) == {"network": "gloo", "ipc": "ipc"}[transport]
    return tx, rx, cid


def test_kv_blocks_cross_processes_byte_for_byte(ray_session, transport):
    ray = ray_session
    tx, rx, cid = _pair(ray, transport)
    gen = torch.Generator().manual_seed(3)
    for n_blocks, dtype in [(1, torch.float32), (3, torch.bfloat16), (7, torch.float16)]:
        kv = torch.randint(0, 256, (2 * 2 * n_blocks * 16 * 2 * 8 * dtype.itemsize,), dtype=torch.uint8,
                           generator=gen).view(dtype).view(2, 2, n_blocks, 16, 2, 8)
        assert ray.get(tx.send.remote(cid, {"request_id": f"r{n_blocks}"}, [kv]))
    assert not ray.get(tx.send.remote(cid, {"request_id": "dropped", "drop": True}, [kv]))
    msgs = wait_for(lambda: (m := ray.get(rx.received_messages.remote(cid))) and len(m) == 4 and m,
                    "the four messages reach the receiver")
    assert [h["request_id"] for h, _ in msgs] == ["r1", "r3", "r7", "dropped"]
    gen = torch.Generator().manual_seed(3)
    for (header, payload), (n_blocks, dtype) in zip(msgs, [(1, torch.float32), (3, torch.bfloat16), (7, torch.float16)]):
        sent = torch.randint(0, 256, (2 * 2 * n_blocks * 16 * 2 * 8 * dtype.itemsize,), dtype=torch.uint8,
                             generator=gen)
        assert torch.equal(payload[0].reshape(-1).view(torch.uint8), sent)
    assert msgs[3][1] == []
    ray.get(tx.close.remote(cid))
    wait_for(lambda: ray.get(rx.received_messages.remote(cid))[-1] == "closed", "the receiver sees the close")
    for a in (tx, rx):
        ray.kill(a)


def test_killed_sender_ends_the_receiver_with_an_error(ray_session, transport):
    ray = ray_session
    tx, rx, cid = _pair(ray, transport)
    ray.kill(tx)
    last = wait_for(lambda: (m := ray.get(rx.received_messages.remote(cid))) and m[-1],
                    "the receiver notices the dead sender")
    assert isinstance(last, str) and last.startswith("error")
    ray.kill(rx)


def test_killed_receiver_fails_the_send_instead_of_hanging(ray_session, transport):
    ray = ray_session
    tx, rx, cid = _pair(ray, transport)
    ray.kill(rx)
    time.sleep(0.5)
    # The send's own deadline is far beyond the wait: only a closed connection seen at once ends it in time.
    send = tx.send.remote(cid, {"request_id": "x"}, [torch.zeros(1024)], 3600.0)
    try:
        ray.get(send, timeout=120)
    except ray.exceptions.RayTaskError as e:
        assert "ChannelError" in str(e)
    except ray.exceptions.GetTimeoutError:
        raise AssertionError("the send to a dead receiver hangs until its deadline instead of failing") from None
    else:
        raise AssertionError("the send to a dead receiver succeeded")
    ray.kill(tx)
