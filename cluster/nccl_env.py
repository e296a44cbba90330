"""NCCL's sockets on the node's cluster address (docs/reliability.md, "Exposure").

NCCL documents NCCL_SOCKET_IFNAME as "which IP interfaces to use for communication", a list of name
prefixes where `=name` matches one interface exactly (docs.nvidia.com/deeplearning/nccl, Environment
Variables). Its bootstrap (the sockets that exchange the unique id's peers' addresses when a communicator
forms) picks its interface from the same variable unless NCCL_COMM_ID names the root's address (NVIDIA/nccl,
src/bootstrap.cc, bootstrapNetInit), once per process. Left to itself NCCL may pick any interface up; a
decode group's ranks are told the node's address (Ray's view of it, the one gloo pairs and rendezvous stores
bind), so NCCL is pinned to the interface that holds it, before the process's first communicator. A user's
own NCCL_SOCKET_IFNAME or NCCL_COMM_ID wins: they know their fabric.

No torch here: the environment is computed by plain functions a CPU test checks.
"""
from __future__ import annotations

import fcntl
import logging
import os
import socket
import struct
from collections.abc import Mapping, MutableMapping

log = logging.getLogger(__name__)

USER_CHOICES = ("NCCL_SOCKET_IFNAME", "NCCL_COMM_ID")  # either one decides NCCL's bootstrap interface
SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's (primary) IPv4 address


def interface_addresses() -> dict[str, str]:
    """interface name -> its IPv4 address, for this machine's interfaces that have one (Linux, as NCCL)."""
    found = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                reply = fcntl.ioctl(probe.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on it
                continue
            found[name] = socket.inet_ntoa(reply[20:24])
    return found


def nccl_socket_env(node_address: str, environ: Mapping[str, str], interfaces: Mapping[str, str]) -> dict[str, str]:
    """The variables to add so NCCL's sockets use `node_address`'s interface: {} where the user chose
    (USER_CHOICES set) or no interface holds the address (NCCL's own choice then; the caller warns)."""
    if any(environ.get(name) for name in USER_CHOICES):
        return {}
    names = sorted(name for name, address in interfaces.items() if address == node_address)
    if not names:
        return {}
    return {"NCCL_SOCKET_IFNAME": "=" + names[0]}


def pin_nccl_sockets(node_address: str, environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Apply `nccl_socket_env` to this process's environment (NCCL reads it when its first communicator
    forms); returns what was added."""
    added = nccl_socket_env(node_address, environ, interface_addresses())
    if not added and not any(environ.get(name) for name in USER_CHOICES):
        log.warning("no interface holds the node address %s: NCCL picks its own (set NCCL_SOCKET_IFNAME to keep "
                    "its sockets on the cluster network)", node_address)
    environ.update(added)
    return added
