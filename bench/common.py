"""Shared helpers for benchmarks: result files, environment description."""
from __future__ import annotations

import json
import os
import platform
import shlex
import sys
import tempfile
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def shared_data() -> Path:
    """The public evaluation data (../shared/data beside the checkout): $TANDEM_DATA where set, e.g. on a GPU
    node that got the checkout without the folder beside it."""
    if os.environ.get("TANDEM_DATA"):
        return Path(os.environ["TANDEM_DATA"])
    beside = Path(__file__).resolve().parents[2] / "shared" / "data"
    return beside if beside.is_dir() else Path("/work/shared/data")


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(0)
    return f"{platform.processor() or platform.machine()} ({os.cpu_count()} cores, torch threads {torch.get_num_threads()})"


def command_line() -> str:
    """How this benchmark was started (`python -m module args`), written beside its results."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    head = f"python -m {spec.name}" if spec is not None else f"python {sys.argv[0]}"
    return f"{head} {shlex.join(sys.argv[1:])}".strip()


def write_results(name: str, payload: dict, table: str) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    command = command_line()
    payload = {"when": time.strftime("%Y-%m-%d %H:%M:%S"), "command": command, **payload}
    (RESULTS / f"{name}.json").write_text(json.dumps(payload, indent=2) + "\n")
    (RESULTS / f"{name}.md").write_text(f"{table}\n\nCommand: `{command}`\n")
    return RESULTS / f"{name}.md"


async def closed_loop(base_url: str, items: list, concurrency: int, one, timeout_s: float = 600.0) -> tuple[list, float]:
    """`concurrency` clients, each sending the next of `items` as soon as its last answer is in (closed
    loop): `await one(http, item)` per item; returns (results in completion order, wall seconds)."""
    import asyncio

    import httpx

    left = list(items)
    results: list = []

    async def client(http):
        while left:
            results.append(await one(http, left.pop()))

    async with httpx.AsyncClient(base_url=base_url, timeout=timeout_s,
                                 limits=httpx.Limits(max_connections=concurrency + 4)) as http:
        start = time.perf_counter()
        await asyncio.gather(*[client(http) for _ in range(concurrency)])
        return results, time.perf_counter() - start


def start_local_serve() -> int:
    """The served benchmarks' set-up: a local Ray of their own (its own temp dir, 8 logical CPUs) and Serve's
    HTTP proxy on a free loopback port (returned); applications then go under route prefixes."""
    from ray import serve

    from cluster.rendezvous import free_port_on
    from cluster.runtime import RayOptions, init_ray

    init_ray(RayOptions(num_cpus=8, temp_dir=f"{tempfile.mkdtemp(prefix='tandem-bench-')}/ray"))
    port = free_port_on("127.0.0.1")
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    return port


async def prefix_cache_counts(*handles) -> tuple[int, int] | None:
    """(prompt tokens looked up, tokens reused) so far, summed over deployments (their handles: the prefill
    replica and the decode group). Each prompt is counted once, where it was prefilled: by a prefill replica,
    or by the decode group itself (conditional disaggregation; a hand-over's arrival is not a lookup there).
    The decode group's counters are its ranks' last step reports. None with prefix caching off."""
    counts = [(await h.stats.remote()).get("prefix_cache") or {} for h in handles]
    if not any(counts):
        return None
    return (sum(pc.get("query_tokens", 0) for pc in counts), sum(pc.get("hit_tokens", 0) for pc in counts))
