"""Two ends of a real KV hand-over channel in one process (a thread per end), and one message sent across."""
from __future__ import annotations

import threading
import uuid

import torch

from cluster.channel import RECEIVER, SENDER, KVChannel, connect_channel, open_channel
from cluster.rendezvous import StoreServer


def open_pair(preference: str = "auto", rx_preference: str | None = None):
    """(sender, receiver) connected through a fresh rendezvous store; `preference` picks the transport
    ("auto", "network", "ipc"), `rx_preference` the receiver's when it differs."""
    server = StoreServer()
    cid = uuid.uuid4().hex
    ends: dict = {}

    def _recv_end():
        ends["rx"] = open_channel(server.store, cid, RECEIVER, connect_timeout_s=10,
                                  preference=rx_preference or preference)

    t = threading.Thread(target=_recv_end)
    t.start()
    tx = connect_channel(server.address, cid, SENDER, connect_timeout_s=10, preference=preference)
    t.join(10)
    return tx, ends["rx"]


def transfer(tx: KVChannel, rx: KVChannel, header: dict, tensors: list[torch.Tensor], accept: bool = True):
    """Send one header and (if the receiver `accept`s) its payload: {"msg": the header received, "payload":
    the tensors received}."""
    got: dict = {}

    def _receive():
        msg = rx.recv_header()
        got["msg"] = msg
        rx.answer(accept)
        if accept:
            got["payload"] = rx.recv_payload(msg)

    t = threading.Thread(target=_receive)
    t.start()
    tx.send_header(header, tensors)
    if tx.wait_answer(timeout_s=10):
        tx.send_payload(tensors)
    t.join(10)
    assert not t.is_alive()
    return got
