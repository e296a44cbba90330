"""Soak: a bounded, seeded mix of requests against a running `tandem serve`, then the checks that find
leaks and hangs.

The mix (per request, drawn from one seeded RNG): chat and completions, streamed and not, greedy and
seeded sampling, guided (a JSON schema, a regex, a choice) and not; clients that disconnect mid-stream;
clients with tiny timeouts; and bad requests (10% by default: the cheap body cases of the bad-input corpus
tests/router/bad_inputs.jsonl, plus n = 0). At the end: every good request completed or got a typed
error (the OpenAI error shape); no stream outlived its deadline; KV blocks in use back to 0 on every
prefill and decode replica (read from /metrics); RSS growth of the server's process tree; latency p50/p99.

    tandem serve &                                              # loopback, the zoo's models, MTP k=3
    python -m bench.soak --requests 1000 --concurrency 32      # writes bench/results/soak_cpu.{json,md}
    python -m bench.soak --server-pid $(pgrep -f 'tandem serve') # adds the RSS growth of its process tree
    python -m bench.soak --faults                               # faults under load instead (bench/faults.py)

Exit status 1 when anything leaked, hung, went unexplained or a bad request was answered wrongly.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import time
from collections import Counter
from pathlib import Path

import httpx

from bench.load_client import PROMPTS, send_request, tree_rss_mb, wait_for_free_blocks

CORPUS = Path(__file__).resolve().parents[1] / "tests" / "router" / "bad_inputs.jsonl"
RESULTS = Path(__file__).resolve().parent / "results"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


# ---------------------------------------------------------------------------------------------- the mix
def bad_cases() -> list[dict]:
    """Corpus cases that are plain JSON bodies expecting a 400 and cost the server nothing to refuse."""
    cases = [json.loads(line) for line in CORPUS.read_text().splitlines() if line.strip()]
    return [c for c in cases if "body" in c and c["expect"]["status"] == 400 and not {"fill", "repeat"} & set(c)
            and not re.search(r"bomb|pathological|compile|huge|servable", c["kind"])]


def draw(rng: random.Random, i: int, model: str, bad: list[dict], bad_share: float) -> dict:
    """Request i of the mix: {kind, path, body, stream, ...}. `kind` is good | bad | disconnect | timeout."""
    roll = rng.random()
    if roll < bad_share:
        if rng.random() < 0.1:
            return {"kind": "bad", "path": "/v1/completions", "stream": False, "name": "n = 0",
                    "body": {"model": model, "prompt": "Hi", "n": 0}, "expect": {"status": 400, "param": "n"}}
        case = rng.choice(bad)
        body = dict(case["body"])
        if body.get("model") == "tiny":  # the corpus's served name; unknown-model cases keep theirs
            body["model"] = model
        return {"kind": "bad", "path": "/" + case["endpoint"].split(" /", 1)[1], "stream": False,
                "name": case["kind"], "body": body, "expect": case["expect"]}
    chat = rng.random() < 0.5
    stream = rng.random() < 0.5
    body: dict = {"model": model, "max_tokens": rng.randint(4, 32)}
    if rng.random() < 0.5:
        body["temperature"] = 0
    else:
        body.update(temperature=0.8, seed=rng.randrange(2**31))
    prompt = rng.choice(PROMPTS) + " " * rng.randint(0, 3)
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    guided = rng.random()
    if guided < 0.05:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    elif guided < 0.10:
        body["guided_regex"] = "[a-z]{3,8}( [a-z]{2,6}){0,3}"
    elif guided < 0.15:
        body["guided_choice"] = ["yes", "no", "maybe"]
    kind = "good"
    roll = rng.random()
    if roll < 0.05:
        kind, stream = "disconnect", True
        body.update(max_tokens=64, ignore_eos=True)
    elif roll < 0.10:
        kind = "timeout"
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    path = "/v1/chat/completions" if chat else "/v1/completions"
    return {"kind": kind, "path": path, "stream": stream, "body": body}


def warmup(model: str) -> list[dict]:
    """One request of each path (plain, streamed chat, each guided kind), so that RSS is measured after the
    one-time costs (the grammar compile process, caches) rather than counted as growth."""
    base = {"model": model, "max_tokens": 8, "temperature": 0}
    guided = [{}, {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}},
              {"guided_regex": "[a-z]{3,8}"}, {"guided_choice": ["yes", "no"]}]
    specs = [{"kind": "good", "path": "/v1/completions", "stream": False, "body": {**base, "prompt": "Hi", **g}}
             for g in guided]
    specs.append({"kind": "good", "path": "/v1/chat/completions", "stream": True,
                  "body": {**base, "messages": [{"role": "user", "content": "Hi"}], "stream": True}})
    return specs


# ---------------------------------------------------------------------------------------------- the run
async def soak(base_url: str, model: str, requests: int = 1000, concurrency: int = 32, seed: int = 0,
               bad_share: float = 0.10, deadline_s: float = 120.0, max_duration_s: float = 1800.0,
               server_pid: int | None = None, headers: dict | None = None) -> dict:
    rng = random.Random(seed)
    bad = bad_cases()
    specs = [draw(rng, i, model, bad, bad_share) for i in range(requests)]
    results: list[tuple[dict, dict]] = []
    async with httpx.AsyncClient(base_url=base_url, headers=headers or {},
                                 limits=httpx.Limits(max_connections=concurrency + 8)) as http:
        warm = [await send_request(http, spec, deadline_s) for spec in warmup(model)]
        rss_before = tree_rss_mb(server_pid)
        queue = list(enumerate(specs))
        start = time.monotonic()

        async def worker():
            while queue and time.monotonic() - start < max_duration_s:
                _, spec = queue.pop(0)
                results.append((spec, await send_request(http, spec, deadline_s)))

        await asyncio.gather(*[worker() for _ in range(concurrency)])
        wall = time.monotonic() - start
        used, drain_s = await wait_for_free_blocks(http, within_s=60.0)
        health = (await http.get("/health", timeout=30)).status_code
        rss_after = tree_rss_mb(server_pid)
    return summarize(results, wall, used, drain_s, health, rss_before, rss_after, warm,
                     dict(requests=requests, concurrency=concurrency, seed=seed, bad_share=bad_share,
                          deadline_s=deadline_s, model=model))


def summarize(results, wall, used, drain_s, health, rss_before, rss_after, warm, setup) -> dict:
    by_kind = {k: Counter(o["outcome"] for s, o in results if s["kind"] == k)
               for k in ("good", "bad", "disconnect", "timeout")}
    good = [o for s, o in results if s["kind"] == "good"]
    typed_statuses = Counter(o["status"] for o in good if o["outcome"] == "typed_error")
    bad_wrong = [(s["name"], o.get("status"), o.get("detail")) for s, o in results
                 if s["kind"] == "bad" and not (o["outcome"] == "typed_error" and o["status"] == s["expect"]["status"]
                                                and ("param" not in s["expect"]
                                                     or (o.get("detail") or {}).get("param") == s["expect"]["param"]))]
    unexplained = [(s["kind"], s["path"], o.get("status"), o.get("detail")) for s, o in results
                   if o["outcome"] == "unexplained"]
    completed = [o for o in good if o["outcome"] == "completed"]
    hung = sum(o["outcome"] == "hung" for _, o in results)
    leaked = sum(used.values()) if used else None
    return {
        "setup": setup, "sent": len(results), "wall_s": wall,
        "outcomes": {k: dict(v) for k, v in by_kind.items()},
        "good_typed_error_statuses": {str(k): v for k, v in typed_statuses.items()},
        "hung": hung, "unexplained": len(unexplained), "unexplained_examples": unexplained[:5],
        "bad_answered_wrong": len(bad_wrong), "bad_wrong_examples": bad_wrong[:5],
        "bad_kinds_sent": len({s["name"] for s, _ in results if s["kind"] == "bad"}),
        "latency_p50_s": _pct([o["latency_s"] for o in completed], 0.5),
        "latency_p99_s": _pct([o["latency_s"] for o in completed], 0.99),
        "ttft_p50_s": _pct([o["ttft_s"] for o in completed if o["ttft_s"] is not None], 0.5),
        "ttft_p99_s": _pct([o["ttft_s"] for o in completed if o["ttft_s"] is not None], 0.99),
        "kv_blocks_used_after": used, "kv_blocks_leaked": leaked, "kv_drain_s": drain_s,
        "health_after": health, "warmup_completed": sum(o["outcome"] == "completed" for o in warm),
        "rss_before_mb": rss_before, "rss_after_mb": rss_after,
        "rss_growth_mb": None if rss_before is None or rss_after is None else rss_after - rss_before,
        "passed": hung == 0 and leaked == 0 and not unexplained and not bad_wrong and health == 200,
    }


def markdown(r: dict) -> str:
    s, o = r["setup"], r["outcomes"]
    def f(v, unit="s"):
        return "n/a" if v is None else f"{v:.3f} {unit}" if unit == "s" else f"{v:.0f} {unit}"
    return "\n".join([
        f"| soak (seed {s['seed']}) | value |", "|---|---|",
        f"| requests sent / concurrency / wall | {r['sent']} / {s['concurrency']} / {r['wall_s']:.0f} s |",
        f"| good: outcomes | {o['good']} (typed error statuses {r['good_typed_error_statuses'] or 'none'}) |",
        f"| bad ({r['bad_kinds_sent']} kinds): outcomes | {o['bad']}; answered wrongly: {r['bad_answered_wrong']} |",
        f"| mid-stream disconnects | {o['disconnect']} |", f"| tiny client timeouts | {o['timeout']} |",
        f"| hung streams / unexplained errors | {r['hung']} / {r['unexplained']} |",
        f"| KV blocks in use after (per replica) | {r['kv_blocks_used_after']} (leaked {r['kv_blocks_leaked']}, "
        f"drained in {r['kv_drain_s']:.1f} s) |",
        f"| latency p50 / p99 (completed good) | {f(r['latency_p50_s'])} / {f(r['latency_p99_s'])} |",
        f"| TTFT p50 / p99 (streams) | {f(r['ttft_p50_s'])} / {f(r['ttft_p99_s'])} |",
        f"| server RSS before / after / growth | {f(r['rss_before_mb'], 'MB')} / {f(r['rss_after_mb'], 'MB')} / "
        f"{f(r['rss_growth_mb'], 'MB')} |",
        f"| passed | {r['passed']} |", ""])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default=None, help="served model name (default: the server's only model)")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bad-share", type=float, default=0.10)
    ap.add_argument("--deadline-s", type=float, default=120.0, help="a request past this is counted as hung")
    ap.add_argument("--max-duration-s", type=float, default=1800.0, help="stop sending after this long")
    ap.add_argument("--server-pid", type=int, default=None, help="measure RSS of this process and its children")
    ap.add_argument("--api-key", default=os.environ.get("TANDEM_API_KEY"))
    ap.add_argument("--faults", nargs="*", default=None, metavar="FAULT",
                    help="instead of the mix: inject faults (all, or these of bench.faults.FAULTS) under a steady "
                         "load of --concurrency clients, and report each one's time to recover")
    ap.add_argument("--app", default="tandem", help="the Serve application's name (--faults finds its processes)")
    ap.add_argument("--out", default=None, help="output prefix (.json and .md); default: soak_cpu or "
                                                "reliability_faults_cpu under bench/results")
    args = ap.parse_args(argv)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    model = args.model or httpx.get(f"{args.base_url}/v1/models", headers=headers).json()["data"][0]["id"]
    if args.faults is not None:
        return _faults_main(args, model, headers)
    args.out = args.out or str(RESULTS / "soak_cpu")
    report = asyncio.run(soak(args.base_url, model, args.requests, args.concurrency, args.seed, args.bad_share,
                              args.deadline_s, args.max_duration_s, args.server_pid, headers))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(f"{args.out}.json").write_text(json.dumps(report, indent=2, default=str))
    Path(f"{args.out}.md").write_text(markdown(report))
    print(markdown(report))
    return 0 if report["passed"] else 1


def _faults_main(args, model: str, headers: dict) -> int:
    from bench import faults

    if args.server_pid is None:
        raise SystemExit("--faults needs --server-pid (the `tandem serve` process): faults are injected only into "
                         "processes below it, never into another Ray session's on the same machine")
    unknown = set(args.faults) - set(faults.FAULTS)
    if unknown:
        raise SystemExit(f"unknown fault(s) {sorted(unknown)}; known: {list(faults.FAULTS)}")
    results = asyncio.run(faults.run_faults(args.base_url, model, args.server_pid, args.faults or None, headers,
                                            app=args.app,
                                            concurrency=args.concurrency, seed=args.seed,
                                            deadline_s=args.deadline_s))
    out = args.out or str(RESULTS / "reliability_faults_cpu")
    Path(f"{out}.json").write_text(json.dumps(results, indent=2, default=str))
    Path(f"{out}.md").write_text(faults.markdown(results))
    print(faults.markdown(results))
    ran = [r for r in results if not r["skipped"]]
    return 0 if all(r["recover_s"] is not None and not r["hung"] and r["kv_blocks_leaked"] == 0 for r in ran) else 1


if __name__ == "__main__":
    raise SystemExit(main())
