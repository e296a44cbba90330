"""`tandem serve` as `make serve` starts it has no side doors. Every listener of its process tree (Ray's
GCS, raylet, workers, agents and metrics servers; Tandem's rendezvous stores, step and feed links, gloo
pairs; the OpenAI port) is on loopback, except what a component will not bind elsewhere: Ray Serve's
inter-deployment gRPC server in each replica listens on every interface (hard-coded in Ray), and must
then refuse a caller without Ray's token."""
from __future__ import annotations

import ipaddress
import socket

import psutil
import pytest

from tests.support.served import tandem_serve

pytestmark = pytest.mark.slow


def _routable_addresses() -> list[str]:
    """This machine's IPv4 addresses other than loopback: where a stranger on the network would knock."""
    out = []
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not ipaddress.ip_address(a.address).is_loopback:
                out.append(a.address)
    return out


def _listeners(pid: int) -> list[tuple[str, str, int]]:
    """(process name, address, port) of every listening socket of `pid` and its descendants."""
    root = psutil.Process(pid)
    found = []
    for p in [root, *root.children(recursive=True)]:
        try:
            found += [(p.name(), c.laddr.ip, c.laddr.port) for c in p.net_connections(kind="inet")
                      if c.status == psutil.CONN_LISTEN]
        except psutil.Error:  # a worker that ended meanwhile
            pass
    return found


def _loopback(ip: str) -> bool:
    ip = ip.removeprefix("::ffff:")
    return ipaddress.ip_address(ip).is_loopback


def _answers(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=3):
            return True
    except OSError:
        return False


def _refuses_without_token(host: str, port: int) -> bool:
    """A gRPC call with no credential (as a stranger makes it) is refused as unauthenticated."""
    import grpc

    with grpc.insecure_channel(f"{host}:{port}") as channel:
        call = channel.unary_unary("/ray.serve.ASGIService/HandleRequest")
        try:
            call(b"", timeout=10)
        except grpc.RpcError as e:
            return e.code() == grpc.StatusCode.UNAUTHENTICATED
    return False


def test_every_listener_of_tandem_serve_is_on_loopback(tiny_model_dir):
    import httpx

    with tandem_serve("--model", tiny_model_dir) as server:
        # A request first: the hand-over channel and its gloo pairs exist only once one has crossed.
        model = httpx.get(f"{server.base_url}/v1/models", timeout=30).json()["data"][0]["id"]
        answer = httpx.post(f"{server.base_url}/v1/completions", timeout=120, json={
            "model": model, "prompt": "Hello", "max_tokens": 4, "temperature": 0})
        assert answer.status_code == 200, answer.text
        listeners = _listeners(server.pid)
        names = {name for name, _, _ in listeners}
        assert len(listeners) >= 8 and {"gcs_server", "raylet"} <= names, listeners  # the whole tree was seen
        exposed = [entry for entry in listeners if not _loopback(entry[1])]
        assert all(name.startswith("ray::ServeReplica") for name, _, _ in exposed), \
            f"listeners beyond loopback: {exposed}"
        open_doors = [entry for entry in exposed if not _refuses_without_token("127.0.0.1", entry[2])]
        assert not open_doors, f"answered a caller without Ray's token: {open_doors}"
        outside = _routable_addresses()
        credentialed = {p for _, _, p in exposed}
        knocked = [(host, p) for host in outside for _, _, p in listeners
                   if p not in credentialed and _answers(host, p)]
        assert not knocked, f"answered from the network: {knocked}"
