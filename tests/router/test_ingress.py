"""How HTTP reaches the router: direct ingress (router/ingress.py: the router replica answers on its own port,
`tandem serve`'s default and the session server's) and Serve's HTTP proxy (the Serve YAML's way)."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import time

import httpx
import pytest

from deploy.testing import start_router, stop_router

pytestmark = pytest.mark.ray

BODY = {"prompt": "The list of colours:", "max_tokens": 12, "temperature": 0, "ignore_eos": True}


def _texts(base_url: str, model: str) -> tuple[str, str]:
    """(non-streamed text, streamed text joined) of one greedy request; the stream must end with [DONE]."""
    with httpx.Client(base_url=base_url, timeout=120) as http:
        plain = http.post("/v1/completions", json={**BODY, "model": model})
        assert plain.status_code == 200, plain.text
        lines = []
        with http.stream("POST", "/v1/completions", json={**BODY, "model": model, "stream": True}) as resp:
            assert resp.status_code == 200
            lines = [line for line in resp.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    streamed = "".join(json.loads(line[6:])["choices"][0]["text"] for line in lines[:-1])
    return plain.json()["choices"][0]["text"], streamed


def _listeners(port: int) -> int:
    """Listening TCP sockets on `port` on this machine (IPv4 and IPv6), from /proc/net."""
    found = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            local, state = row.split()[1], row.split()[3]
            found += state == "0A" and int(local.rsplit(":", 1)[1], 16) == port
    return found


def test_direct_and_proxied_requests_answer_alike(tandem_server):
    proxied = start_router(tandem_server, "viaproxy", ingress="proxy")
    try:
        direct_plain, direct_streamed = _texts(tandem_server.base_url, tandem_server.model)
        proxy_plain, proxy_streamed = _texts(proxied.base_url, proxied.model)
    finally:
        stop_router("viaproxy")
    assert direct_plain and direct_plain == direct_streamed == proxy_plain == proxy_streamed
    # the session's application is also reachable through the proxy, at its route prefix "/"
    with httpx.Client(base_url=tandem_server.proxy_url, timeout=30) as http:
        assert http.get("/v1/models").json()["data"][0]["id"] == tandem_server.model


def test_router_replicas_share_the_port_and_let_it_go(tandem_server):
    pair = start_router(tandem_server, "pair", num_replicas=2)
    port = int(pair.base_url.rsplit(":", 1)[1])
    try:
        assert _listeners(port) == 2  # both replicas bound it (SO_REUSEPORT); the kernel spreads connections

        async def main():
            # a connection per request, so that they land on either replica
            async def one(i):
                async with httpx.AsyncClient(base_url=pair.base_url, timeout=120) as http:
                    r = await http.post("/v1/completions", json={**BODY, "model": pair.model, "max_tokens": 4,
                                                                  "prompt": f"Item {i}:"})
                    return r.status_code
            return await asyncio.gather(*[one(i) for i in range(12)])

        assert asyncio.run(main()) == [200] * 12
    finally:
        stop_router("pair")
    deadline = time.monotonic() + 30
    while _listeners(port) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _listeners(port) == 0
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{pair.base_url}/health", timeout=5)


def test_a_port_another_program_holds_fails_the_deploy_with_the_address_named(tandem_server):
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))  # no SO_REUSEPORT: the router cannot share it
    holder.listen(1)
    port = holder.getsockname()[1]
    try:
        from ray import serve

        from deploy.config import TandemConfig
        from router.app import Router

        cfg = TandemConfig(**tandem_server.config.model_dump())
        app = serve.deployment(Router, name="router-taken", ray_actor_options={"num_cpus": 0},
                               graceful_shutdown_timeout_s=5)
        prefill = serve.get_deployment_handle("prefill", app_name="tandem")
        decode = serve.get_deployment_handle("decode", app_name="tandem")
        with pytest.raises(RuntimeError, match="Deploying application taken failed"):
            serve.run(app.bind(prefill, decode, cfg.router(("127.0.0.1", port)).model_dump()), name="taken",
                      route_prefix="/taken")
        # The operator reads why in Serve's status (and `serve status`): the address and the OS's reason.
        status = serve.status().applications["taken"].deployments["router-taken"]
        assert f"the router cannot serve the API on 127.0.0.1:{port}: Address already in use" in status.message
    finally:
        holder.close()
        stop_router("taken")


def test_stopping_a_router_ends_its_open_streams_and_frees_their_blocks(tandem_server):
    """A router replica stopped (deleted, scaled down, replaced) with a stream open: its API server stops
    accepting, gives the stream a moment, then cuts it; the request is aborted on the decode side, whose blocks
    all come back, and the session's router keeps serving."""
    from deploy.testing import wait_decode_settled

    doomed = start_router(tandem_server, "doomed", shutdown_grace_s=1.0)
    body = {"model": doomed.model, "prompt": "Once upon a time", "max_tokens": 1000, "temperature": 0,
            "ignore_eos": True, "stream": True}
    ranks = tandem_server.decode_handle().rank_pids.remote().result()
    chunks = 0
    with httpx.Client(base_url=doomed.base_url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            for line in lines:
                chunks += line.startswith("data: {")
                if chunks == 4:
                    break
            # The decode ranks are paused while the router stops, so that the stream cannot end by itself
            # within the grace period, however fast the group decodes (a few seconds for 1000 tokens).
            for pid in ranks:
                os.kill(pid, signal.SIGSTOP)
            try:
                stop_router("doomed")  # returns once Serve has stopped the replica
            finally:
                for pid in ranks:
                    os.kill(pid, signal.SIGCONT)
            with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
                for line in lines:
                    assert line != "data: [DONE]", "the stream ran to its end instead of being cut"
    wait_decode_settled("tandem", "the cut stream's blocks are back")
    plain, _ = _texts(tandem_server.base_url, tandem_server.model)
    assert plain


def test_a_stopped_router_lets_a_stream_that_is_about_to_end_finish(tandem_server):
    """The other half of the stop: a stream that ends within the grace period runs to its [DONE] and its blocks
    come back. (Serve's own ~2 s before it ends a replica would cover these 24 tokens too: whether Serve awaits
    the router's stop shows in the replica's log, which said "coroutine 'ApiServer.stop' was never awaited"
    while __del__ was sync.)"""
    from deploy.testing import wait_decode_settled

    brief = start_router(tandem_server, "brief")
    body = {"model": brief.model, "prompt": "Once upon a time", "max_tokens": 24, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=brief.base_url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            first = next(line for line in lines if line.startswith("data: {"))
            stop_router("brief")  # returns once Serve has stopped the replica: after the stream ended
            rest = list(lines)
    events = [line for line in rest if line]
    assert first and events and events[-1] == "data: [DONE]", events[-3:]
    wait_decode_settled("tandem", "the finished stream's blocks are back")
