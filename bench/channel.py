"""Hand-over channel transports head to head: the network transport (gloo on CPU, NCCL on CUDA) against
shared memory (/dev/shm on CPU, CUDA IPC on one GPU), between two Ray actor processes on this machine.

Per payload size: the receive-side time from "answer sent" to "payload in place" (what a decode rank
waits per hand-over), median over repeats, best of rounds; the transports alternate round by round so
that load from elsewhere hits both alike. Ratios are shared memory over network in the same run.

    python -m bench.channel [--sizes 262144,4194304,33554432] [--repeats 10] [--rounds 3] [--device cpu]
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import uuid

from bench.common import device_name, write_results


def _pair(transport: str, device: str):
    import ray

    from cluster.probe import ChannelProbe

    tx, rx = ChannelProbe.remote(device, transport), ChannelProbe.remote(device, transport)
    cid = uuid.uuid4().hex[:10]
    accepted = rx.accept.remote(cid)
    ray.get(tx.connect.remote(ray.get(rx.address.remote()), cid))
    ray.get(accepted)
    return tx, rx, cid, ray.get(tx.transport.remote(cid))


def _round(tx, rx, cid: str, size: int, repeats: int) -> float:
    import ray

    before = len(ray.get(rx.transfer_history.remote(cid)))
    ray.get(tx.send_bytes.remote(cid, size, repeats))
    deadline = time.monotonic() + 120
    while len(hist := ray.get(rx.transfer_history.remote(cid))) < before + repeats:
        assert time.monotonic() < deadline, "the probe receiver fell behind"
        time.sleep(0.05)
    return statistics.median(s for _, s in hist[-repeats:])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.channel", description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="262144,4194304,33554432", help="payload bytes")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--name", default=None, help="results name (default: channel_<device>)")
    args = ap.parse_args(argv)

    import ray

    from cluster.runtime import RayOptions, init_ray

    init_ray(RayOptions(num_cpus=4, temp_dir=f"{tempfile.mkdtemp(prefix='tandem-bench-')}/ray"))
    sizes = [int(s) for s in args.sizes.split(",")]
    pairs = {pref: _pair(pref, args.device) for pref in ("network", "ipc")}
    for tx, rx, cid, _ in pairs.values():
        _round(tx, rx, cid, 1 << 20, 3)  # warm-up: connections, the shared file's first growth
    best: dict[tuple[str, int], float] = {}
    for r in range(args.rounds):
        order = ("network", "ipc") if r % 2 == 0 else ("ipc", "network")
        for size in sizes:
            for pref in order:
                tx, rx, cid, _ = pairs[pref]
                t = _round(tx, rx, cid, size, args.repeats)
                best[pref, size] = min(best.get((pref, size), float("inf")), t)
    names = {pref: p[3] for pref, p in pairs.items()}
    rows = [{"bytes": size, **{names[p]: best[p, size] for p in pairs},
             "ratio_shared_over_network": best["ipc", size] / best["network", size]} for size in sizes]
    net, shm = names["network"], names["ipc"]
    lines = [f"# Hand-over channel: {net} vs shared memory ({shm}) on {args.device}", "",
             f"Device: {device_name(args.device)}. Two Ray actor processes; receive-side seconds from answer to "
             f"payload in place, median of {args.repeats}, best of {args.rounds} rounds (alternating order).", "",
             f"| payload | {net} | shared memory | shared / {net} | {net} GB/s | shared GB/s |", "|---|---|---|---|---|---|"]
    for row in rows:
        b = row["bytes"]
        lines.append(f"| {b / 2**20:.2f} MiB | {row[net] * 1e3:.2f} ms | {row[shm] * 1e3:.2f} ms | "
                     f"{row['ratio_shared_over_network']:.2f}x | {b / row[net] / 1e9:.2f} | {b / row[shm] / 1e9:.2f} |")
    path = write_results(args.name or f"channel_{args.device}", {"device": device_name(args.device), "rows": rows},
                         "\n".join(lines))
    print("\n".join(lines))
    print(f"written: {path}")
    ray.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
