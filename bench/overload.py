"""Overload: what admitted requests see when twice the sustainable load arrives (issue 15, item 4).

1. Sweep: closed-loop clients at concurrency 1, 2, 4, ... up to the server's --max-inflight; the
   sustainable load is the best completed-requests-per-second of the sweep (the server completes no more
   at any concurrency), with its latency p50/p99 as the baseline.
2. Overload: open-loop Poisson arrivals (seeded) at `--factor` (2) x the sustainable rate for
   `--duration-s`. Requests past the router's admission bound must get 429 with Retry-After at once;
   admitted ones must keep a latency near the baseline's, not one that grows with the queue.

    tandem serve --max-inflight 8 --port 8000 &      # loopback, the zoo's models, MTP k=3
    python -m bench.overload --base-url http://127.0.0.1:8000   # writes bench/results/overload_cpu.{json,md}

Every request is the same shape (a short prompt, `--max-tokens` greedy tokens, ignore_eos), so latency
differences come from load alone.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path

import httpx

from bench.common import closed_loop as closed_loop_run

RESULTS = Path(__file__).resolve().parent / "results"
PROMPTS = ["Hello, how are you?", "The quick brown fox", "def add(a, b):", "Once upon a time",
           "Tandem serves models on Ray.", "return a + b"]


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


async def _one(http: httpx.AsyncClient, model: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    start = time.perf_counter()
    try:
        reply = await http.post("/v1/completions", json=body)
        status, retry_after = reply.status_code, reply.headers.get("retry-after")
        error = None if status == 200 else reply.json().get("error", {}).get("type")
    except httpx.HTTPError as e:  # counted, never raised: a transport failure is a finding
        status, retry_after, error = 0, None, type(e).__name__
    return {"status": status, "latency_s": time.perf_counter() - start, "retry_after": retry_after, "error": error}


async def closed_loop(base_url: str, model: str, concurrency: int, requests: int, max_tokens: int) -> dict:
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(requests)]
    results, wall = await closed_loop_run(base_url, prompts, concurrency,
                                          lambda http, prompt: _one(http, model, prompt, max_tokens), 300.0)
    done = [r["latency_s"] for r in results if r["status"] == 200]
    return {"concurrency": concurrency, "requests": len(results), "completed": len(done), "wall_s": wall,
            "completed_per_s": len(done) / wall, "p50_s": _pct(done, 0.5), "p99_s": _pct(done, 0.99),
            "statuses": _count(r["status"] for r in results)}


async def open_loop(base_url: str, model: str, rate: float, duration_s: float, max_tokens: int, seed: int) -> dict:
    """Poisson arrivals at `rate`/s for `duration_s`; each request is sent when it arrives, whatever is in flight."""
    rng = random.Random(seed)
    arrivals, t = [], 0.0
    while True:
        t += rng.expovariate(rate)
        if t > duration_s:
            break
        arrivals.append(t)
    async with httpx.AsyncClient(base_url=base_url, timeout=300,
                                 limits=httpx.Limits(max_connections=len(arrivals) + 4)) as http:
        start = time.perf_counter()

        async def at(offset: float, i: int) -> dict:
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            return await _one(http, model, PROMPTS[i % len(PROMPTS)], max_tokens)

        results = await asyncio.gather(*[at(offset, i) for i, offset in enumerate(arrivals)])
        wall = time.perf_counter() - start
    admitted = [r["latency_s"] for r in results if r["status"] == 200]
    rejected = [r for r in results if r["status"] == 429]
    return {"offered_per_s": rate, "duration_s": duration_s, "sent": len(results), "wall_s": wall,
            "admitted": len(admitted), "completed_per_s": len(admitted) / wall,
            "admitted_p50_s": _pct(admitted, 0.5), "admitted_p99_s": _pct(admitted, 0.99),
            "admitted_max_s": max(admitted, default=None), "rejected_429": len(rejected),
            "rejected_with_retry_after": sum(1 for r in rejected if r["retry_after"]),
            "rejected_p99_s": _pct([r["latency_s"] for r in rejected], 0.99),
            "statuses": _count(r["status"] for r in results),
            "other_errors": _count(r["error"] for r in results if r["status"] not in (200, 429))}


def _count(values) -> dict:
    out: dict = {}
    for v in values:
        out[str(v)] = out.get(str(v), 0) + 1
    return out


def markdown(r: dict) -> str:
    rows = ["| concurrency | requests | completed/s | p50 | p99 |", "|---|---|---|---|---|"]
    rows += [f"| {l['concurrency']} | {l['requests']} | {l['completed_per_s']:.2f} | {l['p50_s']:.2f} s | "
             f"{l['p99_s']:.2f} s |" for l in r["sweep"]]
    o, base = r["overload"], r["sustainable"]
    return "\n".join([
        f"Server: {r['base_url']}, admission bound max_inflight={r['max_inflight']}; requests of "
        f"{r['max_tokens']} greedy tokens.", "", "Sweep (closed loop):", "", *rows, "",
        f"Sustainable: {base['completed_per_s']:.2f} requests/s (concurrency {base['concurrency']}, "
        f"p99 {base['p99_s']:.2f} s).", "",
        f"Overload: {o['offered_per_s']:.2f} requests/s offered ({r['factor']}x) for {o['duration_s']:.0f} s, "
        f"{o['sent']} sent: {o['admitted']} admitted ({o['completed_per_s']:.2f}/s completed), "
        f"{o['rejected_429']} got 429 ({o['rejected_with_retry_after']} with Retry-After, p99 "
        f"{_s(o['rejected_p99_s'])}), other: {o['other_errors'] or 'none'}.", "",
        f"Admitted latency p50 / p99 / max: {_s(o['admitted_p50_s'])} / {_s(o['admitted_p99_s'])} / "
        f"{_s(o['admitted_max_s'])} (sustainable-load p99: {base['p99_s']:.2f} s; "
        f"ratio {o['admitted_p99_s'] / base['p99_s']:.2f}x)." if o["admitted_p99_s"] else "No request admitted."])


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f} s"


async def run(args) -> dict:
    async with httpx.AsyncClient(base_url=args.base_url, timeout=60) as http:
        model = args.model or (await http.get("/v1/models")).json()["data"][0]["id"]
    await closed_loop(args.base_url, model, 2, 4, args.max_tokens)  # warm-up: first requests load caches
    if args.offered_per_s:  # the baseline without a bound: the overload only, at a rate measured before
        over = await open_loop(args.base_url, model, args.offered_per_s, args.duration_s, args.max_tokens, args.seed)
        print(json.dumps(over), flush=True)
        return {"base_url": args.base_url, "model": model, "max_tokens": args.max_tokens, "overload": over}
    levels = []
    c = 1
    while c <= args.max_inflight:
        levels.append(await closed_loop(args.base_url, model, c, max(args.min_requests, 3 * c), args.max_tokens))
        print(json.dumps(levels[-1]), flush=True)
        c *= 2
    best = max(levels, key=lambda l: l["completed_per_s"])
    over = await open_loop(args.base_url, model, args.factor * best["completed_per_s"], args.duration_s,
                           args.max_tokens, args.seed)
    print(json.dumps(over), flush=True)
    return {"base_url": args.base_url, "model": model, "max_inflight": args.max_inflight, "max_tokens": args.max_tokens,
            "factor": args.factor, "seed": args.seed, "sweep": levels, "sustainable": best, "overload": over}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.overload", description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default=None, help="served model name (default: the server's only model)")
    ap.add_argument("--max-inflight", type=int, default=8, help="the server's --max-inflight: the sweep's top")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--min-requests", type=int, default=12, help="requests per sweep level (at least 3 per client)")
    ap.add_argument("--factor", type=float, default=2.0, help="overload as a multiple of the sustainable rate")
    ap.add_argument("--duration-s", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--offered-per-s", type=float, default=None, help="skip the sweep and offer this rate (e.g. "
                                                                     "against a server without a bound)")
    ap.add_argument("--out", default=str(RESULTS / "overload_cpu"), help="output prefix (.json and .md)")
    args = ap.parse_args(argv)
    result = asyncio.run(run(args))
    table = markdown(result) if "sweep" in result else json.dumps(result["overload"], indent=1)
    from bench.common import command_line

    Path(args.out + ".json").write_text(json.dumps({"command": command_line(), **result}, indent=2) + "\n")
    Path(args.out + ".md").write_text(f"{table}\n\nCommand: `{command_line()}`\n")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
