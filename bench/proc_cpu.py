"""CPU seconds per process role, read from /proc: where a served run spends this machine's cores.

Ray names its worker processes by what they run (`ray::ServeReplica:APP:Router`, `ray::DecodeRank.step`,
`ray::IDLE`, ...); a snapshot maps each live pid to a role and its user+system CPU seconds, and the
difference of two snapshots says how many CPU seconds each role used in between. Linux only (an empty
snapshot elsewhere), no dependencies.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _role(cmdline: str) -> str:
    """A stable role name for a process: Serve deployments by name, Ray actors by class, Ray's own daemons
    by program, this process as `bench (client + driver)`."""
    if m := re.match(r"ray::ServeReplica:[^:]*:(\w+)", cmdline):
        return m.group(1)
    if m := re.match(r"ray::(ProxyActor|ServeController)", cmdline):
        return f"serve {m.group(1)}"
    if m := re.match(r"ray::(\w+)", cmdline):
        return m.group(1) if m.group(1) != "IDLE" else "ray idle workers"
    for daemon in ("raylet", "gcs_server", "dashboard", "log_monitor", "monitor.py", "runtime_env", "plasma"):
        if daemon in cmdline:
            return "ray daemons"
    return "other"


def snapshot(root_pid: int | None = None) -> dict[int, tuple[str, float]]:
    """pid -> (role, CPU seconds so far) for this process and every process of this user's Ray session
    (`root_pid`: this process by default)."""
    me = os.getpid() if root_pid is None else root_pid
    out: dict[int, tuple[str, float]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            stat = (entry / "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        pid = int(entry.name)
        fields = stat.rsplit(")", 1)[1].split()
        seconds = (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime
        if pid == me:
            out[pid] = ("bench (client + driver)", seconds)
        elif cmd.startswith("ray::") or "/ray/" in cmd or "ray/core" in cmd:
            out[pid] = (_role(cmd), seconds)
    return out


def used(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds per role between two snapshots (a process born in between counts from zero)."""
    roles: dict[str, float] = {}
    for pid, (role, seconds) in after.items():
        start = before.get(pid, (role, 0.0))[1]
        roles[role] = roles.get(role, 0.0) + max(0.0, seconds - start)
    return dict(sorted(roles.items(), key=lambda kv: -kv[1]))
