"""Cache-aware routing against load-only routing (round robin among equal replicas), served, on the real
default model (SmolLM2-135M-Instruct), in one run, alternating rounds (issue 34's goal: with two prefill
replicas and 8 distinct long prefixes, cache-aware routing's hit rate >= 1.8x round robin's).

Two applications, alike but for the router's `prefix_aware_routing` (on: router/policy.py's overlap-and-load
score; off: load alone, ties in turn), each with `--replicas` prefill replicas whose KV caches hold about
`--kv-prefixes` of the prefixes each (fewer than all of them: the point of routing by prefix is that the
replicas' caches add up instead of each holding the same hot half). The workload: `--prefixes` distinct
system prompts of about `--prefix-tokens` tokens (a tenant's instructions and tool schemas, distinct from
their first line), each request one of them and a short user turn (MT-Bench first turns); every round sends
each prefix once, in a seeded shuffled order (the same order for both applications), `--concurrency`
requests at a time. Reports, per application: the hit rate (prompt tokens reused / looked up, summed over
its prefill replicas: every round, the cold first one included, and from round 2 on) and TTFT p50; and the
ratios.

    python -m bench.prefix_routing [--prefixes 8] [--prefix-tokens 1000] [--rounds 4] [--concurrency 2]
                                   [--replicas 2] [--kv-prefixes 5] [--new-tokens 4] [--sequential]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time

import httpx

from bench.common import device_name, start_local_serve, write_results

SEED = 34
BLOCK = 16
APPS = {"prefix": True, "turns": False}  # application name -> prefix_aware_routing


def workload(tokenizer, prefixes: int, prefix_tokens: int, rounds: int) -> list[list[tuple[int, list[int]]]]:
    """Per round, (prefix index, prompt ids) for every prefix once, in a seeded shuffled order."""
    from bench.prefix_cache import DATA, _tools_text
    from zoo.selfdistill import chat_ids

    users = [json.loads(line)["turns"][0]
             for line in (DATA / "prompts/mt-bench/question.jsonl").read_text().splitlines() if line.strip()]
    tools = _tools_text(60)
    systems = []
    for k in range(prefixes):
        head = (f"You are the assistant of tenant {k} of a travel company. Answer briefly. When a tool fits the "
                f"request, call it with arguments valid against its schema.\n# Tools\n")
        ids = tokenizer(head + tools[k * 997 % len(tools):])["input_ids"][:prefix_tokens]
        systems.append(tokenizer.decode(ids))
    rng = random.Random(SEED)
    out = []
    for r in range(rounds):
        order = list(range(prefixes))
        rng.shuffle(order)
        out.append([(k, chat_ids(tokenizer, [{"role": "system", "content": systems[k]},
                                             {"role": "user", "content": users[(r * prefixes + k) % len(users)]}]))
                    for k in order])
    return out


async def _ttft(http: httpx.AsyncClient, app: str, prompt: list[int], new_tokens: int) -> float:
    body = {"model": "bench", "prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    start = time.perf_counter()
    async with http.stream("POST", f"/{app}/v1/completions", json=body) as resp:
        resp.raise_for_status()
        first = None
        async for line in resp.aiter_lines():
            if first is None and line.startswith("data: {"):
                first = time.perf_counter() - start
    return first


async def _round(http, app: str, prompts: list[list[int]], concurrency: int, new_tokens: int) -> list[float]:
    left, ttfts = list(prompts), []

    async def client():
        while left:
            ttfts.append(await _ttft(http, app, left.pop(0), new_tokens))

    await asyncio.gather(*[client() for _ in range(concurrency)])
    return ttfts


async def _prefix_counts(router, replicas: int, expect_queried: int, timeout_s: float = 120.0) -> dict:
    """(query tokens, hit tokens) per prefill replica, once their reports count every prompt sent."""
    deadline = time.monotonic() + timeout_s
    while True:
        snap = (await router.routing_snapshot.remote())["prefill"]
        pc = {rid: s.get("prefix_cache", {}) for rid, s in snap.items() if s}
        if len(pc) == replicas and sum(c.get("query_tokens", 0) for c in pc.values()) == expect_queried:
            return {rid: (c["query_tokens"], c["hit_tokens"]) for rid, c in pc.items()}
        if time.monotonic() > deadline:
            raise TimeoutError(f"the prefill replicas reported {pc}, not {expect_queried} query tokens")
        await asyncio.sleep(0.25)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefixes", type=int, default=8)
    ap.add_argument("--prefix-tokens", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--kv-prefixes", type=float, default=5, help="prefixes one prefill replica's KV cache holds")
    ap.add_argument("--new-tokens", type=int, default=4)
    ap.add_argument("--sequential", action="store_true", help="deploy and measure one application after the other "
                                                                "(half the memory) instead of alternating rounds")
    ap.add_argument("--name", default="prefix_routing_cpu")
    args = ap.parse_args(argv)

    from ray import serve
    from transformers import AutoTokenizer

    from deploy.app import build_app
    from deploy.config import TandemConfig
    from zoo.models import resolve

    target = str(resolve("smollm2-135m-instruct").target)
    tokenizer = AutoTokenizer.from_pretrained(target)
    rounds = workload(tokenizer, args.prefixes, args.prefix_tokens, args.rounds)
    prompt_tokens = statistics.mean(len(p) for rnd in rounds for _, p in rnd)
    blocks = int(args.kv_prefixes * prompt_tokens / BLOCK) + 2 * args.concurrency
    port = start_local_serve()
    def deploy(app: str):
        cfg = TandemConfig(model=target, served_model_name="bench", prefill_replicas=args.replicas,
                           prefill_num_cpus=0.5, rank_num_cpus=0.5, tp=1, num_kv_blocks=blocks,
                           max_num_seqs=max(4, args.concurrency), prefix_aware_routing=APPS[app])
        serve.run(build_app(cfg), name=app, route_prefix=f"/{app}")
        return serve.get_deployment_handle("router", app_name=app)

    ttft = {app: [] for app in APPS}
    per_round = {app: [] for app in APPS}  # counts after each round; the first entry: after the warm-up

    async def measure(routers: dict):
        """Every round on each application of `routers`, alternating which goes first."""
        queried = {}
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=1200) as http:
            for app in routers:  # warm-up: first steps, channels opened, on every replica (a prompt no round shares)
                warm = tokenizer("Warm-up.")["input_ids"]
                await asyncio.gather(*[_ttft(http, app, warm + [i], 2) for i in range(2 * args.replicas)])
                queried[app] = 2 * args.replicas * (len(warm) + 1)
                per_round[app].append(await _prefix_counts(routers[app], args.replicas, queried[app]))
            for r, rnd in enumerate(rounds):
                for app in (list(routers) if r % 2 == 0 else list(reversed(routers))):
                    prompts = [p for _, p in rnd]
                    ttft[app].append(await _round(http, app, prompts, args.concurrency, args.new_tokens))
                    queried[app] += sum(map(len, prompts))
                    per_round[app].append(await _prefix_counts(routers[app], args.replicas, queried[app]))

    if args.sequential:  # one application at a time: half the memory, no pairing of rounds
        for app in APPS:
            asyncio.run(measure({app: deploy(app)}))
            serve.delete(app)
    else:
        asyncio.run(measure({app: deploy(app) for app in APPS}))
    serve.shutdown()

    def hit_rate(app: str, since: int) -> float:
        """Hits over lookups from round `since` (0: all) to the end, summed over the replicas."""
        end, start = per_round[app][-1], per_round[app][since]
        q = sum(end[rid][0] - start.get(rid, (0, 0))[0] for rid in end)
        h = sum(end[rid][1] - start.get(rid, (0, 0))[1] for rid in end)
        return h / q

    rows = []
    for app, aware in APPS.items():
        rows.append({"routing": "cache-aware" if aware else "load only (round robin)",
                     "hit_rate_all": round(hit_rate(app, 0), 3), "hit_rate_warm": round(hit_rate(app, 1), 3),
                     "ttft_p50_ms": round(statistics.median(t for rnd in ttft[app] for t in rnd) * 1e3, 1),
                     "ttft_p50_ms_warm": round(statistics.median(t for rnd in ttft[app][1:] for t in rnd) * 1e3, 1),
                     "hits_per_replica": [h for _, h in per_round[app][-1].values()]})
    a, b = rows
    ratios = {"hit_rate_ratio_all": round(a["hit_rate_all"] / max(b["hit_rate_all"], 1e-9), 2),
              "hit_rate_ratio_warm": round(a["hit_rate_warm"] / max(b["hit_rate_warm"], 1e-9), 2),
              "ttft_p50_speedup": round(b["ttft_p50_ms"] / a["ttft_p50_ms"], 2)}
    table = ["| routing | hit rate (all rounds) | hit rate (rounds 2+) | TTFT p50 (ms) | TTFT p50 rounds 2+ (ms) | "
             "hit tokens per replica |", "|---|---|---|---|---|---|"]
    table += [f"| {r['routing']} | {r['hit_rate_all']} | {r['hit_rate_warm']} | {r['ttft_p50_ms']} | "
              f"{r['ttft_p50_ms_warm']} | {r['hits_per_replica']} |" for r in rows]
    table.append("")
    table.append(f"Hit rate ratio {ratios['hit_rate_ratio_all']}x (all rounds), {ratios['hit_rate_ratio_warm']}x "
                 f"(rounds 2+); TTFT p50 {ratios['ttft_p50_speedup']}x lower with cache-aware routing.")
    payload = {"model": "smollm2-135m-instruct", "device": device_name("cpu"), "sequential": args.sequential,
               "prefixes": args.prefixes,
               "prompt_tokens_mean": round(prompt_tokens), "rounds": args.rounds, "concurrency": args.concurrency,
               "replicas": args.replicas, "num_kv_blocks": blocks, "new_tokens": args.new_tokens, "runs": rows,
               "ratios": ratios}
    print("\n".join(table))
    print(write_results(args.name, payload, "\n".join(table)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
