"""What a replica or a rank asks Ray for, as the user writes it (TandemConfig / DecodeConfig fields): a GPU
share whose default follows the device, and custom resources, the labels that steer a kind of actor onto a
kind of node (`ray start --resources '{"tandem_decode": 4}'`; deploy/cluster.yaml's node types).

No Ray import: the configs (and so the CLI's --help) load without it."""
from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator

# Spelled by their own fields (num_cpus / num_gpus); asking for them here too would reserve them twice.
_BUILTIN = {"CPU", "GPU", "memory", "object_store_memory"}


def _check_custom(resources: dict[str, float]) -> dict[str, float]:
    for name, amount in resources.items():
        if not name or name in _BUILTIN:
            raise ValueError(f"custom resource name {name!r} is not allowed: CPUs and GPUs have their own fields "
                             f"(*_num_cpus / *_num_gpus); name a resource your nodes declare, e.g. "
                             f"{{\"tandem_decode\": 1}}")
        if not amount >= 0:
            raise ValueError(f"custom resource {name!r}: the amount must be >= 0, got {amount}")
    return resources


CustomResources = Annotated[dict[str, float], AfterValidator(_check_custom)]


def engine_gpus(device: str, asked: float | None, field: str) -> float:
    """GPUs reserved for one engine (a prefill replica or a decode rank): `asked`, or one on CUDA and none on
    CPU. One engine drives one device, so at most 1; a share below 1 lets engines share a GPU."""
    gpus = (1.0 if device == "cuda" else 0.0) if asked is None else asked
    if not 0 <= gpus <= 1:
        raise ValueError(f"{field} must be between 0 and 1 (one engine drives one device; 0.5 lets two share "
                         f"it), got {gpus}")
    if device == "cuda" and gpus == 0:
        raise ValueError(f"{field}=0 with device cuda: a CUDA engine needs a GPU share (> 0), or Ray does not "
                         f"count it and may place more engines on one GPU than its memory holds")
    if device == "cpu" and gpus > 0:
        raise ValueError(f"{field}={asked} reserves GPUs for a CPU engine; set device: cuda, or leave {field} "
                         f"unset")
    return gpus
