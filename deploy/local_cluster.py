"""Run deploy/cluster.yaml's node start commands on this machine: a head and worker nodes as separate Ray
nodes, each its own `tandem ray-start --block` process (`ray start` with Ray's metrics exporters off:
deploy/ray_start.py) with its own temp dir and ports.

The commands are read from the YAML (head_start_ray_commands / worker_start_ray_commands), not written
again here, so that the test that runs them (tests/deploy/test_two_node.py) keeps the YAML honest. What a
laptop-sized run changes, and why, is all in `start_argv`:
- `ray stop` lines are skipped: on a shared machine it would stop every Ray on it; a local node is stopped
  by ending its own `ray start --block` process group (`LocalNode.stop`);
- the fixed ports (6379, 8076) become free ones, and every address (the head's, each
  node's, the dashboard's) the cluster's `host`: loopback by default; this machine's network address where a
  test must see what a stranger on the network sees (tests/deploy/test_two_node.py). Several nodes
  (and other users' Rays) share this machine's ports;
- `--autoscaling-config` is dropped: no autoscaler here;
- the node's resources, which the autoscaler passes from `available_node_types`, are given as flags, with
  the CPUs and the object store made small (logical CPUs; each node costs memory).
"""
from __future__ import annotations

import json
import os
import secrets
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from cluster.rendezvous import free_port_on, free_ports_on

CLUSTER_YAML = Path(__file__).with_name("cluster.yaml")
TANDEM = str(Path(sys.executable).with_name("tandem"))  # the tandem of this environment, as `tandem` is on a node
START = ["tandem", "ray-start"]


def load_cluster(path: Path = CLUSTER_YAML) -> dict:
    return yaml.safe_load(path.read_text())


def custom_resources(cluster: dict, *node_types: str) -> dict[str, float]:
    """The custom resources of `node_types` together (CPU and GPU are given on their own)."""
    merged: dict[str, float] = {}
    for kind in node_types:
        for name, amount in cluster["available_node_types"][kind]["resources"].items():
            if name not in ("CPU", "GPU"):
                merged[name] = merged.get(name, 0) + amount
    return merged


OWN_PORTS = ("object-manager-port", "node-manager-port", "dashboard-agent-listen-port", "dashboard-agent-grpc-port",
             "runtime-env-agent-port", "metrics-export-port", "ray-client-server-port")


@dataclass(frozen=True)
class NodePorts:
    """Every port a Ray node binds, chosen free, so that nodes on one machine do not collide."""
    gcs: int  # the head's --port; workers join host:gcs
    dashboard: int
    own: dict[str, int]

    @classmethod
    def fresh(cls, gcs: int) -> "NodePorts":
        """A node's ports, distinct from each other and from every port handed out before (free_ports_on),
        free on every address: loopback and this machine's network address alike."""
        dashboard, *own = free_ports_on("", 1 + len(OWN_PORTS))
        return cls(gcs, dashboard, dict(zip(OWN_PORTS, own)))


def start_argv(cluster: dict, head: bool, ports: NodePorts, temp_dir: str, num_cpus: int,
               resources: dict[str, float], object_store_bytes: int = 80 * 2**20, host: str = "127.0.0.1") -> list[str]:
    """The YAML's `tandem ray-start` line for a head (or worker) node, adapted to run here (module docstring)."""
    lines = [shlex.split(line) for line in cluster["head_start_ray_commands" if head else "worker_start_ray_commands"]]
    lines = [(_env_prefix(words), words[len(_env_prefix(words)):]) for words in lines]
    starts = [(env, words) for env, words in lines if words[:2] == START]
    unknown = [words for _, words in lines if words[:2] not in (START, ["ray", "stop"])]
    if len(starts) != 1 or unknown:
        raise ValueError(f"expected one `tandem ray-start` (and `ray stop`) in {lines!r}: teach deploy/local_cluster.py "
                         f"the new step so that the two-node test runs it too")
    own = {f"--{name}": str(port) for name, port in ports.own.items()
           if head or name != "ray-client-server-port"}  # the client server is the head's
    subst = {"--port": str(ports.gcs), "--address": f"{host}:{ports.gcs}", "--dashboard-host": host,
             "--autoscaling-config": None, **own}
    env, words = starts[0]
    argv = ["env", *env, TANDEM, "ray-start"]  # `env`: the YAML's VAR=value prefix, then exec (the pid stays the node's)
    for token in words[2:]:
        name = token.partition("=")[0]
        if name not in subst:
            argv.append(token)
        elif subst[name] is not None:
            argv.append(f"{name}={subst[name]}")
    given = {token.partition("=")[0] for token in argv}
    argv += [f"{name}={port}" for name, port in own.items() if name not in given]  # defaults that would collide
    argv += [f"--node-ip-address={host}", f"--temp-dir={temp_dir}", f"--num-cpus={num_cpus}", f"--resources={json.dumps(resources)}",
             f"--object-store-memory={object_store_bytes}", "--disable-usage-stats", "--block"]
    if head:
        argv += [f"--dashboard-port={ports.dashboard}", "--include-dashboard=true"]
    return argv


def _env_prefix(words: list[str]) -> list[str]:
    """The leading `VAR=value` words of a shell command line."""
    n = 0
    while n < len(words) and "=" in words[n] and words[n].split("=", 1)[0].isidentifier():
        n += 1
    return words[:n]


class LocalNode:
    """One `ray start --block` process group: the node lives as long as it does."""

    def __init__(self, argv: list[str], log_path: Path, env: dict[str, str] | None = None):
        self.argv = argv
        self.log_path = log_path
        self._log = open(log_path, "ab")
        # start_new_session: the node's processes form their own group, so stop() ends them and nothing else
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**os.environ, **(env or {})})

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM to the node's process group (raylet, GCS, workers), SIGKILL to what is left after grace_s;
        grace_s=0: SIGKILL at once, a node lost as a machine is lost."""
        group = self.proc.pid
        members = _group_members(group)
        for sig in (signal.SIGTERM, signal.SIGKILL) if grace_s > 0 else (signal.SIGKILL,):
            for pid in members:
                _signal(pid, sig)
            _signal_group(group, sig)
            deadline = time.monotonic() + grace_s
            while time.monotonic() < deadline and _group_members(group):
                time.sleep(0.2)
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            pass
        self._log.close()

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]


def _group_members(pgid: int) -> list[int]:
    """Live processes of process group `pgid` (from /proc: no psutil here)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                pids.append(int(entry))
    return pids


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class LocalCluster:
    """A head and worker nodes of cluster.yaml's node types on this machine, with their own Ray token, driven
    only over the dashboard's HTTP API and the `serve` CLI: no Ray driver in the calling process, so it can
    run beside the embedded Ray of a test session."""

    def __init__(self, root: Path, env: dict[str, str], cluster: dict | None = None, num_cpus: int = 2,
                 host: str = "127.0.0.1"):
        self.root, self.cluster, self.num_cpus, self.host = root, cluster or load_cluster(), num_cpus, host
        self.token = secrets.token_hex(32)  # this cluster's own, not ~/.ray/auth_token (Ray's token auth stays on)
        self.env = {**env, "RAY_AUTH_TOKEN": self.token, "RAY_AUTH_MODE": "token"}
        self.gcs = free_port_on("")  # free on every address, never handed out before
        self.nodes: dict[str, LocalNode] = {}
        self.ports: dict[str, NodePorts] = {}
        self.dashboard = ""

    def start_head(self, *node_types: str) -> LocalNode:
        ports = NodePorts.fresh(self.gcs)
        self.dashboard = f"http://{self.host}:{ports.dashboard}"
        return self._start("head", True, ports, ("head", *node_types))

    def start_worker(self, name: str, *node_types: str) -> LocalNode:
        return self._start(name, False, NodePorts.fresh(self.gcs), node_types)

    def _start(self, name: str, head: bool, ports: NodePorts, node_types: tuple[str, ...]) -> LocalNode:
        temp_dir = tempfile.mkdtemp(prefix=f"{name}-", dir=self.root)
        argv = start_argv(self.cluster, head, ports, temp_dir, self.num_cpus, custom_resources(self.cluster, *node_types),
                          host=self.host)
        node = LocalNode(argv, self.root / f"{Path(temp_dir).name}.log", self.env)
        self.nodes[name] = node
        self.ports[name] = ports
        return node

    def get(self, path: str, timeout_s: float = 30.0):
        import httpx

        reply = httpx.get(self.dashboard + path, headers={"Authorization": f"Bearer {self.token}"}, timeout=timeout_s)
        reply.raise_for_status()
        return reply.json()

    def alive_nodes(self) -> dict[str, dict[str, float]]:
        """node id -> resources of the nodes the GCS holds alive."""
        rows = self.get("/api/v0/nodes?detail=1&limit=100")["data"]["result"]["result"]
        return {n["node_id"]: n["resources_total"] for n in rows if n["state"] == "ALIVE"}

    def actors(self) -> list[dict]:
        """Live actors: class_name, name, node_id, state..."""
        rows = self.get("/api/v0/actors?detail=1&limit=1000")["data"]["result"]["result"]
        return [a for a in rows if a["state"] == "ALIVE"]

    def serve(self, *args: str, timeout_s: float = 120.0) -> str:
        """Run the `serve` CLI against this cluster (as a user does, from this environment)."""
        done = subprocess.run([str(Path(sys.executable).with_name("serve")), *args, "-a", self.dashboard],
                              capture_output=True, text=True, env={**os.environ, **self.env}, timeout=timeout_s)
        if done.returncode != 0:
            raise RuntimeError(f"serve {' '.join(args)} failed ({done.returncode}): {done.stdout}\n{done.stderr}")
        return done.stdout

    def applications(self) -> dict:
        return self.get("/api/serve/applications/").get("applications", {})

    def stop(self) -> None:
        for node in reversed(list(self.nodes.values())):
            if node.alive():
                node.stop()
