"""Connecting to Ray: an existing cluster (`address`) or an embedded one started in this process.

The embedded Ray has no side doors (docs/reliability.md, "Exposure"): its node address is loopback, so
the GCS, raylet, workers, agents and metrics servers all listen on 127.0.0.1, and Ray's token
authentication is on (explicitly: not left to a default a Ray version may change) with a token of this
process unless the user gave one.
"""
from __future__ import annotations

import contextlib
import logging
import os
import secrets
from dataclasses import dataclass

import ray

log = logging.getLogger(__name__)

NAMESPACE = "tandem"


@dataclass(frozen=True, slots=True)
class RayOptions:
    address: str | None = None  # None: start Ray here; "auto" or "host:port" or "ray://...": join it
    num_cpus: int | None = None  # embedded only; None: this machine's cores
    num_gpus: int | None = None  # embedded only; None: what Ray detects
    object_store_memory: int | None = 256 * 2**20  # embedded only: KV never travels through it
    temp_dir: str | None = None  # embedded only
    resources: dict | None = None  # embedded only: custom resources this node declares (ray start --resources)
    namespace: str = NAMESPACE
    log_to_driver: bool = True


def init_ray(opts: RayOptions = RayOptions()) -> dict:
    """Start or join Ray once per process; returns the cluster's resources. Idempotent."""
    if ray.is_initialized():
        return ray.cluster_resources()
    if opts.address is not None:
        log.info("joining the Ray cluster at %s", opts.address)
        ray.init(address=opts.address, namespace=opts.namespace, log_to_driver=opts.log_to_driver)
    else:
        num_cpus = opts.num_cpus or os.cpu_count() or 1
        log.info("starting an embedded Ray with %d CPUs", num_cpus)
        require_token_auth()
        with _loopback_node():
            ray.init(num_cpus=num_cpus, num_gpus=opts.num_gpus, object_store_memory=opts.object_store_memory,
                     resources=opts.resources, _temp_dir=opts.temp_dir, include_dashboard=False,
                     namespace=opts.namespace, log_to_driver=opts.log_to_driver)
    return ray.cluster_resources()


def require_token_auth() -> None:
    """Ray's token authentication on for the Ray this process starts; without a token of the user's
    (RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH), one of this process's own, inherited by its children and
    written nowhere (Ray would otherwise create ~/.ray/auth_token readable by every user)."""
    from ray._raylet import Config

    os.environ["RAY_AUTH_MODE"] = "token"
    if not os.environ.get("RAY_AUTH_TOKEN") and not os.environ.get("RAY_AUTH_TOKEN_PATH"):
        os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
    Config.initialize("")  # Ray read RAY_AUTH_MODE when it was imported: re-read it (as ray.init's own default does)


@contextlib.contextmanager
def _loopback_node():
    """Ray picks a single-node Ray's address from ENABLE_RAY_CLUSTER (off: loopback, as on a laptop OS);
    every daemon binds to the node address or to loopback when it is one. Only the driver's choice
    matters (the daemons are told the address), so the switch is held for `ray.init` alone, and nothing of
    it reaches a `ray start` this process may run later. tests/deploy/test_exposure.py lists the
    listeners, so a Ray release that moves this knob fails there, not silently."""
    from ray._private import ray_constants

    before = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = before


def shutdown_ray() -> None:
    if ray.is_initialized():
        ray.shutdown()


def replica_id() -> str:
    """This Serve replica's id (stats are keyed by it); "local" outside Serve (tests driving a class)."""
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - no replica context here
        return "local"
