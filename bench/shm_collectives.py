"""What one tensor-parallel collective costs between CPU ranks of one host: gloo against shared memory
(engine/distributed/shm_collectives.py), in the same run, per tensor size: wall time and CPU time per call in each rank.

    python -m bench.shm_collectives [--tp 2] [--calls 2000] [--repeats 3]

Sizes: a decode step's activations at batch 1 and 64 (x 4 rows: MTP k=3 verifies 4 per request) for the
zoo target's hidden size 192 and a 1B model's 2048, and a rank's share of the logits. Ranks run one torch
thread each (as decode ranks do); both paths alternate, best of `--repeats`.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SHAPES = [(4, 192), (256, 192), (4, 2048), (256, 2048), (256, 4096)]


def _rank(rank: int, tp: int, port: int, calls: int, repeats: int, queue) -> None:
    from engine.distributed import shm_collectives
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, tp, rank == 0)
    group = dist.ProcessGroupGloo(store, rank, tp, dist.constants.default_pg_timeout)
    shm = shm_collectives.connect(store, "bench/", rank, tp, slot_bytes=8 * 2**20)
    paths = {"gloo": lambda x: group.allreduce([x]).wait(), "shm": shm.all_reduce}
    for shape in SHAPES:
        x = torch.randn(shape)
        best: dict[str, tuple[float, float]] = {}
        for _ in range(repeats):
            for name, reduce in paths.items():
                for _ in range(20):
                    reduce(x)
                x.normal_()
                t0, c0 = time.perf_counter(), time.process_time()
                for _ in range(calls):
                    reduce(x)
                    x.mul_(0.5)  # keeps values finite; the same work on both paths
                wall, cpu = (time.perf_counter() - t0) / calls, (time.process_time() - c0) / calls
                if name not in best or wall < best[name][0]:
                    best[name] = (wall, cpu)
        queue.put((rank, shape, best))
    if rank:
        store.add("done", 1)
    else:  # rank 0's store serves the others: it stays until they are through with it
        while store.add("done", 0) < tp - 1:
            time.sleep(0.01)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.shm_collectives", description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--name", default="shm_collectives_cpu")
    args = ap.parse_args(argv)

    from bench.common import device_name, write_results
    from cluster.rendezvous import free_port_on

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port_on("127.0.0.1")
    procs = [ctx.Process(target=_rank, args=(r, args.tp, port, args.calls, args.repeats, queue))
             for r in range(args.tp)]
    for p in procs:
        p.start()
    results: dict[tuple, dict] = {}
    for _ in range(args.tp * len(SHAPES)):
        rank, shape, best = queue.get(timeout=900)
        results.setdefault(tuple(shape), {})[rank] = best
    for p in procs:
        p.join(timeout=60)

    rows = []
    lines = [f"# All-reduce between CPU ranks of one host: gloo vs shared memory ({device_name('cpu')})", "",
             f"tp={args.tp}, one torch thread per rank, {args.calls} calls per measurement, both paths alternating, "
             f"best of {args.repeats}. Per call: wall time, and CPU time of the slowest rank.", "",
             "| shape | bytes | gloo wall us | gloo CPU us | shm wall us | shm CPU us | wall gloo / shm |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for shape in SHAPES:
        per_rank = results[shape]
        g_wall = max(b["gloo"][0] for b in per_rank.values()) * 1e6
        g_cpu = max(b["gloo"][1] for b in per_rank.values()) * 1e6
        s_wall = max(b["shm"][0] for b in per_rank.values()) * 1e6
        s_cpu = max(b["shm"][1] for b in per_rank.values()) * 1e6
        nbytes = shape[0] * shape[1] * 4
        rows.append({"shape": list(shape), "bytes": nbytes, "gloo_wall_us": g_wall, "gloo_cpu_us": g_cpu,
                     "shm_wall_us": s_wall, "shm_cpu_us": s_cpu})
        lines.append(f"| {list(shape)} | {nbytes} | {g_wall:.0f} | {g_cpu:.0f} | {s_wall:.1f} | {s_cpu:.1f} | "
                     f"{g_wall / s_wall:.0f}x |")
    table = "\n".join(lines)
    path = write_results(args.name, {"tp": args.tp, "calls": args.calls, "rows": rows}, table)
    print(table)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
