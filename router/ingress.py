"""Direct ingress: the router replica answers HTTP itself, on the API's host:port.

Behind Serve's HTTP proxy every chunk of a streamed answer crosses two processes: the router replica yields
it as a Ray streaming item and the proxy writes it to the client. A served answer streams one chunk per
decode step, so at concurrency 64 that is ~400 Ray items a second: on 2 CPU cores the router and the proxy
took 4.7 CPU seconds of such a run, against 1.7 for the router alone here, and the served tokens/s rose by a
fifth (bench/results/served_vs_engine_2026-11-24_cpu.md). Here the replica runs the same FastAPI app in a
uvicorn server on its own event loop: the chunk goes from the SSE generator to the socket. Router replicas
on one node bind the same port with SO_REUSEPORT (which Linux allows only to processes of the same user),
and the kernel spreads connections over them; replicas on other nodes serve their node's address, as
Serve's per-node proxies do. Serve still deploys, health-checks and restarts the replicas and routes their
calls to the prefill and decode deployments.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from typing import Awaitable, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket at host:port that other processes of this node may bind too (SO_REUSEPORT).
    Raises OSError naming the address when it cannot be bound."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.listen(2048)
        sock.setblocking(False)
    except OSError as e:
        sock.close()
        raise OSError(e.errno, f"the router cannot serve the API on {host}:{port}: {e.strerror}") from e
    return sock


class ApiServer:
    """`app` served on host:port from the running event loop until `stop()`."""

    def __init__(self, app, host: str, port: int, grace_s: float):
        """grace_s: how long open responses get to end when the server stops (RouterSettings.shutdown_grace_s)."""
        import uvicorn

        self.host, self.port, self.grace_s = host, port, grace_s
        sock = reuse_port_socket(host, port)
        config = uvicorn.Config(app, lifespan="off", access_log=False, log_config=None,
                                timeout_graceful_shutdown=grace_s)
        self._server = uvicorn.Server(config)
        # The replica's signals are Ray's: uvicorn must not take SIGTERM/SIGINT over when this loop happens to
        # run on the main thread.
        self._server.capture_signals = contextlib.nullcontext
        self._task = asyncio.get_running_loop().create_task(self._server.serve(sockets=[sock]))
        log.info("serving the API directly on %s:%d", host, port)

    @property
    def failed(self) -> str | None:
        """Why the server stopped serving, while it was meant to serve (None: it is serving)."""
        if not self._task.done() or self._server.should_exit:
            return None
        error = None if self._task.cancelled() else self._task.exception()
        return f"the API server on {self.host}:{self.port} stopped: {error or 'it exited'}"

    async def stop(self) -> None:
        """Stop accepting, let open responses end (up to grace_s), close the socket."""
        self._server.should_exit = True
        with contextlib.suppress(Exception, asyncio.CancelledError):
            await asyncio.wait_for(asyncio.shield(self._task), self.grace_s + 1.0)
        if not self._task.done():
            self._task.cancel()


async def unless_client_leaves(request, work: Awaitable[T]) -> tuple[bool, T | None]:
    """(True, what `work` returned), or (False, None) once the client has disconnected first, `work` then
    being cancelled. A streamed answer needs none of this (Starlette cancels its generator when the client
    goes); an unstreamed one does under direct ingress, where no proxy cancels the call for a client gone and
    the request would otherwise decode to its end for nobody."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
    if not task.done() or task.cancelled():
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return False, None
    return True, task.result()


async def _disconnect(request) -> None:
    """Returns when the client disconnects (the body has been read already: what is left is that message)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
