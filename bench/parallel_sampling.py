"""Parallel sampling (n > 1) through the served path on the real default model (SmolLM2-135M-Instruct):
one request with n = N against N separate requests of the same prompt, in one run, alternating rounds.

Three ways to get N samples of one long prompt (about 1,500 tokens: a system prompt with tool schemas and a
user turn, bench/prefix_cache.py's workload), seeded, `--new-tokens` each:
  - `n`: one request with n = N (the router fans it out; the prefill's prefix cache shares the prompt);
  - `separate`: N requests sent at once, seeds s..s+N-1, on the same application (prefix caching on);
  - `separate, no cache`: the same N requests on an application with prefix caching off: what a client had
    to do before n > 1 existed, every sample paying for the whole prompt.
Deployments: one prefill replica, a tp=1 decode group, no speculation. Each round starts with cold caches (a fresh prompt per round). Reports wall time and output tokens/s per way
(median over rounds), the ratios, and the prefill's prompt tokens computed per way (from its prefix-cache
counters: the prompt prefilled once means about one prompt's tokens computed for N samples). The n choices
must equal the separate requests' outputs (same seeds, checked on one more prompt after the timed rounds).

    python -m bench.parallel_sampling [--n 4] [--new-tokens 32] [--rounds 3]
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import httpx

from bench.common import device_name, prefix_cache_counts, start_local_serve, write_results

SEED = 1234


async def _n_request(http: httpx.AsyncClient, app: str, prompt: list[int], n: int, new_tokens: int) -> list[str]:
    body = {"model": "bench", "prompt": prompt, "n": n, "seed": SEED, "temperature": 1.0, "max_tokens": new_tokens,
            "ignore_eos": True}
    r = await http.post(f"/{app}/v1/completions", json=body)
    r.raise_for_status()
    return [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]


async def _separate(http: httpx.AsyncClient, app: str, prompt: list[int], n: int, new_tokens: int) -> list[str]:
    async def one(i):
        body = {"model": "bench", "prompt": prompt, "seed": SEED + i, "temperature": 1.0, "max_tokens": new_tokens,
                "ignore_eos": True}
        r = await http.post(f"/{app}/v1/completions", json=body)
        r.raise_for_status()
        return r.json()["choices"][0]["text"]

    return list(await asyncio.gather(*(one(i) for i in range(n))))


async def _computed(handles) -> int | None:
    """Prompt tokens the application computed so far (looked up less reused, by its prefill replica and by its
    decode group, which prefills a repeat itself); None with the cache off (every prompt is then computed whole)."""
    await asyncio.sleep(0.5)  # the decode group's counters come with its ranks' step reports
    counts = await prefix_cache_counts(*handles)
    return None if counts is None else counts[0] - counts[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=1500)
    ap.add_argument("--name", default="parallel_sampling_cpu")
    args = ap.parse_args(argv)

    from ray import serve
    from transformers import AutoTokenizer

    from bench.prefix_cache import shared_workload
    from bench.prefix_cache_served import serve_cache_and_none
    from zoo.models import resolve

    target = str(resolve("smollm2-135m-instruct").target)
    tokenizer = AutoTokenizer.from_pretrained(target)
    prompts = shared_workload(tokenizer, args.rounds + 1, args.prompt_tokens)
    # A fresh system prompt per round (its first line differs), so that no round starts with a warm cache.
    prompts = [[p[0], *tokenizer.encode(f"Round {i}. ", add_special_tokens=False), *p[1:]] for i, p in enumerate(prompts)]
    port = start_local_serve()
    apps = serve_cache_and_none(target)  # no speculation: the draws compared are the plain sampler's
    handles = {app: [serve.get_deployment_handle(name, app_name=app) for name in ("prefill", "decode")] for app in apps}
    ways = {"n": ("cache", _n_request), "separate": ("cache", _separate), "separate, no cache": ("nocache", _separate)}

    async def measure():
        rows = {w: [] for w in ways}
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=600) as http:
            for app in apps:  # warm-up: first steps, channels opened (a prompt no round uses)
                await _separate(http, app, prompts[-1][:200], 2, 4)
            for rnd in range(args.rounds):
                order = list(ways) if rnd % 2 == 0 else list(reversed(ways))
                for way in order:
                    app, call = ways[way]
                    prompt = prompts[rnd][:1] + tokenizer.encode(f"[{way}] ", add_special_tokens=False) + prompts[rnd][1:]
                    before = await _computed(handles[app])
                    start = time.perf_counter()
                    await call(http, app, prompt, args.n, args.new_tokens)
                    wall = time.perf_counter() - start
                    after = await _computed(handles[app])
                    rows[way].append({"wall_s": wall, "tok_s": args.n * args.new_tokens / wall,
                                      "prompt_tokens": len(prompt),
                                      "computed": args.n * len(prompt) if after is None else after - before})
            # The check outside the timing (each way above had a prompt of its own, to start cold): the same
            # prompt as n = N and as N seeded requests gives the same N outputs.
            prompt = prompts[-1][:1] + tokenizer.encode("[check] ", add_special_tokens=False) + prompts[-1][1:]
            together = await _n_request(http, "cache", prompt, args.n, args.new_tokens)
            assert together == await _separate(http, "nocache", prompt, args.n, args.new_tokens), \
                "the n choices differ from the seeded separate requests"
        return rows

    rows = asyncio.run(measure())
    serve.shutdown()
    summary = {w: {"wall_s_p50": statistics.median(r["wall_s"] for r in rs),
                   "tok_s_p50": statistics.median(r["tok_s"] for r in rs),
                   "prompt_tokens": rs[0]["prompt_tokens"],
                   "computed_p50": statistics.median(r["computed"] for r in rs)} for w, rs in rows.items()}
    base = summary["separate, no cache"]["tok_s_p50"]
    table = [f"| way | wall p50 (s) | tok/s p50 | vs separate, no cache | prompt tokens computed for {args.n} samples |",
             "|---|---|---|---|---|"]
    table += [f"| {w} | {s['wall_s_p50']:.2f} | {s['tok_s_p50']:.1f} | {s['tok_s_p50'] / base:.2f}x | "
              f"{s['computed_p50']:.0f} (prompt {s['prompt_tokens']}) |" for w, s in summary.items()]
    payload = {"model": "smollm2-135m-instruct", "device": device_name("cpu"), "n": args.n,
               "new_tokens": args.new_tokens, "rounds": rows, "summary": summary}
    print("\n".join(table))
    print(write_results(args.name, payload, "\n".join(table)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
