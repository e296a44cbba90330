"""MTP speculation on the zoo's DeepSeek-V3 in miniature (`tandem-tiny-moe`: MLA + MoE, its own trained MTP layer
in the target's checkpoint): mean accepted length (drafts accepted + the bonus token, per decoding step) and
tokens/s for k = 1..3 against no speculation, every run's tokens checked equal to no speculation's (lossless).

Prompts: held-out JSON-schema prompts (schemas the zoo never trained on, at most the recipe's schema length) in
the zoo's template; greedy to the end token or --max-tokens, at batch 1 (one request in flight) by default.
Configurations take turns round by round (the order rotates) and each reports the median over rounds: the CPU
is shared with other jobs, so single runs are noisy and alternation keeps drift from favouring one config.

    python -m bench.moe_spec [--ks 1,2,3] [--prompts 8] [--max-tokens 64] [--rounds 3] [--batch 1]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from bench.common import device_name, write_results


def heldout_prompts(n: int, max_schema_chars: int) -> list[str]:
    from zoo.corpus import heldout_cases
    from zoo.prompts import json_schema_prompt

    schemas = [row["schema"] for row in heldout_cases()
               if len(json.dumps(row["schema"], separators=(",", ":"))) <= max_schema_chars]
    return [json_schema_prompt(s) for s in schemas[:n]]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ks", default="1,2,3")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch", type=int, default=1, help="requests in flight (max_num_seqs)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--name", default="moe_spec_cpu")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    from engine import LLM, SamplingParams, SpecConfig
    from zoo.models import resolve
    from zoo.recipe import RECIPES

    paths = resolve("tandem-tiny-moe")
    prompts = heldout_prompts(args.prompts, RECIPES["tiny-moe"].max_schema_chars)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    ks = [0] + [int(k) for k in args.ks.split(",")]
    llms = {k: LLM(str(paths.target), num_kv_blocks=256, max_num_seqs=args.batch,
                   speculative=SpecConfig(method="mtp", k=k) if k else None) for k in ks}
    for llm in llms.values():  # warm-up
        llm.generate(prompts[:1], params)

    seconds: dict[int, list[float]] = {k: [] for k in ks}
    tokens: dict[int, list[list[int]]] = {}
    accepted: dict[int, float | None] = {}
    for r in range(args.rounds):
        for k in ks[r % len(ks):] + ks[: r % len(ks)]:
            llm = llms[k]
            if k:
                llm.engine.spec_stats.reset()
            start = time.perf_counter()
            outs = llm.generate(prompts, params)
            seconds[k].append(time.perf_counter() - start)
            tokens.setdefault(k, [o.token_ids for o in outs])
            if k:
                accepted[k] = llm.engine.spec_stats.as_dict()["spec"]["mean_accepted_length"]
    n_tokens = sum(len(t) for t in tokens[0])
    base = statistics.median(seconds[0])
    rows = []
    for k in ks:
        med = statistics.median(seconds[k])
        rows.append(dict(k=k, mean_accepted_length=round(accepted[k], 3) if k else 1.0,
                         tokens_per_s=round(n_tokens / med, 1), speedup=round(base / med, 3),
                         lossless=tokens[k] == tokens[0], seconds=[round(s, 2) for s in seconds[k]]))
    table = "\n".join(
        [f"MTP speculation on tandem-tiny-moe ({device_name('cpu')}, batch {args.batch}, {len(prompts)} held-out "
         f"JSON-schema prompts, greedy, {n_tokens} tokens, median of {args.rounds} alternating rounds)", "",
         "| k | mean accepted length (incl. bonus) | tokens/s | vs k=0 | tokens equal k=0 |", "|---|---|---|---|---|"]
        + [f"| {r['k']} | {r['mean_accepted_length']} | {r['tokens_per_s']} | {r['speedup']}x | {r['lossless']} |"
           for r in rows])
    print(table)
    write_results(args.name, {"model": str(paths.target), "prompts": len(prompts), "tokens": n_tokens,
                              "batch": args.batch, "rows": rows}, table)
    return 0 if all(r["lossless"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
