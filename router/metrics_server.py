"""/metrics off the public port: a minimal HTTP endpoint on the router replica's own event loop, bound to
`metrics_host:metrics_port` (loopback by default), so that the API port can face clients while Prometheus
scrapes a port only the operator's network reaches.

Router replicas that share a node take the next free port up to `PORT_SPAN` above the configured one
(each logs the port it took). Only `GET /metrics` is answered; anything else gets 404.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

log = logging.getLogger(__name__)

PORT_SPAN = 16
_MAX_HEADER_BYTES = 16384


async def start_metrics_server(host: str, port: int, render: Callable[[], Awaitable[bytes]]) -> asyncio.AbstractServer:
    """Serve `await render()` at GET /metrics; returns the server (its port: `server.sockets[0]`)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            method, _, rest = head.split(b"\r\n", 1)[0].decode("latin-1").partition(" ")
            path = rest.split(" ", 1)[0].split("?", 1)[0]
            if method == "GET" and path == "/metrics":
                body, status, ctype = await render(), "200 OK", "text/plain; version=0.0.4"
            else:
                body, status, ctype = b"only GET /metrics is served here\n", "404 Not Found", "text/plain"
            writer.write(f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                         f"Connection: close\r\n\r\n".encode() + body)
            await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, asyncio.TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()

    last: OSError | None = None
    for p in range(port, port + PORT_SPAN):
        try:
            server = await asyncio.start_server(handle, host, p, limit=_MAX_HEADER_BYTES)
        except OSError as e:  # another replica on this node has it
            last = e
            continue
        log.info("serving /metrics on %s:%d", host, p)
        return server
    raise OSError(f"no free metrics port in {host}:{port}-{port + PORT_SPAN - 1}: {last}")
