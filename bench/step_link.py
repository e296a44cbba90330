"""What the decode group's per-step control path costs: step links (cluster/step_link.py) against Ray
actor calls, in the same run.

A decode replica sends each rank of its group one RankStep per step and reads one StepReport back. This
runs a real RankGroup (the zoo target, tp=1 and tp=2) through steps with nothing to compute, so what is
measured is the path itself plus the rank's fixed per-step bookkeeping (the same in both modes): wall
time per step, and CPU per step of this process (the replica's role) and of the ranks, read from /proc.
Lockstep (one step in flight) and two in flight, as the replica runs them. Modes alternate, best of
`--repeats` by wall time.

    python -m bench.step_link [--steps 400] [--repeats 3] [--tps 1,2]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time

from bench import proc_cpu
from bench.common import device_name, write_results

MODES = {"step link": True, "Ray call": False}


async def _run_steps(group, steps: int, in_flight: int) -> dict:
    from cluster.protocol import RankStep

    work = [RankStep(commands=(), forward=False, reports_tokens=r == 0) for r in range(group.spec.tp_size)]
    for _ in range(20):  # warm-up
        await group.step(work, 0.0)
    before, cpu0, t0 = proc_cpu.snapshot(), time.process_time(), time.perf_counter()
    pending: list[asyncio.Future] = []
    for _ in range(steps):
        pending.append(group.submit(work, 0.0))
        if len(pending) >= in_flight:
            await pending.pop(0)
    for p in pending:
        await p
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    ranks = proc_cpu.used(before, proc_cpu.snapshot()).get("DecodeRank", 0.0)
    return {"wall_ms": wall / steps * 1e3, "replica_cpu_ms": cpu / steps * 1e3, "ranks_cpu_ms": ranks / steps * 1e3}


async def _measure(args, model: str) -> list[dict]:
    from cluster.placement import RankResources
    from cluster.settings import EngineSettings
    from decode_worker.group import GroupSpec, RankGroup

    rows = []
    for tp in args.tps:
        groups = {}
        for mode, link in MODES.items():
            spec = GroupSpec(engine=EngineSettings(model=model, num_kv_blocks=64, torch_threads=1), tp_size=tp,
                             resources=RankResources(num_cpus=1), step_link=link)
            groups[mode] = await RankGroup.start(spec)
        try:
            for in_flight in (1, 2):
                best: dict[str, dict] = {}
                for _ in range(args.repeats):
                    for mode, group in groups.items():  # alternating: a burst of load hits both
                        r = await _run_steps(group, args.steps, in_flight)
                        if mode not in best or r["wall_ms"] < best[mode]["wall_ms"]:
                            best[mode] = r
                for mode, r in best.items():
                    rows.append({"tp": tp, "in_flight": in_flight, "mode": mode, **r})
                    print(f"tp={tp} in flight {in_flight} {mode:9s}: {r['wall_ms']:.3f} ms/step, CPU ms/step "
                          f"replica {r['replica_cpu_ms']:.3f}, ranks {r['ranks_cpu_ms']:.3f}", flush=True)
        finally:
            for g in groups.values():
                g.kill()
    return rows


def summarize(results: dict) -> str:
    lines = [f"# Decode group control path: step links vs Ray actor calls ({results['device']})", "",
             f"RankGroup of the zoo target, {results['steps']} steps with nothing to compute per measurement "
             f"(best of {results['repeats']}, modes alternating); CPU from /proc (ranks: all of the group's "
             f"rank processes). Load average {results['load'][0]:.2f} before, {results['load'][1]:.2f} after.", "",
             "| tp | steps in flight | mode | wall ms/step | replica CPU ms/step | ranks CPU ms/step | "
             "CPU vs Ray call |",
             "|---:|---:|---|---:|---:|---:|---:|"]
    rows = results["rows"]
    for r in rows:
        ray_row = next(x for x in rows if x["tp"] == r["tp"] and x["in_flight"] == r["in_flight"]
                       and x["mode"] == "Ray call")
        total, ray_total = (r["replica_cpu_ms"] + r["ranks_cpu_ms"],
                            ray_row["replica_cpu_ms"] + ray_row["ranks_cpu_ms"])
        lines.append(f"| {r['tp']} | {r['in_flight']} | {r['mode']} | {r['wall_ms']:.3f} | {r['replica_cpu_ms']:.3f} | "
                     f"{r['ranks_cpu_ms']:.3f} | {total / ray_total:.2f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.step_link", description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tps", default="1,2")
    ap.add_argument("--name", default="step_link_cpu")
    args = ap.parse_args(argv)
    args.tps = [int(t) for t in args.tps.split(",")]

    import ray
    import torch

    import zoo
    from cluster.runtime import RayOptions, init_ray

    torch.set_num_threads(1)  # as each rank's engine; this process only sends steps
    model = str(zoo.layout(zoo.ensure_built()).target)
    init_ray(RayOptions(num_cpus=8, temp_dir=f"{tempfile.mkdtemp(prefix='tandem-bench-')}/ray"))
    load0 = os.getloadavg()[0]
    try:
        rows = asyncio.run(_measure(args, model))
    finally:
        ray.shutdown()
    results = {"device": device_name("cpu"), "steps": args.steps, "repeats": args.repeats,
               "load": (load0, os.getloadavg()[0]), "rows": rows}
    table = summarize(results)
    print(table)
    print(f"wrote {write_results(args.name, results, table)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
