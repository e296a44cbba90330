"""Prefix caching through the served path (router -> prefill -> hand-over -> decode group) on the real default
model: an application with prefix caching (the default) against one without, in one run, alternating rounds.

The workload is bench/prefix_cache.py's `shared`: a ~1,500-token system prompt with tool schemas before short
MT-Bench user turns, sent one after another (TTFT is the prompt's cost) and then `--concurrency` at a time
(tokens/s). A fresh system prompt per round (its first line differs), so each round starts cold and its first
request pays for the prefix. Reports TTFT p50 (to the first streamed token), output tokens/s, the ratios, and
the application's hit rate (the prefix-cache counters' deltas of its prefill replica and its decode group, which
prefills a prompt itself when it holds all but a short remainder: conditional disaggregation). Greedy outputs must be equal.

    python -m bench.prefix_cache_served [--requests 8] [--concurrency 4] [--new-tokens 16] [--rounds 2]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import httpx

from bench.common import device_name, prefix_cache_counts, start_local_serve, write_results


async def _one(http: httpx.AsyncClient, app: str, prompt: list[int], new_tokens: int) -> tuple[float, str]:
    """(TTFT, text) of one streamed greedy completion."""
    body = {"model": "bench", "prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    start, first, text = time.perf_counter(), None, []
    async with http.stream("POST", f"/{app}/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if line.startswith("data: {"):
                piece = json.loads(line[6:])["choices"][0]["text"]
                if first is None and piece:
                    first = time.perf_counter()
                text.append(piece)
    return (first or time.perf_counter()) - start, "".join(text)


async def wave(http, app, prompts, new_tokens, concurrency) -> dict:
    """`prompts` in waves of `concurrency` streamed greedy completions: TTFTs (in prompt order), their median,
    output tokens/s, texts."""
    ttft, texts = [], [None] * len(prompts)
    start = time.perf_counter()
    for lo in range(0, len(prompts), concurrency):
        batch = range(lo, min(lo + concurrency, len(prompts)))
        got = await asyncio.gather(*(_one(http, app, prompts[i], new_tokens) for i in batch))
        for i, (t, text) in zip(batch, got):
            ttft.append(t)
            texts[i] = text
    wall = time.perf_counter() - start
    return {"ttft_p50_s": statistics.median(ttft), "tok_s": len(prompts) * new_tokens / wall, "texts": texts,
            "ttft_s": ttft, "wall_s": wall}


def serve_cache_and_none(target: str) -> dict[str, bool]:
    """Two applications of `target` under /cache and /nocache (prefix caching on and off): tp=1 as `tandem serve`
    runs SmolLM2 on a small CPU (its 9 heads do not split in two), no speculation; without the cache long
    prompts queue on one CPU prefill past the default hand-over wait (60 s) under load, so the bench waits
    longer. Returns {application: prefix caching on}."""
    from ray import serve

    from deploy.app import build_app
    from deploy.config import TandemConfig

    apps = {"cache": True, "nocache": False}
    for app, on in apps.items():
        serve.run(build_app(TandemConfig(model=target, served_model_name="bench", enable_prefix_caching=on,
                                         num_kv_blocks=768, tp=1, handover_timeout_s=600)),
                  name=app, route_prefix=f"/{app}")
    return apps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--name", default="prefix_cache_served_cpu")
    args = ap.parse_args(argv)

    from ray import serve
    from transformers import AutoTokenizer

    from bench.prefix_cache import shared_workload
    from zoo.models import resolve

    target = str(resolve("smollm2-135m-instruct").target)
    tokenizer = AutoTokenizer.from_pretrained(target)
    base = shared_workload(tokenizer, args.requests)
    port = start_local_serve()
    apps = serve_cache_and_none(target)
    workers = [serve.get_deployment_handle(name, app_name="cache") for name in ("prefill", "decode")]

    async def counts():
        await asyncio.sleep(0.5)  # the decode group's counters come with its ranks' step reports
        return await prefix_cache_counts(*workers) or (0, 0)

    async def measure():
        rows = []
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=900) as http:
            for app in apps:  # warm-up on a prompt no round shares
                await _one(http, app, base[0][:64], 2)
            for concurrency in (1, args.concurrency):
                runs = {True: [], False: []}
                for rnd in range(args.rounds):
                    marker = tokenizer.encode(f"Session {concurrency}.{rnd}. ", add_special_tokens=False)
                    prompts = [p[:1] + marker + p[1:] for p in base]
                    for app in (apps if rnd % 2 == 0 else reversed(list(apps))):
                        q0, h0 = await counts()
                        r = await wave(http, app, prompts, args.new_tokens, concurrency)
                        q1, h1 = await counts()
                        r["hit_rate"] = (h1 - h0) / max(1, q1 - q0)
                        runs[apps[app]].append(r)
                for a, b in zip(runs[True], runs[False]):
                    assert a["texts"] == b["texts"], "prefix caching changed a greedy output"
                med = {on: {k: statistics.median(r[k] for r in rs) for k in ("ttft_p50_s", "tok_s")}
                       for on, rs in runs.items()}
                rows.append({"concurrency": concurrency, "prompt_tokens_mean": round(statistics.mean(map(len, base))),
                             "ttft_p50_ms_cache": round(med[True]["ttft_p50_s"] * 1e3, 1),
                             "ttft_p50_ms_none": round(med[False]["ttft_p50_s"] * 1e3, 1),
                             "ttft_speedup": round(med[False]["ttft_p50_s"] / med[True]["ttft_p50_s"], 2),
                             "tok_s_cache": round(med[True]["tok_s"], 2), "tok_s_none": round(med[False]["tok_s"], 2),
                             "tok_s_ratio": round(med[True]["tok_s"] / med[False]["tok_s"], 2),
                             "hit_rate": round(statistics.median(r["hit_rate"] for r in runs[True]), 3)})
                print(rows[-1], flush=True)
        return rows

    rows = asyncio.run(measure())
    serve.shutdown()
    table = ["| concurrency | prompt tokens | TTFT p50 cache / none (ms) | TTFT speed-up | tok/s cache / none | ratio | "
             "hit rate |", "|---|---|---|---|---|---|---|"]
    table += [f"| {r['concurrency']} | {r['prompt_tokens_mean']} | {r['ttft_p50_ms_cache']} / {r['ttft_p50_ms_none']} | "
              f"{r['ttft_speedup']}x | {r['tok_s_cache']} / {r['tok_s_none']} | {r['tok_s_ratio']}x | {r['hit_rate']} |"
              for r in rows]
    print(write_results(args.name, {"model": "smollm2-135m-instruct", "device": device_name("cpu"),
                                    "requests": args.requests, "new_tokens": args.new_tokens, "runs": rows},
                        "\n".join(table)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
