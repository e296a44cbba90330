"""Acceptance-driven k (SpecConfig.adaptive_k) against fixed k on the real default model, SmolLM2-135M-Instruct.

    python -m bench.adaptive_k [--method mtp] [--batches 1,8] [--prompts 8] [--max-tokens 96] [--repeats 2]

Per workload (GSM8K test questions unguided; json-mode-eval schemas guided, forced drafts on) and batch size: the
engine without speculation, fixed k = 1, 2, 3 and adaptive k (at most 3), greedy; every speculative run's outputs
must equal the run without speculation (lossless). Batch 1 runs the prompts one after another; batch B runs them
B at a time. Each engine serves every prompt once (24 tokens) before the measured rounds (warm-up: grammars
compiled, first-call costs paid, and adaptive k's estimates primed as a running server's would be). Configurations run in
turn, `--repeats` rounds, each keeping its best. Speed is tokens per CPU-second of this process (one torch
thread: what the run cost, robust to other jobs on a shared machine, which wall time is not) and wall tokens/s;
the ratio that matters is adaptive against the best fixed k of the same cell. Writes
bench/results/adaptive_k_cpu.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from bench.common import device_name, shared_data, write_results

FIXED = (1, 2, 3)


def prompt_sets(tokenizer, n: int) -> dict[str, list[tuple[list[int], dict | None]]]:
    """name -> [(prompt ids, schema or None)]: the first n GSM8K test questions, the first n json-mode-eval schemas."""
    from zoo.selfdistill import chat_ids, schema_prompt

    data = shared_data()
    gsm = [json.loads(line)["question"] for line in (data / "prompts/gsm8k/test.jsonl").read_text().splitlines()[:n]]
    items = sorted((data / "json-mode-eval/items").glob("*.json"), key=lambda p: int(p.stem.split("_")[1]))[:n]
    schemas = [json.loads(p.read_text())["schema"] for p in items]
    return {"gsm8k": [(chat_ids(tokenizer, [{"role": "user", "content": q}]), None) for q in gsm],
            "json-mode-eval": [(chat_ids(tokenizer, schema_prompt(s)), s) for s in schemas]}


def run_engine(llm, prompts, batch: int, max_tokens: int) -> dict:
    from engine import SamplingParams, StructuredOutput

    params = [SamplingParams(max_tokens=max_tokens, temperature=0,
                             structured_output=StructuredOutput(json_schema=s) if s is not None else None)
              for _, s in prompts]
    llm.engine.spec_stats.reset()
    start, cpu_start = time.perf_counter(), time.process_time()
    outs = []
    for i in range(0, len(prompts), batch):
        outs += llm.generate([p for p, _ in prompts[i:i + batch]], params[i:i + batch])
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    tokens = sum(len(o.token_ids) for o in outs)
    stats = llm.engine.stats().get("spec") or {}
    return {"tok_s": tokens / seconds, "cpu_tok_s": tokens / cpu_seconds, "tokens": tokens,
            "accepted": stats.get("mean_accepted_length"), "k_steps": stats.get("dynamic_k_steps"),
            "outputs": [list(o.token_ids) for o in outs]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.adaptive_k", description=__doc__.splitlines()[0])
    ap.add_argument("--method", default="mtp")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per workload")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cpu-compile", default="off", help="the engines' cpu_compile: off, gemm or layers")
    ap.add_argument("--workloads", default="gsm8k,json-mode-eval", help="comma-separated: gsm8k, json-mode-eval")
    ap.add_argument("--name", default="adaptive_k_cpu", help="results file name under bench/results/")
    args = ap.parse_args(argv)

    from transformers import AutoTokenizer

    from engine import LLM, SpecConfig
    from zoo.models import resolve

    torch.set_num_threads(args.threads)
    paths = resolve("smollm2-135m-instruct")
    target = str(paths.target)
    draft = str(paths.heads[args.method]) if args.method in paths.heads else None
    sets = prompt_sets(AutoTokenizer.from_pretrained(target), args.prompts)
    unknown = set(args.workloads.split(",")) - set(sets)
    if unknown:
        ap.error(f"--workloads: unknown {sorted(unknown)}; choose from {sorted(sets)}")
    sets = {name: sets[name] for name in args.workloads.split(",")}
    batches = [int(b) for b in args.batches.split(",")]
    configs = {"none": None, **{f"k={k}": SpecConfig(method=args.method, k=k, draft=draft) for k in FIXED},
               "adaptive": SpecConfig(method=args.method, k=max(FIXED), draft=draft, adaptive_k=True)}
    rows = []
    for batch in batches:
        engines = {name: LLM(target, max_num_seqs=batch, num_kv_blocks=1024, speculative=spec,
                             cpu_compile=args.cpu_compile)
                   for name, spec in configs.items()}
        for llm in engines.values():
            llm.engine.guided.compiler().compile_timeout_s = None  # a shared CPU: compile time is not measured here
            for prompts in sets.values():
                run_engine(llm, prompts, batch, 24)  # warm-up
        for workload, prompts in sets.items():
            best: dict[str, dict] = {}
            for r in range(args.repeats):
                order = list(engines) if r % 2 == 0 else list(reversed(engines))  # neither end always first
                for name in order:
                    run = run_engine(engines[name], prompts, batch, args.max_tokens)
                    if name not in best or run["cpu_tok_s"] > best[name]["cpu_tok_s"]:
                        best[name] = run
            base = best["none"]
            best_fixed = max((f"k={k}" for k in FIXED), key=lambda n: best[n]["cpu_tok_s"])
            for name, run in best.items():
                row = {"workload": workload, "batch": batch, "config": name,
                       "accepted_incl_bonus": run["accepted"], "k_steps": run["k_steps"] if name == "adaptive" else None,
                       "cpu_tok_s": round(run["cpu_tok_s"], 1), "tok_s": round(run["tok_s"], 1),
                       "cpu_vs_none": round(run["cpu_tok_s"] / base["cpu_tok_s"], 3),
                       "cpu_vs_best_fixed": round(run["cpu_tok_s"] / best[best_fixed]["cpu_tok_s"], 3),
                       "best_fixed": best_fixed, "lossless": run["outputs"] == base["outputs"], "tokens": run["tokens"]}
                rows.append(row)
                print(json.dumps(row), flush=True)
        del engines
    table = ["| workload | batch | config | accepted/step (incl. bonus) | steps at k=0,1,2,3 | tok per CPU-s | vs none "
             "| vs best fixed k | wall tok/s | lossless |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        acc = f"{r['accepted_incl_bonus']:.2f}" if r["accepted_incl_bonus"] else "-"
        ks = ",".join(map(str, r["k_steps"])) if r["k_steps"] else "-"
        table.append(f"| {r['workload']} | {r['batch']} | {r['config']} | {acc} | {ks} | {r['cpu_tok_s']} "
                     f"| {r['cpu_vs_none']:.2f}x | {r['cpu_vs_best_fixed']:.2f}x ({r['best_fixed']}) | {r['tok_s']} "
                     f"| {r['lossless']} |")
    results = {"model": "smollm2-135m-instruct", "method": args.method, "device": device_name("cpu"),
               "threads": args.threads, "cpu_compile": args.cpu_compile, "max_tokens": args.max_tokens, "prompts_per_workload": args.prompts,
               "repeats": args.repeats, "runs": rows}
    print(write_results(args.name, results, "\n".join(table)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
