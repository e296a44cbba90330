"""KV hand-over channel in one process (two threads, two real gloo ends): bytes in == bytes out."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from cluster.channel import RECEIVER, TensorSpec, open_channel
from cluster.errors import ChannelError
from cluster.rendezvous import StoreServer
from cluster.testing import returns
from tests.support.channel import open_pair, transfer


def pack_reference(kv: torch.Tensor, block_ids: list[int], heads: tuple[int, int] | None) -> torch.Tensor:
    """[L, 2, n, S, h, D]: the listed blocks (and head slice) of a [L, 2, N, S, H, D] cache, contiguous."""
    out = kv[:, :, block_ids]
    if heads is not None:
        out = out[:, :, :, :, heads[0]:heads[0] + heads[1]]
    return out.contiguous()


def random_cache(shape, dtype, gen) -> torch.Tensor:
    """Random bit patterns (NaNs and infs included): equality below is on bytes, not values."""
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).view(shape)


# Every channel test runs over gloo and over shared memory (the CPU twin of CUDA IPC on one GPU).
@pytest.fixture(params=["network", "ipc"], ids=["gloo", "shm"])
def channel_pair(request):
    tx, rx = open_pair(request.param)
    assert tx.transport == rx.transport == {"network": "gloo", "ipc": "ipc"}[request.param]
    yield tx, rx
    tx.close()
    rx.close()


LAYOUTS = [
    # (layers, blocks in cache, block_size, kv heads, head_dim, dtype)
    (2, 11, 16, 4, 8, torch.float32),
    (3, 9, 4, 2, 64, torch.bfloat16),
    (1, 7, 1, 1, 16, torch.float16),
    (4, 13, 16, 8, 32, torch.float32),
]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: f"L{l[0]}N{l[1]}S{l[2]}H{l[3]}D{l[4]}-{l[5]}")
@pytest.mark.parametrize("n_blocks", [1, 3, 5])
def test_kv_blocks_arrive_byte_for_byte(channel_pair, layout, n_blocks):
    tx, rx = channel_pair
    L, N, S, H, D, dtype = layout
    gen = torch.Generator().manual_seed(n_blocks * 1000 + N)
    src = random_cache((L, 2, N, S, H, D), dtype, gen)
    dst = torch.zeros_like(src)
    send_ids = torch.randperm(N, generator=gen)[:n_blocks].tolist()
    recv_ids = torch.randperm(N, generator=gen)[:n_blocks].tolist()
    got = transfer(tx, rx, {"request_id": "r1", "block_ids": send_ids}, [pack_reference(src, send_ids, None)])
    assert got["msg"].header == {"request_id": "r1", "block_ids": send_ids}
    assert got["msg"].payload == (TensorSpec(dtype, (L, 2, n_blocks, S, H, D)),)
    dst[:, :, recv_ids] = got["payload"][0]
    assert torch.equal(dst[:, :, recv_ids].view(torch.uint8), src[:, :, send_ids].view(torch.uint8))
    untouched = [b for b in range(N) if b not in recv_ids]
    assert torch.count_nonzero(dst[:, :, untouched].view(torch.uint8)) == 0


@pytest.mark.parametrize("tp", [2, 4])
def test_head_slices_reassemble_the_prefill_blocks(channel_pair, tp):
    """A tp=1 sender cuts each block into tp KV-head slices; the slices put together are the blocks."""
    tx, rx = channel_pair
    L, N, S, H, D = 2, 9, 8, 4, 16
    gen = torch.Generator().manual_seed(tp)
    src = random_cache((L, 2, N, S, H, D), torch.bfloat16, gen)
    ids = [8, 1, 4]  # odd count, out of order
    per = H // tp
    slices = []
    for r in range(tp):
        got = transfer(tx, rx, {"tp_rank": r}, [pack_reference(src, ids, (r * per, per))])
        slices.append(got["payload"][0])
        assert slices[-1].shape == (L, 2, len(ids), S, per, D)
    whole = torch.cat(slices, dim=4)
    assert torch.equal(whole.view(torch.uint8), src[:, :, ids].contiguous().view(torch.uint8))


def test_several_payload_tensors_and_a_dropped_message(channel_pair):
    tx, rx = channel_pair
    gen = torch.Generator().manual_seed(7)
    kv = random_cache((2, 2, 3, 16, 2, 8), torch.float32, gen)
    hidden = random_cache((1, 5, 24), torch.bfloat16, gen)
    dropped = transfer(tx, rx, {"n": 0}, [kv], accept=False)
    assert "payload" not in dropped
    got = transfer(tx, rx, {"n": 1}, [kv, hidden])
    assert got["msg"].header == {"n": 1}
    assert torch.equal(got["payload"][0].view(torch.uint8), kv.view(torch.uint8))
    assert torch.equal(got["payload"][1].view(torch.uint8), hidden.view(torch.uint8))
    assert tx.stats.messages == 1 and tx.stats.payload_bytes == kv.numel() * 4 + hidden.numel() * 2


def test_sender_close_ends_the_receiver_quietly(channel_pair):
    tx, rx = channel_pair
    got = {}
    t = threading.Thread(target=lambda: got.setdefault("msg", rx.recv_header()))
    t.start()
    tx.close(notify_peer=True)
    t.join(10)
    assert not t.is_alive() and got["msg"] is None and rx.closed


def test_receiver_closed_locally_ends_quietly_when_the_sender_goes(channel_pair):
    tx, rx = channel_pair
    got = {}
    t = threading.Thread(target=lambda: got.setdefault("msg", rx.recv_header()))
    t.start()
    time.sleep(0.2)
    returns(rx.close, "a local close while a receive is pending")  # it must not wait for the pending receive
    assert rx.closed
    tx.close()  # no notice: the sender's sockets just close, as when its process dies
    t.join(10)
    assert not t.is_alive() and got["msg"] is None


def test_sender_gone_without_notice_is_an_error_for_the_receiver(channel_pair):
    tx, rx = channel_pair
    got = {}

    def _receive():
        try:
            rx.recv_header()
        except ChannelError as e:
            got["error"] = str(e)

    t = threading.Thread(target=_receive)
    t.start()
    time.sleep(0.2)
    tx.close()
    t.join(10)
    assert not t.is_alive() and "closed" in got["error"].lower()
    assert not rx.usable


def test_closed_channel_refuses_to_send(channel_pair):
    tx, _ = channel_pair
    tx.close()
    with pytest.raises(ChannelError, match="closed"):
        tx.send_header({}, [])


def test_peer_that_never_joins_fails_fast():
    server = StoreServer()
    with pytest.raises(ChannelError, match="did not join"):  # at its 1 s deadline, not the store's long default
        returns(lambda: open_channel(server.store, "lonely", RECEIVER, connect_timeout_s=1.0), "opening alone",
                timeout_s=60)


def test_answer_deadline_breaks_the_channel(channel_pair):
    """A receiver that never answers: the sender's wait ends at its deadline, and the channel is dead."""
    tx, rx = channel_pair
    t = threading.Thread(target=rx.recv_header)
    t.start()
    tx.send_header({"n": 1}, [torch.zeros(4)])
    t.join(10)
    with pytest.raises(ChannelError):
        tx.wait_answer(timeout_s=0.5)
    assert not tx.usable
    with pytest.raises(ChannelError, match="broken"):
        tx.send_header({"n": 2}, [torch.zeros(4)])
