"""Length-prefixed pickles over a TCP connection: the framing the step and feed links share
(cluster/step_link.py, cluster/feed_link.py). A connection opens with a random token the listening side
handed out through Ray; only a peer that presents it is answered, so pickles are only ever read from the
party that set the link up."""
from __future__ import annotations

import asyncio
import pickle
import socket
import struct
from typing import Any

HEADER = struct.Struct("!Q")
TOKEN_BYTES = 32


def frame(obj: Any) -> bytes:
    body = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(body)) + body


def recv_exact(sock: socket.socket, n: int) -> bytes | None:
    """n bytes from a blocking socket, or None if the peer closed it first."""
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


async def read_frame(reader: asyncio.StreamReader) -> Any:
    """The next object; asyncio.IncompleteReadError when the peer closed the connection."""
    head = await reader.readexactly(HEADER.size)
    return pickle.loads(await reader.readexactly(HEADER.unpack(head)[0]))


def no_delay(sock: socket.socket | None) -> None:
    """Small frames go out at once (one per step: Nagle's delay would be on every step's path)."""
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
