"""Length-prefixed msgpack frames over a TCP connection: the framing the step and feed links share
(cluster/step_link.py, cluster/feed_link.py). A frame's body is a record's `to_wire()` value (plain ints,
floats, strings, arrays, maps), never a pickle: what a peer sends is read as data and checked field by field
(cluster/protocol/wire.py), whoever the peer is. A connection opens with a random token the listening side
handed out through Ray, and then each end's hello (link name and protocol version: wire.hello), so a peer
that speaks another protocol is turned away at connect time, not mid-request."""
from __future__ import annotations

import asyncio
import socket
import struct
from typing import Any

from cluster.protocol import wire

HEADER = struct.Struct("!Q")
TOKEN_BYTES = 32


def frame(value: Any) -> bytes:
    """One frame of a wire value (msgpack)."""
    body = wire.pack(value)
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


def recv_frame(sock: socket.socket, what: str) -> Any:
    """The next wire value from a blocking socket; EOFError if the peer closed it first, ProtocolError if
    the frame is not msgpack."""
    head = recv_exact(sock, HEADER.size)
    body = None if head is None else recv_exact(sock, HEADER.unpack(head)[0])
    if body is None:
        raise EOFError(what)
    return wire.unpack(body, what)


async def read_frame(reader: asyncio.StreamReader, what: str) -> Any:
    """The next wire value; asyncio.IncompleteReadError when the peer closed the connection, ProtocolError if
    the frame is not msgpack."""
    head = await reader.readexactly(HEADER.size)
    return wire.unpack(await reader.readexactly(HEADER.unpack(head)[0]), what)


def no_delay(sock: socket.socket | None) -> None:
    """Small frames go out at once (one per step: Nagle's delay would be on every step's path)."""
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
