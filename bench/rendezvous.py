"""Group formation time through the rendezvous (cluster/rendezvous.py), between Ray actor processes on this
machine:
- channel: a hand-over channel opened between two ChannelProbes (gloo control group and place exchange, what a
  prefill does per decode rank);
- tp2_rendezvous: what a tp=2 decode group's ranks do in the store while joining (rank.py `join`): the TP gloo
  group and the shared-memory collectives, rank 0 on its own store, rank 1 through `connect_store`;
- tp2_group: a tp=2 decode group started as the decode replica starts one (RankGroup.start: rank actors, the
  TP group, shared-memory collectives, the engine shards, step links), mostly process start and model load.

Medians (and min/max) in seconds. Run the same command on two trees to compare them (the A/B alternates
nothing within one process: a rendezvous is a module choice, not a flag).

    python -m bench.rendezvous [--channels 20] [--groups 3]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
import uuid


def _channels(count: int) -> list[float]:
    import ray

    from cluster.probe import ChannelProbe

    tx, rx = ChannelProbe.remote("cpu", "network"), ChannelProbe.remote("cpu", "network")
    address = ray.get(rx.address.remote())
    ray.get(tx.pid.remote())
    seconds = []
    for _ in range(count + 1):  # the first warms both processes' imports: not counted
        cid = uuid.uuid4().hex[:10]
        start = time.perf_counter()
        accepted = rx.accept.remote(cid)
        ray.get([tx.connect.remote(address, cid), accepted])
        seconds.append(time.perf_counter() - start)
        ray.get([tx.close.remote(cid, False), rx.close.remote(cid, False)])
    ray.kill(tx)
    ray.kill(rx)
    return seconds[1:]


def _join_rendezvous(probe, address, rank: int, prefix: str) -> float:
    """Runs on a ChannelProbe (`__ray_call__`): rank `rank`'s part of a tp=2 join, timed."""
    from cluster.groups import GlooBackend, build_group
    from cluster.rendezvous import connect_store
    from engine.distributed import shm_collectives

    start = time.perf_counter()
    store = probe.server.store if rank == 0 else connect_store(address, 60.0)
    group = build_group(store, prefix, rank, 2, GlooBackend(), 60.0)
    shm = shm_collectives.connect(store, prefix, rank, 2, 1 << 16, 60.0)
    assert shm is not None, "the two probes could not share a segment"
    seconds = time.perf_counter() - start
    probe.bench_groups = [group, shm]  # dropped only at the next round: the peer may still be connecting
    return seconds


def _tp_rendezvous(count: int) -> list[float]:
    import ray

    from cluster.probe import ChannelProbe

    ranks = [ChannelProbe.remote("cpu", "network") for _ in range(2)]
    address = ray.get(ranks[0].address.remote())
    seconds = []
    for i in range(count + 1):  # the first warms imports: not counted
        start = time.perf_counter()
        ray.get([r.__ray_call__.remote(_join_rendezvous, address, rank, f"tp/{i}/") for rank, r in enumerate(ranks)])
        seconds.append(time.perf_counter() - start)
    for r in ranks:
        ray.kill(r)
    return seconds[1:]


def _groups(model: str, count: int) -> list[float]:
    from cluster.placement import RankResources
    from cluster.settings import EngineSettings
    from decode_worker.group import GroupSpec, RankGroup

    spec = GroupSpec(engine=EngineSettings(model=model, num_kv_blocks=32, block_size=16), tp_size=2,
                     resources=RankResources(num_cpus=0.5))

    async def one() -> float:
        start = time.perf_counter()
        group = await RankGroup.start(spec)
        seconds = time.perf_counter() - start
        group.kill()
        return seconds

    return [asyncio.run(one()) for _ in range(count)]


def _summary(seconds: list[float]) -> dict:
    return {"median_s": round(statistics.median(seconds), 4), "min_s": round(min(seconds), 4),
            "max_s": round(max(seconds), 4), "n": len(seconds)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.rendezvous", description=__doc__.splitlines()[0])
    ap.add_argument("--channels", type=int, default=20, help="channels opened between two probes")
    ap.add_argument("--groups", type=int, default=3, help="tp=2 decode groups started")
    args = ap.parse_args(argv)

    from cluster.runtime import RayOptions, init_ray
    from cluster.testing import NODE_KINDS, build_tiny_llama

    tmp = tempfile.mkdtemp(prefix="tandem-bench-rdv-")
    model = build_tiny_llama(f"{tmp}/tiny")
    init_ray(RayOptions(num_cpus=8, object_store_memory=128 * 2**20, temp_dir=f"{tmp}/ray", resources=NODE_KINDS))
    result = {"channel": _summary(_channels(args.channels)), "tp2_rendezvous": _summary(_tp_rendezvous(args.channels))}
    if args.groups:
        result["tp2_group"] = _summary(_groups(model, args.groups))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
