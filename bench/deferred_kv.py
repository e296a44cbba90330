"""Adaptive k with the MTP head's KV deferred at k = 0 steps (engine/speculative/deferred_kv.py) against the same
with the head's pass run at every step, and both against no speculation, on the real default model at large
batches, where adaptive k settles at k = 0 on a CPU.

    python -m bench.deferred_kv [--batches 16,64] [--sets gsm8k,json-mode-eval] [--rounds 5] [--max-tokens 64]

The three engines live in one process and run each prompt set in turn, round after round (A, B, C, A, B, C, ...),
so that a burst of another job on the shared machine lands on one round of each, not on one engine; per round the
ratio of each engine's tokens/s to no speculation's, and the median over rounds. Beside wall time, tokens per second
of the process's CPU time: a VM's stolen time (other guests on the host) is not counted in it, and on this 2-core
VM it moved wall-time ratios by 10-20% from round to round. Outputs must equal no speculation's (greedy: lossless).
Writes bench/results/<name>.{json,md}.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch

from bench.common import device_name, write_results
from bench.real_model import prompt_sets, run_engine


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="16,64")
    ap.add_argument("--sets", default="gsm8k,json-mode-eval")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cpu-compile", default="full")
    ap.add_argument("--weight-dtype", default="bfloat16")
    ap.add_argument("--name", default="deferred_kv_cpu")
    args = ap.parse_args(argv)

    from transformers import AutoTokenizer

    from engine import LLM, SpecConfig
    from zoo.models import resolve

    torch.set_num_threads(args.threads)
    paths = resolve("smollm2-135m-instruct")
    target, head = str(paths.target), str(paths.heads["mtp"])
    batches = [int(b) for b in args.batches.split(",")]
    sets = prompt_sets(AutoTokenizer.from_pretrained(target), max(batches))
    rows = []
    for batch in batches:
        gc.collect()
        kw = dict(max_num_seqs=batch, num_kv_blocks=batch * 48, block_size=16, cpu_compile=args.cpu_compile,
                  weight_dtype=args.weight_dtype)
        engines = {"none": LLM(target, **kw)}
        for name, defer in (("adaptive, deferred", True), ("adaptive, every step", False)):
            engines[name] = LLM(target, speculative=SpecConfig(method="mtp", k=args.k, draft=head, adaptive_k=True,
                                                               defer_draft_kv=defer), **kw)
        for set_name in args.sets.split(","):
            prompts = sets[set_name][:batch]
            runs = {name: [] for name in engines}
            for _ in range(args.rounds):
                for name, llm in engines.items():
                    cpu = time.process_time()
                    run = run_engine(llm, prompts, args.max_tokens)
                    run["cpu_tok_s"] = run["tokens"] / (time.process_time() - cpu)
                    runs[name].append(run)
            base = runs["none"]
            for name, rs in runs.items():
                ratios = [r["tok_s"] / b["tok_s"] for r, b in zip(rs, base)]
                cpu_ratios = [r["cpu_tok_s"] / b["cpu_tok_s"] for r, b in zip(rs, base)]
                row = {"prompts": set_name, "requests": len(prompts), "batch": batch, "engine": name,
                       "tok_s_median": round(statistics.median(r["tok_s"] for r in rs), 1),
                       "vs_none_median": round(statistics.median(ratios), 3),
                       "vs_none_rounds": [round(x, 3) for x in ratios],
                       "cpu_vs_none_median": round(statistics.median(cpu_ratios), 3),
                       "cpu_vs_none_rounds": [round(x, 3) for x in cpu_ratios],
                       "k_steps": rs[-1]["k_steps"], "lossless": all(r["outputs"] == base[0]["outputs"] for r in rs)}
                rows.append(row)
                print(json.dumps(row), flush=True)
        engines = None
    table = ["| prompts | batch | engine | tok/s (median) | vs none (median of rounds) | rounds | vs none, CPU time "
             "(median) | rounds, CPU time | steps at k=0..3 (last round) | lossless |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        steps = ",".join(map(str, r["k_steps"])) if r["k_steps"] else "-"
        table.append(f"| {r['prompts']} | {r['batch']} | {r['engine']} | {r['tok_s_median']} | "
                     f"{r['vs_none_median']:.3f}x | {', '.join(f'{x:.2f}' for x in r['vs_none_rounds'])} | "
                     f"{r['cpu_vs_none_median']:.3f}x | {', '.join(f'{x:.2f}' for x in r['cpu_vs_none_rounds'])} | "
                     f"{steps} | {r['lossless']} |")
    results = {"model": "smollm2-135m-instruct", "device": device_name("cpu"), "cpu_compile": args.cpu_compile,
               "weight_dtype": args.weight_dtype, "k": args.k, "max_tokens": args.max_tokens, "rounds": args.rounds,
               "runs": rows}
    print(write_results(args.name, results, "\n".join(table)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
