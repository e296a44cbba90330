"""Connecting to Ray: an existing cluster (`address`) or an embedded one started in this process."""
from __future__ import annotations

import logging
import os
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
        ray.init(num_cpus=num_cpus, num_gpus=opts.num_gpus, object_store_memory=opts.object_store_memory,
                 resources=opts.resources, _temp_dir=opts.temp_dir, include_dashboard=False, namespace=opts.namespace,
                 log_to_driver=opts.log_to_driver)
    return ray.cluster_resources()


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
