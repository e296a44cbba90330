"""Draft trees against chains at equal verification budget on the default real model (SmolLM2-135M-Instruct with
its prebuilt MTP and EAGLE-3 heads), issue 37's goals.

    python -m bench.tree [--budget 6] [--methods mtp,eagle3] [--prompts 6] [--max-tokens 64] [--quick]
    python -m bench.tree --zoo [--budget 6]     # the zoo's writer and its heads, held-out schema prompts

Per prompt set (MT-Bench, GSM8K unguided; json-mode-eval guided) and head, batch 1, greedy: the engine without
speculation, the chain of k = budget drafts and of k = 3 (the chain's usual k), and trees verifying `budget` nodes
(topk 2 at depth budget - 2, topk 3 and 4 at depth 3); guided prompts also run each tree with the grammar masking
verification only (draft_masks=False), so the gain of masking the expansion shows. Reported: acceptance length
per verification step including the bonus token, tokens/s and its ratio to no speculation (the configurations
run in turn, `--repeats` rounds, each keeping its fastest), and whether the outputs equal no speculation's.
Writes bench/results/tree_vs_chain_{device}.{json,md}.
"""
from __future__ import annotations

import argparse
import json

import torch

from bench.common import device_name, write_results
from bench.real_model import prompt_sets, run_engine


def configs(method: str, draft: str, budget: int, full: bool) -> list[tuple[str, dict]]:
    """(label, SpecConfig fields) of one head: chains and trees at the verification budget."""
    base = dict(method=method, draft=draft)
    rows = [(f"chain k={budget}", dict(base, k=budget))] + ([("chain k=3", dict(base, k=3))] if full else [])
    shapes = [(2, max(2, budget - 2)), (3, 3), (4, 3)] if full else [(4, 3)]
    for topk, depth in shapes:
        if depth <= budget <= topk * depth:
            rows.append((f"tree topk={topk} depth={depth}", dict(base, k=depth, topk=topk, num_verify_tokens=budget)))
    return rows


def zoo_sets(n: int):
    """The zoo's writer: (target dir, head dirs, {name: [(prompt, schema or None)]}) over its held-out schemas."""
    import zoo
    from zoo.corpus import heldout_cases
    from zoo.prompts import json_schema_prompt

    root = zoo.ensure_built(zoo.DEFAULT_SIZE)
    rows = [(json_schema_prompt(r["schema"]), r["schema"]) for r in heldout_cases()[:n]]
    sets = {"zoo-schemas": [(p, None) for p, _ in rows], "zoo-schemas guided": rows}
    return str(root / "target"), {m: str(root / m) for m in ("mtp", "eagle3")}, sets


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=int, default=6, help="drafts verified per request and step")
    ap.add_argument("--methods", default="mtp,eagle3")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--name", default=None)
    ap.add_argument("--quick", action="store_true", help="one tree shape (topk 4, depth 3) and no chain at k=3")
    ap.add_argument("--zoo", action="store_true", help="the zoo's writer target and heads on held-out schemas "
                                                       "(unguided and guided) instead of SmolLM2")
    args = ap.parse_args(argv)

    from transformers import AutoTokenizer

    from engine import LLM, SpecConfig
    from zoo.models import resolve

    torch.set_num_threads(args.threads)
    if args.zoo:
        target, heads, sets = zoo_sets(args.prompts)
    else:
        paths = resolve("smollm2-135m-instruct")
        target, heads = str(paths.target), {m: str(p) for m, p in paths.heads.items()}
        sets = prompt_sets(AutoTokenizer.from_pretrained(target), args.prompts)
    rows: list[dict] = []
    engines = {("none", "none", True): LLM(target, device=args.device, max_num_seqs=1, num_kv_blocks=160)}
    for method in args.methods.split(","):
        for label, fields in configs(method, heads[method], args.budget, not args.quick):
            for masks in ((True, False) if "tree" in label else (True,)):
                engines[(method, label, masks)] = LLM(target, device=args.device, max_num_seqs=1, num_kv_blocks=160,
                                                      speculative=SpecConfig(**fields, draft_masks=masks))
    for name, prompts in sets.items():
        guided = any(schema is not None for _, schema in prompts)
        best: dict = {}
        for _ in range(args.repeats):
            for key, llm in engines.items():
                if not key[2] and not guided:
                    continue  # masks only change guided requests
                run = run_engine(llm, prompts, args.max_tokens)
                if key not in best or run["tok_s"] > best[key]["tok_s"]:
                    best[key] = run
        base = best[("none", "none", True)]
        for (method, label, masks), run in best.items():
            row = {"prompts": name, "guided": guided, "method": method, "config": label, "expansion_masks": masks,
                   "accepted_incl_bonus": run["accepted"], "tok_s": round(run["tok_s"], 2),
                   "vs_none": round(run["tok_s"] / base["tok_s"], 3), "lossless": run["outputs"] == base["outputs"],
                   "tokens": run["tokens"]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    table = ["| prompts | head | config | expansion masks | accepted/step (incl. bonus) | tok/s | vs none | lossless |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        acc = f"{r['accepted_incl_bonus']:.2f}" if r["accepted_incl_bonus"] else "-"
        masks = ("on" if r["expansion_masks"] else "off (verify only)") if r["guided"] else "-"
        table.append(f"| {r['prompts']} | {r['method']} | {r['config']} | {masks} | {acc} | {r['tok_s']} "
                     f"| {r['vs_none']:.2f}x | {r['lossless']} |")
    results = {"model": "zoo writer" if args.zoo else "smollm2-135m-instruct", "device": device_name(args.device), "budget": args.budget,
               "prompts": args.prompts, "max_tokens": args.max_tokens, "batch": 1, "runs": rows}
    print(write_results(args.name or f"tree_vs_chain_{args.device}", results, "\n".join(table)))


if __name__ == "__main__":
    main()
