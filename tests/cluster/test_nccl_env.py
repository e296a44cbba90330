"""The environment that keeps NCCL's bootstrap and socket transport on the node's cluster address
(cluster/nccl_env.py): the interface holding the address, matched exactly; a user's own choice untouched."""
from __future__ import annotations

import logging

from cluster.nccl_env import interface_addresses, nccl_socket_env, pin_nccl_sockets

INTERFACES = {"lo": "127.0.0.1", "eth0": "10.0.0.5", "eth10": "10.0.1.5", "docker0": "172.17.0.1"}


def test_the_interface_holding_the_node_address_is_named_exactly():
    # `=eth0`, not `eth0`: a bare prefix would also let NCCL use eth10 (NCCL's prefix matching)
    assert nccl_socket_env("10.0.0.5", {}, INTERFACES) == {"NCCL_SOCKET_IFNAME": "=eth0"}
    assert nccl_socket_env("10.0.1.5", {}, INTERFACES) == {"NCCL_SOCKET_IFNAME": "=eth10"}


def test_a_loopback_node_keeps_nccl_on_loopback():
    """The embedded default: Ray's node address is 127.0.0.1, so NCCL listens there too."""
    assert nccl_socket_env("127.0.0.1", {}, INTERFACES) == {"NCCL_SOCKET_IFNAME": "=lo"}


def test_the_users_choice_wins():
    for user in ({"NCCL_SOCKET_IFNAME": "ib0"}, {"NCCL_COMM_ID": "10.0.0.5:29500"}):
        assert nccl_socket_env("10.0.0.5", user, INTERFACES) == {}
    assert nccl_socket_env("10.0.0.5", {"NCCL_SOCKET_IFNAME": ""}, INTERFACES) == {"NCCL_SOCKET_IFNAME": "=eth0"}


def test_an_address_on_no_interface_leaves_nccl_its_own_choice(caplog):
    assert nccl_socket_env("203.0.113.7", {}, INTERFACES) == {}
    environ: dict[str, str] = {}
    with caplog.at_level(logging.WARNING, logger="cluster.nccl_env"):
        assert pin_nccl_sockets("203.0.113.7", environ) == {}
    assert environ == {} and "203.0.113.7" in caplog.text


def test_this_machines_interfaces_are_read_and_applied():
    found = interface_addresses()
    assert found.get("lo") == "127.0.0.1", found  # Linux names its loopback lo
    environ = {"PATH": "/bin"}
    assert pin_nccl_sockets("127.0.0.1", environ) == {"NCCL_SOCKET_IFNAME": "=lo"}
    assert environ == {"PATH": "/bin", "NCCL_SOCKET_IFNAME": "=lo"}
    for address in found.values():  # every address of this machine maps back to its own interface
        assert nccl_socket_env(address, {}, found) == {"NCCL_SOCKET_IFNAME": "=" + min(
            n for n, a in found.items() if a == address)}
