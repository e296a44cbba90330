"""Faults during a soak (`python -m bench.soak --faults`): real faults injected into a running `tandem serve`
while a steady load of requests is in flight, and what each cost.

Faults, in order: SIGKILL the prefill replica's process (mid-prefill: long prompts keep it busy), SIGKILL a
decode rank mid-step, SIGKILL a decode rank between a hand-over's header and its payload, SIGKILL the
router replica, stall a hand-over's payload past its deadline, SIGKILL the prefill while a hand-over
waits in its sender, and fill the KV cache until the decode engine preempts (a cache of 256 blocks fills;
one sized from memory does not). The hand-over faults use fault points (cluster/faults.py) and run only
against a server armed for them; otherwise they are reported as skipped:

    tandem serve --transfer-timeout-s 5 --num-kv-blocks 256 --fault-points \\
        'handover.recv_payload=kill@-r1-,handover.send_payload=stall:15,handover.send_header=stall:30'

Per fault: time to recover (from the fault until a fresh request, sent one after another from that moment,
is answered 200), how many requests of the load ended with a typed error (lost), none, or hung, how many the
router resumed after the fault (router/generation.py; /metrics `tandem_request_resumptions_total`) and the pause
of the streams in flight at the fault (their longest wait between two events: p50 / p99), and the KV blocks
in use on every replica once the load drained (from /metrics). Processes are found by the titles Ray gives
them (`ray::ServeReplica:APP:DEPLOYMENT`, `ray::DecodeRank`), as an operator would find them.
"""
from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from pathlib import Path

import httpx

from bench.load_client import PROMPTS, kv_blocks_used, process_tree, send_request, wait_for_free_blocks

LONG_PROMPT = " ".join(PROMPTS * 6)
FAILED_BACKOFF_S = 1.0  # a load client's wait after a request that failed (a dead router refuses at once)  # a few hundred tokens: the prefill is busy when it is killed
KV_BLOCK_TOKENS = 16


# ---------------------------------------------------------------------------------------------- processes
def processes_titled(title: str, root: int) -> list[int]:
    """Pids below `root` (the server's process: on a shared machine other Ray sessions run processes of the
    same titles) whose command line (Ray's process title) is `title`, or `title` running a method; a
    process forked by one of them (it inherits the title) is left out."""
    found: dict[int, int] = {}  # pid -> parent pid
    for pid in process_tree(root):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace").strip()
            ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if cmd == title or cmd.startswith(title + ".") or cmd.startswith(title + " "):
            found[pid] = ppid
    return sorted(pid for pid, ppid in found.items() if ppid not in found)


def replica_pids(deployment: str, root: int, app: str = "tandem") -> list[int]:
    return processes_titled(f"ray::ServeReplica:{app}:{deployment}", root)


def kill(pids: list[int]) -> list[int]:
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    return pids


# ---------------------------------------------------------------------------------------------- requests
def load_spec(rng: random.Random, model: str, request_id: str | None = None, long: bool = False,
              max_tokens: int | None = None) -> dict:
    stream = rng.random() < 0.5
    body = {"model": model, "prompt": LONG_PROMPT if long else rng.choice(PROMPTS),
            "max_tokens": max_tokens or rng.randint(16, 48), "temperature": 0, "ignore_eos": True}
    if stream:
        body.update(stream=True)
    spec = {"kind": "good", "path": "/v1/completions", "stream": stream, "body": body}
    if request_id is not None:
        spec["headers"] = {"X-Request-Id": request_id}
    return spec


async def _served(http: httpx.AsyncClient, model: str, deadline_s: float) -> bool:
    spec = {"kind": "good", "path": "/v1/completions", "stream": False,
            "body": {"model": model, "prompt": "Hello", "max_tokens": 4, "temperature": 0}}
    return (await send_request(http, spec, deadline_s))["outcome"] == "completed"


async def time_to_recover(http: httpx.AsyncClient, model: str, since: float, within_s: float) -> float | None:
    """Seconds from `since` (a time.monotonic()) until a fresh request succeeds; None if none within `within_s`."""
    while time.monotonic() - since < within_s:
        if await _served(http, model, deadline_s=max(1.0, within_s - (time.monotonic() - since))):
            return time.monotonic() - since
        await asyncio.sleep(0.25)
    return None


class Load:
    """`concurrency` clients sending requests one after another until stopped; every outcome is kept."""

    def __init__(self, http: httpx.AsyncClient, model: str, concurrency: int, seed: int, deadline_s: float,
                 long_share: float = 0.3):
        self.http, self.model, self.deadline_s = http, model, deadline_s
        self.rng = random.Random(seed)
        self.long_share = long_share
        self.outcomes: list[dict] = []
        self.in_flight = 0
        self._stop = asyncio.Event()
        self._tasks = [asyncio.create_task(self._client()) for _ in range(concurrency)]

    async def _client(self) -> None:
        while not self._stop.is_set():
            spec = load_spec(self.rng, self.model, long=self.rng.random() < self.long_share)
            self.in_flight += 1
            try:
                out = await send_request(self.http, spec, self.deadline_s)
                self.outcomes.append(out)
            finally:
                self.in_flight -= 1
            if out["outcome"] != "completed":
                await asyncio.sleep(FAILED_BACKOFF_S)  # as a client would, not a tight loop on a closed port

    async def stop(self) -> None:
        """Stop sending; wait for what is in flight (each request is bounded by its deadline)."""
        self._stop.set()
        await asyncio.gather(*self._tasks)


# ---------------------------------------------------------------------------------------------- the faults
async def _kill_prefill(http, model, app, root) -> str | None:
    pids = replica_pids("prefill", root, app)
    return f"SIGKILL prefill replica pid {kill(pids[:1])}" if pids else None


async def _kill_rank_mid_step(http, model, app, root) -> str | None:
    pids = processes_titled("ray::DecodeRank", root)
    return f"SIGKILL decode rank pid {kill(pids[-1:])}" if pids else None


async def _kill_router(http, model, app, root) -> str | None:
    pids = replica_pids("router", root, app)
    return f"SIGKILL router replica pid {kill(pids[:1])}" if pids else None


async def _send_marked(http, model, point: str) -> dict:
    """One request whose id names an armed fault point (so the fault fires on it)."""
    rid = f"fault-{point}-{os.urandom(4).hex()}"
    spec = load_spec(random.Random(0), model, request_id=rid, max_tokens=32)
    out = await send_request(http, {**spec, "stream": False, "body": {**spec["body"], "stream": False}}, 120.0)
    return {**out, "request_id": rid}


def _marked(point: str):
    """A fault that fires at an armed fault point: one request whose id names the point."""
    async def inject(http, model, app, root) -> str | None:
        resumed = await _resumptions(http)
        out = await _send_marked(http, model, point)
        # A request the router resumed completes after its fault: the fault fired if it failed or was resumed.
        if out["outcome"] == "completed" and not _delta(resumed, await _resumptions(http)):
            return None  # the server is not armed for this point
        return f"request {out['request_id']}: {out['outcome']} {out.get('status')} {str(out.get('detail'))[:160]}"
    return inject


async def _kill_prefill_with_queued_handover(http, model, app, root) -> str | None:
    """The prefill dies while a hand-over waits in its sender (armed `handover.send_header=stall:S`): the
    request's first token is out, its header is not."""
    pids = replica_pids("prefill", root, app)
    marked = asyncio.create_task(_send_marked(http, model, "handover.send_header"))
    await asyncio.sleep(2.0)  # prefilled; the hand-over is held before its headers
    if marked.done() or not pids:
        return None  # finished already: the server is not armed for this point
    kill(pids[:1])
    out = await marked
    return f"SIGKILL prefill pid {pids[0]} under request {out['request_id']}: {out['outcome']} " \
           f"{out.get('status')} {str(out.get('detail'))[:160]}"


async def _decode_blocks(http, metric: str) -> float:
    text = (await http.get("/metrics", timeout=30)).text
    return max([v for k, v in kv_blocks_used(text, metric).items() if k.startswith("decode/")], default=0.0)


async def _fill_kv(http, model, app, root) -> str | None:
    """As many long requests at once as take the decode cache past full (from the /metrics total): with the
    default cache (sized from memory) the 64-request cap does not fill it; serve with --num-kv-blocks 256."""
    total = await _decode_blocks(http, "tandem_kv_blocks_total")
    if not total:
        return None
    per_request = -(-(len(LONG_PROMPT) // 3 + 256) // KV_BLOCK_TOKENS)  # rough tokens of prompt + output
    n = min(64, int(1.5 * total / per_request) + 2)
    rng = random.Random(1)
    burst = asyncio.gather(*[send_request(http, load_spec(rng, model, long=True, max_tokens=256), 300.0) for _ in range(n)])
    peak = 0.0
    while not burst.done():
        peak = max(peak, await _decode_blocks(http, "tandem_kv_blocks_used"))
        await asyncio.sleep(0.5)
    done = sum(o["outcome"] == "completed" for o in burst.result())
    return f"{n} long requests at once on {total:.0f} decode blocks (peak in use {peak:.0f}): {done} completed"


FAULTS = {  # key: (what, injector)
    "prefill": ("prefill replica killed mid-prefill", _kill_prefill),
    "rank-step": ("decode rank killed mid-step", _kill_rank_mid_step),
    "rank-handover": ("decode rank killed between hand-over header and payload", _marked("handover.recv_payload")),
    "router": ("router replica killed", _kill_router),
    "stall": ("hand-over payload stalled past its deadline", _marked("handover.send_payload")),
    "prefill-queued": ("prefill killed with a hand-over queued", _kill_prefill_with_queued_handover),
    "kv-full": ("KV cache filled to preemption", _fill_kv),
}


async def run_fault(http: httpx.AsyncClient, model: str, name: str, server_pid: int, app: str = "tandem",
                    concurrency: int = 8,
                    seed: int = 0, deadline_s: float = 120.0, recover_within_s: float = 300.0) -> dict:
    """One fault under load: inject it once the load runs, measure the recovery, drain, check the blocks."""
    load = Load(http, model, concurrency, seed, deadline_s)
    await asyncio.sleep(3.0)  # requests of every phase in flight
    in_flight = load.in_flight
    resumed_before = await _resumptions(http)
    fault_at, fault_perf = time.monotonic(), time.perf_counter()
    what, inject = FAULTS[name]
    injected = await inject(http, model, app, server_pid)
    recover_s = await time_to_recover(http, model, fault_at, recover_within_s) if injected else None
    await asyncio.sleep(2.0)  # the load keeps going on the recovered deployment
    await load.stop()
    used, drain_s = await wait_for_free_blocks(http, within_s=120.0)
    outcomes: dict[str, int] = {}
    for o in load.outcomes:
        outcomes[o["outcome"]] = outcomes.get(o["outcome"], 0) + 1
    errors = [o for o in load.outcomes if o["outcome"] != "completed"]
    spanning = sorted(o["max_gap_s"] for o in load.outcomes if o.get("max_gap_s") is not None
                      and o["started"] <= fault_perf <= o["started"] + (o["latency_s"] or 0.0))
    return {
        "fault": name, "what": what, "injected": injected, "skipped": injected is None, "in_flight_at_fault": in_flight,
        "recover_s": recover_s, "requests": len(load.outcomes), "outcomes": outcomes, "errored": len(errors),
        "error_statuses": sorted({str(o.get("status")) for o in errors}),
        "error_examples": [str(o.get("detail"))[:200] for o in errors[:3]],
        "hung": outcomes.get("hung", 0), "kv_blocks_used_after": used, "kv_drain_s": drain_s,
        "kv_blocks_leaked": sum(used.values()) if used else None,
        # A restarted router counts from 0 again: then what it resumed is unknown (None).
        "resumed": _delta(resumed_before, await _resumptions(http)),
        "pause_p50_s": _quantile(spanning, 0.5), "pause_p99_s": _quantile(spanning, 0.99), "streams_at_fault": len(spanning),
    }


async def _resumptions(http: httpx.AsyncClient) -> float | None:
    """The router's resumptions so far (0 for a router without them); None if its /metrics does not answer."""
    from deploy.metrics_probe import scrape

    try:
        text = (await http.get("/metrics", timeout=30)).text
    except httpx.HTTPError:
        return None
    return sum(v for (name, _), v in scrape(text).items() if name == "tandem_request_resumptions_total")


def _quantile(values: list[float], q: float) -> float | None:
    return values[min(len(values) - 1, int(q * len(values)))] if values else None


async def run_faults(base_url: str, model: str, server_pid: int, names: list[str] | None = None,
                     headers: dict | None = None, **kwargs) -> list[dict]:
    async with httpx.AsyncClient(base_url=base_url, headers=headers or {},
                                 limits=httpx.Limits(max_connections=128)) as http:
        if await time_to_recover(http, model, time.monotonic(), 120.0) is None:
            raise RuntimeError(f"{base_url} does not serve; start `tandem serve` first")
        return [await run_fault(http, model, name, server_pid, **kwargs) for name in (names or list(FAULTS))]


def markdown(results: list[dict]) -> str:
    rows = ["| fault | in flight | recovered in | requests: completed / lost (statuses) / hung | resumed | "
            "pause of the streams at the fault, p50 / p99 | KV blocks in use after |", "|---|---|---|---|---|---|---|"]
    for r in results:
        if r["skipped"]:
            rows.append(f"| {r['what']} | | skipped (server not armed) | | | | |")
            continue
        rec = "never" if r["recover_s"] is None else f"{r['recover_s']:.1f} s"
        done = r["outcomes"].get("completed", 0)
        pause = "-" if r.get("pause_p50_s") is None else f"{r['pause_p50_s']:.1f} / {r['pause_p99_s']:.1f} s"
        rows.append(f"| {r['what']} | {r['in_flight_at_fault']} | {rec} | {done} / {r['errored']} "
                    f"({', '.join(r['error_statuses']) or '-'}) / {r['hung']} | {_count(r.get('resumed'))} | {pause} "
                    f"| {r['kv_blocks_used_after']} |")
    return "\n".join(rows) + "\n"


def _count(value) -> str:
    return "?" if value is None else f"{value:g}"


def _delta(before: float | None, after: float | None) -> float | None:
    """Resumptions between two reads; None when unknown (a read failed, or the router restarted from 0)."""
    if before is None or after is None or after < before:
        return None
    return after - before
