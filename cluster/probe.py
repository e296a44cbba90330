"""ChannelProbe: a Ray actor that opens channels to its peers and moves raw bytes or KV-shaped
tensors over them. The benchmark uses it for the raw channel bandwidth that hand-overs are compared
against; tests use it to check channels across processes and what happens when a peer dies."""
from __future__ import annotations

import threading
import time

import ray
import torch

from cluster.channel import RECEIVER, SENDER, KVChannel, connect_channel, open_channel
from cluster.errors import ChannelError
from cluster.groups import backend_for
from cluster.rendezvous import RENDEZVOUS_CONCURRENCY, StoreAddress, StoreServer


@ray.remote(num_cpus=0, max_concurrency=8, concurrency_groups=RENDEZVOUS_CONCURRENCY)
class ChannelProbe:
    def __init__(self, device: str = "cpu", transport: str = "auto"):
        torch.set_num_threads(1)
        self.device = torch.device(device)
        self.preference = transport  # cluster.ipc.TransportPreference
        self.server = StoreServer()
        self.channels: dict[str, KVChannel] = {}
        self.received: dict[str, list] = {}  # channel id -> [(header, payload tensors)] or an error string
        self._lock = threading.Lock()

    def address(self) -> StoreAddress:
        return self.server.address

    def pid(self) -> int:
        import os

        return os.getpid()

    # ------------------------------------------------------------------ receiving end
    def accept(self, channel_id: str, timeout_s: float = 30.0) -> None:
        """Open the receiving end and keep receiving on a thread until the channel ends."""
        ch = open_channel(self.server.store, channel_id, RECEIVER, backend_for(self.device), timeout_s,
                          self.preference)
        self.channels[channel_id] = ch
        self.received[channel_id] = []
        threading.Thread(target=self._receive_loop, args=(ch,), daemon=True, name=f"rx-{channel_id}").start()

    def _receive_loop(self, ch: KVChannel) -> None:
        log = self.received[ch.name]
        while True:
            try:
                msg = ch.recv_header()
                if msg is None:
                    log.append("closed")
                    return
                accept = not msg.header.get("drop", False)
                ch.answer(accept)
                payload = ch.recv_payload(msg) if accept else []
                with self._lock:
                    keep = [] if msg.header.get("bytes") else [t.cpu() for t in payload]  # bandwidth runs: no copy
                    log.append((msg.header, keep))
            except ChannelError as e:
                log.append(f"error: {e}")
                return

    def transfer_history(self, channel_id: str) -> list[tuple[int, float]]:
        """(bytes, seconds) of this end's recent payloads: receive-side times on the receiving end."""
        ch = self.channels.get(channel_id)
        return list(ch.stats.history) if ch is not None else []

    def received_messages(self, channel_id: str) -> list:
        with self._lock:
            return list(self.received.get(channel_id, []))

    # ------------------------------------------------------------------ sending end
    def connect(self, address: StoreAddress, channel_id: str, timeout_s: float = 30.0) -> None:
        self.channels[channel_id] = connect_channel(address, channel_id, SENDER, backend_for(self.device), timeout_s,
                                                    self.preference)

    def transport(self, channel_id: str) -> str:
        return self.channels[channel_id].transport

    def send(self, channel_id: str, header: dict, tensors: list[torch.Tensor], timeout_s: float = 30.0) -> bool:
        """One message; returns whether the receiver took the payload. Raises ChannelError."""
        ch = self.channels[channel_id]
        tensors = [t.to(self.device) for t in tensors]
        ch.send_header(header, tensors, timeout_s)
        if not ch.wait_answer(timeout_s):
            return False
        ch.send_payload(tensors, timeout_s)
        return True

    def send_bytes(self, channel_id: str, nbytes: int, repeats: int, timeout_s: float = 60.0) -> list[float]:
        """Raw bandwidth: `repeats` payloads of `nbytes` each; returns each payload's seconds."""
        ch = self.channels[channel_id]
        buf = torch.ones(nbytes, dtype=torch.uint8, device=self.device)
        times = []
        for i in range(repeats):
            ch.send_header({"bytes": nbytes, "i": i}, [buf], timeout_s)
            if not ch.wait_answer(timeout_s):
                raise ChannelError("the probe receiver dropped a bandwidth message")
            start = time.perf_counter()
            ch.send_payload([buf], timeout_s)
            times.append(time.perf_counter() - start)
        return times

    def close(self, channel_id: str, notify_peer: bool = True) -> None:
        ch = self.channels.pop(channel_id, None)
        if ch is not None:
            ch.close(notify_peer=notify_peer)
