"""Placement groups: the ranks of one tensor-parallel group are reserved together, or not at all."""
from __future__ import annotations

from dataclasses import dataclass, field

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.errors import WorkerDiedError


@dataclass(frozen=True, slots=True)
class RankResources:
    """One rank's placement-group bundle. `custom`: resources that mark the nodes a rank may land on
    (DecodeConfig.rank_resources); the bundle reserves them, so the rank actor itself need not ask."""
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    custom: dict[str, float] = field(default_factory=dict)

    def bundle(self) -> dict[str, float]:
        b = {"CPU": self.num_cpus}
        if self.num_gpus:
            b["GPU"] = self.num_gpus
        b.update({name: amount for name, amount in self.custom.items() if amount})  # Ray refuses 0 entries
        return b


async def reserve_ranks(size: int, resources: RankResources, strategy: str = "PACK",
                        timeout_s: float = 300.0, name: str = "") -> PlacementGroup:
    """One bundle per rank. PACK keeps ranks on one node when they fit (NVLink/shared memory for the
    TP collectives) and spreads them otherwise; STRICT_PACK insists on one node."""
    pg = placement_group([resources.bundle()] * size, strategy=strategy, name=name)
    ready, _ = await _wait_ready(pg, timeout_s)
    if not ready:
        remove_placement_group(pg)
        raise WorkerDiedError(f"the cluster cannot place {size} ranks of {resources.bundle()} "
                              f"({strategy}) within {timeout_s:.0f}s; available: {ray.available_resources()}")
    return pg


async def _wait_ready(pg: PlacementGroup, timeout_s: float):
    import asyncio

    try:
        await asyncio.wait_for(pg.ready(), timeout_s)
        return True, pg
    except asyncio.TimeoutError:
        return False, pg


def in_bundle(pg: PlacementGroup, index: int) -> PlacementGroupSchedulingStrategy:
    return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=index,
                                            placement_group_capture_child_tasks=False)


def release(pg: PlacementGroup | None) -> None:
    if pg is not None:
        try:
            remove_placement_group(pg)
        except Exception:  # noqa: BLE001 - already gone with its node
            pass
