"""What a stranger finds: the listening sockets of a process tree, and a knock on each one without any
credential (tests/deploy/test_exposure.py for `tandem serve`, tests/deploy/test_two_node.py for a
two-node cluster).

A knock tries, in turn, the protocols the deployment speaks, and says what the listener did:
- gRPC (Ray's GCS, raylets, object managers, core workers, agents, client server, Serve replicas): a harmless
  read of each service we know, with no token. Ray checks the token per method, so an unknown method says
  nothing (UNIMPLEMENTED comes before the check): only known methods count.
- HTTP/1 (Ray's dashboard, agents, metrics exporters, Serve's proxy): `GET` of a few data paths (metrics,
  the OpenAI model list, Ray's node list) with no credential. `/` is asked too but counts only where
  nothing is refused: Ray's dashboard serves its login page there to anyone.
- torch's TCPStore (which any client can list, read and write; Tandem's rendezvous no longer uses one): what
  a TCPStore client lists and reads.
- anything else (Tandem's step and feed links, gloo pairs): random bytes, and whether any byte comes back.
"""
from __future__ import annotations

import concurrent.futures
import enum
import ipaddress
import json
import os
import socket
import subprocess
import sys
from dataclasses import dataclass

import psutil

# One harmless read per gRPC service the deployment runs (an empty request message is a valid one).
GRPC_READS = (
    "/ray.rpc.NodeInfoGcsService/GetAllNodeInfo",  # GCS
    "/ray.rpc.NodeManagerService/GetNodeStats",  # raylet
    "/ray.rpc.ObjectManagerService/Pull",  # object manager (no object id: nothing to pull)
    "/ray.rpc.CoreWorkerService/NumPendingTasks",  # every worker and driver
    "/ray.rpc.ReporterService/HealthCheck",  # dashboard agent's gRPC port
    "/ray.rpc.RayletDriver/ClusterInfo",  # Ray client server (head)
    "/ray.serve.ASGIService/HandleRequest",  # Serve replica's inter-deployment server
)


@dataclass(frozen=True, slots=True)
class Listener:
    process: str  # the process name (`ray::DecodeRank`, `gcs_server`, ...)
    pid: int
    host: str  # the bound address: 0.0.0.0 / :: is every interface
    port: int


class Verdict(enum.Enum):
    GRPC_REFUSED = "gRPC: UNAUTHENTICATED without the token"
    GRPC_ANSWERED = "gRPC: served a call without the token"
    GRPC_UNKNOWN = "gRPC: none of the known services (cannot tell whether it checks a token)"
    HTTP_REFUSED = "HTTP: 401/403 without credentials"
    HTTP_ANSWERED = "HTTP: answered without credentials"
    HTTP_UNCLEAR = "HTTP: neither served nor refused a data path (404s: cannot tell whether it checks)"
    STORE = "TCPStore: answers any client (see StoreView)"
    SILENT = "accepts a connection, answers nothing to a stranger's bytes"
    BYTES_ANSWERED = "answered a stranger's random bytes"
    CLOSED = "not reachable"


@dataclass(frozen=True)
class Knock:
    listener: Listener
    verdict: Verdict
    detail: str = ""  # the HTTP status per path, the gRPC method, or the store's key count


def listeners(*root_pids: int) -> list[Listener]:
    """Every listening inet socket of `root_pids` and their descendants."""
    found = []
    for root in root_pids:
        root_process = psutil.Process(root)
        for p in [root_process, *root_process.children(recursive=True)]:
            try:
                found += [Listener(p.name(), p.pid, c.laddr.ip, c.laddr.port) for c in p.net_connections(kind="inet")
                          if c.status == psutil.CONN_LISTEN]
            except psutil.Error:  # a worker that ended meanwhile
                pass
    return found


def routable_addresses() -> list[str]:
    """This machine's IPv4 addresses other than loopback: where a stranger on the network would knock."""
    return [a.address for addrs in psutil.net_if_addrs().values() for a in addrs
            if a.family == socket.AF_INET and not ipaddress.ip_address(a.address).is_loopback]


def is_loopback(ip: str) -> bool:
    return ipaddress.ip_address(ip.removeprefix("::ffff:")).is_loopback


def reach(listener: Listener, outside: str) -> str:
    """The address a stranger uses for `listener`: its own, or `outside` when it binds every interface."""
    return outside if listener.host in ("0.0.0.0", "::") else listener.host.removeprefix("::ffff:")


def answers(host: str, port: int) -> bool:
    """A TCP connection is accepted."""
    try:
        with socket.create_connection((host, port), timeout=3):
            return True
    except OSError:
        return False


def grpc_code(host: str, port: int, method: str, timeout_s: float = 15.0):
    """The status of one unary call with no credential (grpc.StatusCode.OK when it was served)."""
    import grpc

    with grpc.insecure_channel(f"{host}:{port}") as channel:
        try:
            channel.unary_unary(method)(b"", timeout=timeout_s)
        except grpc.RpcError as e:
            return e.code()
    return grpc.StatusCode.OK


def refuses_without_token(host: str, port: int) -> bool:
    """Some known gRPC service there refuses a call without Ray's token as unauthenticated."""
    return _grpc_verdict(host, port)[0] is Verdict.GRPC_REFUSED


def _grpc_verdict(host: str, port: int) -> tuple[Verdict | None, str]:
    import grpc

    spoke_grpc = False
    for method in GRPC_READS:
        code = grpc_code(host, port, method)
        if code is grpc.StatusCode.UNAUTHENTICATED:
            return Verdict.GRPC_REFUSED, method
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            if not spoke_grpc:
                return None, ""  # not an HTTP/2 server (or not answering it): no other method will differ
            continue
        spoke_grpc = True
        if code is not grpc.StatusCode.UNIMPLEMENTED:
            return Verdict.GRPC_ANSWERED, f"{method}: {code.name}"
    return (Verdict.GRPC_UNKNOWN, "") if spoke_grpc else (None, "")


def http_status(host: str, port: int, path: str = "/") -> int | None:
    """The status of `GET path` with no credential; None when no HTTP/1 answer comes back."""
    try:
        with socket.create_connection((host, port), timeout=10) as s:
            s.settimeout(10)  # generous: a busy machine's servers answer late
            s.sendall(f"GET {path} HTTP/1.0\r\nHost: {host}:{port}\r\n\r\n".encode())
            head = s.recv(64)
    except OSError:
        return None
    if not head.startswith(b"HTTP/1."):
        return None
    return int(head.split()[1])


HTTP_PATHS = ("/", "/metrics", "/v1/models", "/api/v0/nodes")


def _http_verdict(statuses: dict[str, int | None]) -> Verdict:
    served = {path for path, status in statuses.items() if status is not None and 200 <= status < 300}
    refused = {path for path, status in statuses.items() if status in (401, 403)}
    if served - {"/"} or (served and not refused):
        return Verdict.HTTP_ANSWERED
    return Verdict.HTTP_REFUSED if refused else Verdict.HTTP_UNCLEAR


@dataclass(frozen=True)
class StoreView:
    keys: list[str]  # every key a stranger lists
    values: dict[str, bytes]  # what it reads under them


# torch's TCPStore client waits without end for a listener that accepts and stays silent (a gloo pair), its
# timeout notwithstanding: the client runs in a process of its own, which ends itself when the store has not
# answered `timeout_s` after torch loaded (the load alone takes tens of seconds on a busy machine).
_STORE_CLIENT = """
import json, os, sys, threading
from datetime import timedelta
import torch.distributed as dist
threading.Timer(float(sys.argv[3]) + 5, os._exit, (3,)).start()
store = dist.TCPStore(sys.argv[1], int(sys.argv[2]), None, False, timedelta(seconds=float(sys.argv[3])))
print(json.dumps({key: bytes(store.get(key)).hex() for key in store.list_keys()}), flush=True)
os._exit(0)
"""


def store_view(host: str, port: int, timeout_s: float = 3.0) -> StoreView | None:
    """What a TCPStore client lists and reads there; None when it is no TCPStore."""
    try:
        done = subprocess.run([sys.executable, "-c", _STORE_CLIENT, host, str(port), str(timeout_s)],
                              capture_output=True, text=True, timeout=600)  # a backstop: the client times itself
    except subprocess.TimeoutExpired:
        return None
    if done.returncode != 0 or not done.stdout.strip():
        return None
    values = {key: bytes.fromhex(value) for key, value in json.loads(done.stdout.splitlines()[-1]).items()}
    return StoreView(list(values), values)


def silent_to_strangers(host: str, port: int, wait_s: float = 3.0) -> bool:
    """Random bytes in (a wrong link token, a made-up gloo pair id): nothing comes back before the listener
    closes the connection or `wait_s` passes."""
    try:
        with socket.create_connection((host, port), timeout=3) as s:
            s.settimeout(wait_s)
            s.sendall(os.urandom(64))
            return s.recv(1) == b""
    except TimeoutError:
        return True
    except OSError:  # reset: closed on us
        return True


def knock(listener: Listener, outside: str) -> Knock:
    """What `listener` does for a stranger with no credential (module docstring)."""
    host = reach(listener, outside)
    if not answers(host, listener.port):
        return Knock(listener, Verdict.CLOSED)
    verdict, detail = _grpc_verdict(host, listener.port)
    if verdict is not None:
        return Knock(listener, verdict, detail)
    if http_status(host, listener.port, "/") is not None:  # an HTTP/1 server answers any path
        statuses = {path: http_status(host, listener.port, path) for path in HTTP_PATHS}
        return Knock(listener, _http_verdict(statuses), repr(statuses))
    if not silent_to_strangers(host, listener.port):
        return Knock(listener, Verdict.BYTES_ANSWERED)
    view = store_view(host, listener.port)  # a TCPStore is silent to bytes it cannot parse, too
    if view is not None:
        return Knock(listener, Verdict.STORE, f"{len(view.keys)} keys")
    return Knock(listener, Verdict.SILENT)


def knock_all(found: list[Listener], outside: str) -> list[Knock]:
    """`knock` on every listener, a few at a time (each knock waits on timeouts, not on the CPU)."""
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        return list(pool.map(lambda entry: knock(entry, outside), found))
