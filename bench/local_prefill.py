"""Conditional disaggregation on the real default model: the served path with the decode group prefilling the
short uncached remainder of a prompt whose prefix it holds (`local_prefill_max_tokens` 128, the default)
against the same deployment sending every prompt to a prefill replica (0), in one run, alternating rounds.
Prefix caching is on in both.

Workloads (bench/prefix_cache.py's, through the HTTP API):
- `multi-turn`: MT-Bench conversations, each turn's prompt the whole conversation so far (the served model's
  own answers, as text, as a chat client sends them back) plus the next user turn: from turn 2 the decode group
  holds the history, the new user turn is the remainder;
- `shared`: a ~1,500-token system prompt with tool schemas before short MT-Bench questions: after the first
  request the group holds the system prompt.
Each round starts cold (a marker in the first system line). Reports TTFT p50 (to the first streamed token),
output tokens/s and their ratios, the requests the decode group prefilled itself, and how many greedy outputs
were equal between the two applications (they compute the same prompt in other chunks, so a float tie may
flip; counted, not asserted).

    python -m bench.local_prefill [--conversations 8] [--turns 3] [--requests 8] [--concurrency 4]
                                  [--new-tokens 32] [--rounds 2]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics

import httpx

from bench.common import device_name, start_local_serve, write_results
from bench.prefix_cache_served import _one, wave

APPS = {"local": 128, "remote": 0}  # application -> local_prefill_max_tokens


def _serve(target: str) -> None:
    """The two applications, tp=1 as `tandem serve` runs SmolLM2 on a small CPU, no speculation."""
    from ray import serve

    from deploy.app import build_app
    from deploy.config import TandemConfig

    for app, limit in APPS.items():
        serve.run(build_app(TandemConfig(model=target, served_model_name="bench", num_kv_blocks=768, tp=1,
                                         handover_timeout_s=600, local_prefill_max_tokens=limit)),
                  name=app, route_prefix=f"/{app}")


async def _local_prefills(app: str) -> int:
    from ray import serve

    stats = await serve.get_deployment_handle("decode", app_name=app).stats.remote()
    return stats["local_prefills"]


async def _multi_turn(http, app, tokenizer, marker: str, args, concurrency) -> dict:
    """Every turn of every conversation; TTFT per turn index."""
    from bench.prefix_cache import DATA, FOLLOW_UP
    from zoo.selfdistill import chat_ids

    questions = [json.loads(line)["turns"]
                 for line in (DATA / "prompts/mt-bench/question.jsonl").read_text().splitlines() if line.strip()]
    histories = [[{"role": "system", "content": f"{marker} You are a helpful assistant."}]
                 for _ in range(args.conversations)]
    per_turn, texts, tokens, seconds = [], [], 0, 0.0
    for turn in range(args.turns):
        for h, q in zip(histories, questions):
            h.append({"role": "user", "content": q[turn] if turn < len(q) else FOLLOW_UP})
        prompts = [chat_ids(tokenizer, h) for h in histories]
        r = await wave(http, app, prompts, args.new_tokens, concurrency)
        for h, text in zip(histories, r["texts"]):
            h.append({"role": "assistant", "content": text})
        per_turn.append(r["ttft_p50_s"])
        texts += r["texts"]
        tokens += len(prompts) * args.new_tokens
        seconds += r["wall_s"]
    return {"ttft_by_turn": per_turn, "texts": texts, "tok_s": tokens / seconds}


async def _shared(http, app, tokenizer, marker: str, args, concurrency) -> dict:
    from bench.prefix_cache import shared_workload

    base = shared_workload(tokenizer, args.requests)
    ids = tokenizer.encode(f"{marker} ", add_special_tokens=False)
    prompts = [p[:1] + ids + p[1:] for p in base]
    r = await wave(http, app, prompts, args.new_tokens, concurrency)
    # the first request of a round is cold in both applications: TTFT over the rest
    return {"ttft_by_turn": [statistics.median(r["ttft_s"][1:])], "texts": r["texts"], "tok_s": r["tok_s"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--name", default="local_prefill_cpu")
    args = ap.parse_args(argv)

    from ray import serve
    from transformers import AutoTokenizer

    from zoo.models import resolve

    target = str(resolve("smollm2-135m-instruct").target)
    tokenizer = AutoTokenizer.from_pretrained(target)
    port = start_local_serve()
    _serve(target)

    async def measure():
        rows = []
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=900) as http:
            for app in APPS:  # warm-up
                await _one(http, app, tokenizer.encode("Hello there, how are you today?"), 2)
            for name, workload in (("multi-turn", _multi_turn), ("shared", _shared)):
                for concurrency in (1, args.concurrency):
                    runs = {app: [] for app in APPS}
                    for rnd in range(args.rounds):
                        marker = f"Session {name}.{concurrency}.{rnd}."
                        for app in (APPS if rnd % 2 == 0 else reversed(list(APPS))):
                            before = await _local_prefills(app)
                            r = await workload(http, app, tokenizer, marker, args, concurrency)
                            r["local_prefills"] = await _local_prefills(app) - before
                            runs[app].append(r)
                    equal = sum(a == b for ra, rb in zip(runs["local"], runs["remote"])
                                for a, b in zip(ra["texts"], rb["texts"]))
                    total = sum(len(r["texts"]) for r in runs["local"])
                    turns = len(runs["local"][0]["ttft_by_turn"])
                    for t in range(turns):
                        med = {app: statistics.median(r["ttft_by_turn"][t] for r in rs) for app, rs in runs.items()}
                        tok = {app: statistics.median(r["tok_s"] for r in rs) for app, rs in runs.items()}
                        rows.append({
                            "workload": name if turns == 1 else f"{name}, turn {t + 1}", "concurrency": concurrency,
                            "ttft_p50_ms_local": round(med["local"] * 1e3, 1),
                            "ttft_p50_ms_remote": round(med["remote"] * 1e3, 1),
                            "ttft_ratio": round(med["remote"] / med["local"], 2),
                            "tok_s_local": round(tok["local"], 2), "tok_s_remote": round(tok["remote"], 2),
                            "tok_s_ratio": round(tok["local"] / tok["remote"], 2),
                            "local_prefills": statistics.median(r["local_prefills"] for r in runs["local"]),
                            "requests": len(runs["local"][0]["texts"]), "equal_outputs": f"{equal}/{total}"})
                        print(rows[-1], flush=True)
        return rows

    rows = asyncio.run(measure())
    serve.shutdown()
    table = ["| workload | concurrency | TTFT p50 local / remote (ms) | TTFT lower by | tok/s local / remote | ratio | "
             "prefilled by the decode group | greedy outputs equal |", "|---|---|---|---|---|---|---|---|"]
    table += [f"| {r['workload']} | {r['concurrency']} | {r['ttft_p50_ms_local']} / {r['ttft_p50_ms_remote']} | "
              f"{r['ttft_ratio']}x | {r['tok_s_local']} / {r['tok_s_remote']} | {r['tok_s_ratio']}x | "
              f"{r['local_prefills']} of {r['requests']} | {r['equal_outputs']} |" for r in rows]
    print(write_results(args.name, {"model": "smollm2-135m-instruct", "device": device_name("cpu"),
                                    "new_tokens": args.new_tokens, "rounds": args.rounds, "runs": rows},
                        "\n".join(table)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
