"""Prefix caching on the real default model (SmolLM2-135M-Instruct): the engine with the cache against the
engine without it, in one run, alternating rounds.

The workload (issue 34's `shared`): a long shared system prompt (instructions and the JSON Schemas of several
tools, as an agent sends them; about 1,500 tokens) before short user turns (MT-Bench first turns): most prompt
tokens are shared. (The multi-turn workload is not built yet.)

Each request arrives after the previous one finished (concurrency 1: TTFT is the prompt's cost) and then the
same requests at `--concurrency` (tokens/s). Reports TTFT p50, tokens/s, their ratios and the hit rate
(hit tokens / prompt tokens looked up). Greedy outputs with and without the cache must be equal.

    python -m bench.prefix_cache [--requests 12] [--concurrency 4] [--new-tokens 32] [--rounds 2]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from bench.common import device_name, write_results

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def _tools_text(n: int) -> str:
    """The JSON Schemas of n tools, as a tool-using system prompt lists them (json-mode-eval's schemas)."""
    items = sorted((DATA / "json-mode-eval/items").glob("*.json"), key=lambda p: int(p.stem.split("_")[1]))[:n]
    tools = [{"type": "function", "function": {"name": f"tool_{i}", "parameters": json.loads(p.read_text())["schema"]}}
             for i, p in enumerate(items)]
    return "\n".join(json.dumps(t) for t in tools)


def shared_workload(tokenizer, requests: int, target_tokens: int = 1500) -> list[list[int]]:
    from zoo.selfdistill import chat_ids

    users = [json.loads(line)["turns"][0]
             for line in (DATA / "prompts/mt-bench/question.jsonl").read_text().splitlines() if line.strip()]
    n_tools, system = 1, ""
    while True:  # as many tools as bring the system prompt to about target_tokens
        system = ("You are a careful assistant for a travel company. Answer briefly. When a tool fits the "
                  "request, call it with arguments valid against its schema.\n# Tools\n" + _tools_text(n_tools))
        if len(tokenizer(system)["input_ids"]) >= target_tokens or n_tools > 60:
            break
        n_tools += 1
    return [chat_ids(tokenizer, [{"role": "system", "content": system}, {"role": "user", "content": u}])
            for u in users[:requests]]


def run(llm, prompts: list[list[int]], new_tokens: int, concurrency: int) -> dict:
    """Requests in waves of `concurrency`; TTFT from each request's arrival to its first token."""
    from engine import SamplingParams

    engine = llm.engine
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    ttft, outputs, tokens = [], [None] * len(prompts), 0
    start = time.perf_counter()
    for lo in range(0, len(prompts), concurrency):
        index, arrival, first = {}, {}, {}
        for i in range(lo, min(lo + concurrency, len(prompts))):
            rid = f"q{i}-{time.perf_counter_ns()}"
            index[rid], arrival[rid] = i, time.perf_counter()
            engine.add_request(rid, prompts[i], params)
        while engine.has_unfinished():
            for out in engine.step():
                if out.request_id not in first and out.token_ids:
                    first[out.request_id] = time.perf_counter()
                if out.finished:
                    tokens += len(out.token_ids)
                    outputs[index[out.request_id]] = list(out.token_ids)
        ttft += [first[r] - arrival[r] for r in arrival]
    seconds = time.perf_counter() - start
    return {"ttft_p50_s": statistics.median(ttft), "tok_s": tokens / seconds, "outputs": outputs}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cpu-compile", default="off", choices=("off", "gemm", "layers"))
    ap.add_argument("--name", default="prefix_cache_cpu")
    args = ap.parse_args(argv)

    from engine import LLM
    from zoo.models import resolve

    torch.set_num_threads(args.threads)
    target = str(resolve("smollm2-135m-instruct").target)
    systems = {on: LLM(target, max_num_seqs=args.concurrency, num_kv_blocks=2048, block_size=16,
                       enable_prefix_caching=on, cpu_compile=args.cpu_compile) for on in (True, False)}
    prompts = shared_workload(systems[True].tokenizer, args.requests)
    for llm in systems.values():
        llm.generate([prompts[0][:64]], None)  # warm-up (compiles); a prefix no workload request shares
    rows = []
    for concurrency in (1, args.concurrency):
        best: dict = {}
        for _ in range(args.rounds):
            for on, llm in systems.items():
                llm.engine.blocks.pool.reset_cache()  # every round starts cold: the first request pays the prefix
                r = run(llm, prompts, args.new_tokens, concurrency)
                keep = best.get(on)
                if keep is None or r["tok_s"] > keep["tok_s"]:
                    best[on] = r
        assert best[True]["outputs"] == best[False]["outputs"], "prefix caching changed a greedy output"
        stats = systems[True].engine.stats()["prefix_cache"]
        row = {"workload": "shared", "concurrency": concurrency, "prompt_tokens_mean": round(statistics.mean(map(len, prompts))),
               "ttft_p50_ms_cache": round(best[True]["ttft_p50_s"] * 1e3, 1),
               "ttft_p50_ms_none": round(best[False]["ttft_p50_s"] * 1e3, 1),
               "ttft_speedup": round(best[False]["ttft_p50_s"] / best[True]["ttft_p50_s"], 2),
               "tok_s_cache": round(best[True]["tok_s"], 1), "tok_s_none": round(best[False]["tok_s"], 1),
               "tok_s_ratio": round(best[True]["tok_s"] / best[False]["tok_s"], 2),
               "hit_rate_cumulative": round(stats["hit_rate"], 3)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    table = ["| workload | concurrency | prompt tokens | TTFT p50 cache / none (ms) | TTFT speed-up | tok/s cache / none | ratio | hit rate |",
             "|---|---|---|---|---|---|---|---|"]
    table += [f"| {r['workload']} | {r['concurrency']} | {r['prompt_tokens_mean']} | {r['ttft_p50_ms_cache']} / "
              f"{r['ttft_p50_ms_none']} | {r['ttft_speedup']}x | {r['tok_s_cache']} / {r['tok_s_none']} | "
              f"{r['tok_s_ratio']}x | {r['hit_rate_cumulative']} |" for r in rows]
    results = {"model": "smollm2-135m-instruct", "device": device_name("cpu"), "threads": args.threads,
               "requests": args.requests, "new_tokens": args.new_tokens, "runs": rows}
    print(write_results(args.name, results, "\n".join(table)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
