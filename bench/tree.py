"""Draft trees against chains at equal verification budget on the default real model (SmolLM2-135M-Instruct with
its prebuilt MTP and EAGLE-3 heads), issue 37's goals.

    python -m bench.tree [--budget 6] [--methods mtp,eagle3] [--prompts 6] [--max-tokens 64] [--quick] [--sets gsm8k]
    python -m bench.tree --zoo [--budget 6]     # the zoo's writer and its heads, held-out schema prompts
    python -m bench.tree --budget 16 --shapes 8x4,4x8 --quick   # trees past the chain's longest k (MAX_K = 8)

Per prompt set (MT-Bench, GSM8K unguided; json-mode-eval guided) and head, batch 1, greedy: the engine without
speculation, the chain of k = budget drafts and of k = 3 (the chain's usual k), and trees verifying `budget` nodes:
depth-first (depth = budget, topk 2 and 4: the cumulative-probability rule decides how deep, engine/speculative/
tree.py) and shallow (topk 3 and 4 at depth 3). Guided prompts also run each tree with the grammar masking
verification only (draft_masks=False), so the gain of masking the expansion shows, and without forced drafts
(forced_drafts=False), so the gain of the grammar's single-child stretches shows; every tree also runs with nodes
ranked by the head's probability (tree_score="draft", EAGLE-2's rule) beside the default, by acceptance rate
estimated online (engine/speculative/tree_score.py; the engine learns from its first request on, across prompt
sets and rounds, as a server would: the acceptance is reported for the first round and the last). Reported: acceptance length per
verification step including the bonus token, the median tokens/s over `--repeats` rounds (the configurations run
in turn, in reverse order every other round, so a drift of the machine's load hits both sides of a comparison
alike) and its ratio to no speculation's median, and whether the outputs equal no speculation's.
Writes bench/results/tree_vs_chain_{device}.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch

from bench.common import device_name, write_results
from bench.real_model import prompt_sets, run_engine


def configs(method: str, draft: str, budget: int, full: bool,
            shapes: list[tuple[int, int]] | None = None, chain_ks: list[int] | None = None) -> list[tuple[str, dict]]:
    """(label, SpecConfig fields) of one head: chains and trees at the verification budget; `shapes`: the trees'
    (topk, depth), default depth-first (depth = budget) and, unless quick, shallow (depth 3). Past MAX_K the
    chain is the longest the engine runs (k = MAX_K, fewer drafts than the trees' budget). chain_ks: the shorter
    chains to run beside it (default k = 3 unless quick), so that "the best chain" is the best of a sweep."""
    from engine.config import MAX_K

    base, deep = dict(method=method, draft=draft), min(budget, MAX_K)  # a chain's k (a tree's depth) stops at MAX_K
    shorter = chain_ks if chain_ks is not None else ([3] if full else [])
    rows = [(f"chain k={deep}", dict(base, k=deep))] + [(f"chain k={k}", dict(base, k=k)) for k in shorter if k != deep]
    explicit = shapes is not None
    if shapes is None:
        shapes = [(2, deep), (4, deep), (3, 3), (4, 3)] if full else [(2, deep), (4, deep)]
    for topk, depth in shapes:
        if not depth <= budget <= topk * depth:
            if explicit:
                raise ValueError(f"tree {topk}x{depth} cannot verify --budget {budget} nodes: pass depth <= budget "
                                 "<= topk x depth")
            continue
        rows.append((f"tree topk={topk} depth={depth}", dict(base, k=depth, topk=topk, num_verify_tokens=budget)))
    return rows


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """"4x8,8x4" -> [(4, 8), (8, 4)]: (topk, depth) per tree."""
    try:
        shapes = [tuple(int(v) for v in part.split("x")) for part in text.split(",")]
    except ValueError:
        shapes = [()]
    if any(len(shape) != 2 or min(shape) < 1 for shape in shapes):
        raise argparse.ArgumentTypeError(f"--shapes {text!r}: pass TOPKxDEPTH,... with positive integers, e.g. 4x8,8x4")
    return shapes


def zoo_sets(n: int):
    """The zoo's writer: (target dir, head dirs, {name: [(prompt, schema or None)]}) over its held-out schemas."""
    import zoo
    from zoo.corpus import heldout_cases
    from zoo.prompts import json_schema_prompt

    root = zoo.ensure_built(zoo.DEFAULT_SIZE)
    rows = [(json_schema_prompt(r["schema"]), r["schema"]) for r in heldout_cases()[:n]]
    sets = {"zoo-schemas": [(p, None) for p, _ in rows], "zoo-schemas guided": rows}
    return str(root / "target"), {m: str(root / m) for m in ("mtp", "eagle3")}, sets


def table(rows: list[dict]) -> str:
    """The markdown table of main's rows."""
    lines = ["| prompts | head | config | grammar, node score | accepted/step (incl. bonus), first round -> last "
             "| median tok/s | vs none | lossless |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        acc = (f"{r['accepted_first_round']:.2f} -> {r['accepted_incl_bonus']:.2f}" if r["accepted_incl_bonus"]
               else "-")
        grammar = {"masks": "expansion + verification masks, forced drafts", "verify-only": "verification masks only",
                   "no-forced": "masks, no forced drafts", "draft-score": "as masks"}[r["grammar"]] if r["guided"] else "-"
        if "tree" in r["config"]:
            grammar += ", nodes by draft probability" if r["grammar"] == "draft-score" else ", nodes by est. acceptance"
        lines.append(f"| {r['prompts']} | {r['method']} | {r['config']} | {grammar} | {acc} | {r['tok_s']} "
                     f"| {r['vs_none']:.2f}x | {r['lossless']} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=int, default=6, help="drafts verified per request and step")
    ap.add_argument("--methods", default="mtp,eagle3")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cpu-compile", default="off", help="the engines' cpu_compile: off, gemm or layers")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None,
                    help="the engines' dtype (default: the checkpoint's; float32 on cuda keeps the lossless column "
                         "exact, bf16 reductions differ by row count)")
    ap.add_argument("--name", default=None)
    ap.add_argument("--quick", action="store_true",
                    help="the depth-first tree shapes only (topk 2 and 4 at depth budget) and no chain at k=3")
    ap.add_argument("--sets", default=None, help="comma-separated prompt sets to run (default: all)")
    ap.add_argument("--variants", default="masks,verify-only,no-forced,draft-score",
                    help="variants of each tree: on guided prompts masks (the full grammar), verify-only, no-forced; "
                         "on all prompts draft-score (nodes ranked by draft probability)")
    ap.add_argument("--shapes", default=None, type=parse_shapes,
                    help="the trees' shapes, TOPKxDEPTH,... (e.g. 4x8,8x4); default depth-first at the budget")
    ap.add_argument("--chain-ks", default=None, type=lambda text: [int(k) for k in text.split(",")],
                    help="chains to run beside the chain of k = budget, K,K,... (default 3, none with --quick): the "
                         "best chain of a sweep, which issue 37's tokens/s goal compares against")
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
    if args.sets:
        sets = {name: sets[name] for name in args.sets.split(",")}
    rows: list[dict] = []
    # (head, config, variant) -> engine; "masks" (expansion and verification masks, forced drafts, calibrated
    # scores); for guided requests only "verify-only" (draft_masks=False), "no-forced" (forced_drafts=False);
    # "draft-score" (tree_score="draft") for all
    kw = {"cpu_compile": args.cpu_compile} if args.device == "cpu" else {}
    if args.dtype:
        kw["dtype"] = args.dtype
    engines = {("none", "none", "masks"): LLM(target, device=args.device, max_num_seqs=1, num_kv_blocks=160, **kw)}
    variants = {"masks": {}, "verify-only": dict(draft_masks=False), "no-forced": dict(forced_drafts=False),
                "draft-score": dict(tree_score="draft")}
    for method in args.methods.split(","):
        for label, fields in configs(method, heads[method], args.budget, not args.quick, args.shapes, args.chain_ks):
            for variant in (args.variants.split(",") if "tree" in label else ("masks",)):
                engines[(method, label, variant)] = LLM(target, device=args.device, max_num_seqs=1, num_kv_blocks=160,
                                                        speculative=SpecConfig(**fields, **variants[variant]), **kw)
    for name, prompts in sets.items():
        guided = any(schema is not None for _, schema in prompts)
        keys = [key for key in engines if guided or key[2] in ("masks", "draft-score")]
        runs: dict = {key: [] for key in keys}
        for round_ in range(args.repeats):
            for key in (keys if round_ % 2 == 0 else keys[::-1]):
                runs[key].append(run_engine(llm=engines[key], prompts=prompts, max_tokens=args.max_tokens))
        base = statistics.median(r["tok_s"] for r in runs[("none", "none", "masks")])
        for (method, label, variant), rounds in runs.items():
            tok_s = statistics.median(r["tok_s"] for r in rounds)
            row = {"prompts": name, "guided": guided, "method": method, "config": label, "grammar": variant,
                   "accepted_incl_bonus": rounds[-1]["accepted"], "accepted_first_round": rounds[0]["accepted"],
                   "tok_s": round(tok_s, 2),
                   "tok_s_rounds": [round(r["tok_s"], 2) for r in rounds], "vs_none": round(tok_s / base, 3),
                   "lossless": all(r["outputs"] == runs[("none", "none", "masks")][0]["outputs"] for r in rounds),
                   "tokens": rounds[0]["tokens"]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    results = {"model": "zoo writer" if args.zoo else "smollm2-135m-instruct", "device": device_name(args.device),
               "budget": args.budget, "shapes": args.shapes, "dtype": args.dtype, "cpu_compile": args.cpu_compile,
               "prompts": args.prompts, "max_tokens": args.max_tokens, "batch": 1, "runs": rows}
    print(write_results(args.name or f"tree_vs_chain_{args.device}", results, table(rows)))


if __name__ == "__main__":
    main()
