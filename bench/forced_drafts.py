"""Grammar-forced drafts (SpecConfig.forced_drafts) on the real default model, SmolLM2-135M-Instruct, guided.

    python -m bench.forced_drafts [--prompts 6] [--max-tokens 64] [--k 3] [--methods mtp,eagle3,ngram,grammar]

(`mtp-map` in --methods: MTP drafting from its shipped 16,384-id token map, as `tandem serve` runs it.)

Per prompt set (json-mode-eval schemas; JSONSchemaBench dev schemas spread evenly over the cases in name order,
so over its subsets), batch 1, guided JSON (compact): mean acceptance length per verification step INCLUDING the bonus
token, and tokens/s against the engine without speculation, for each method with forced drafts on and off
(`grammar` drafts nothing else, so off it is plain k+1-row steps: not run). Every speculative run's greedy
outputs must equal the run without speculation (lossless). Every prompt runs once per engine before the
measured rounds (grammars compiled, prompts in the prefix cache); configurations run in turn, `--repeats`
rounds, each keeping its fastest. Speed is reported as decode tokens/s (wall time after each first token) and
as tokens per CPU-second of this process (one torch thread: what the run cost, robust to other jobs on a
shared machine, which wall time is not). Writes bench/results/forced_drafts_cpu.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from bench.common import device_name, write_results

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def prompt_sets(tokenizer, n: int, data: Path = DATA) -> dict[str, list[tuple[list[int], dict]]]:
    """name -> [(prompt ids, schema)]: the first n json-mode-eval items, n JSONSchemaBench dev cases."""
    from zoo.selfdistill import chat_ids, schema_prompt

    items = sorted((data / "json-mode-eval/items").glob("*.json"), key=lambda p: int(p.stem.split("_")[1]))[:n]
    jme = [json.loads(p.read_text())["schema"] for p in items]
    cases = sorted((data / "jsonschemabench/cases").glob("*.json"))
    cases = cases[len(cases) // (2 * n):: len(cases) // n][:n]  # spread over the subsets (names sort by subset)
    jsb = [json.loads(p.read_text())["schema"] for p in cases]
    return {name: [(chat_ids(tokenizer, schema_prompt(s)), s) for s in schemas]
            for name, schemas in (("json-mode-eval", jme), ("jsonschemabench", jsb))}


def run_engine(llm, prompts, max_tokens: int) -> dict:
    from engine import SamplingParams, StructuredOutput

    params = [SamplingParams(max_tokens=max_tokens, temperature=0, structured_output=StructuredOutput(json_schema=s))
              for _, s in prompts]
    llm.engine.spec_stats.reset()
    start, cpu_start = time.perf_counter(), time.process_time()
    outs = [llm.generate([p], [sp])[0] for (p, _), sp in zip(prompts, params)]  # batch 1
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    tokens = sum(len(o.token_ids) for o in outs)
    # decode alone: the tokens after each first one over the time after it (the prompt's forward left out)
    decode_s = sum(o.metrics.last_token_time - o.metrics.first_token_time for o in outs)
    stats = llm.engine.stats().get("spec") or {}
    return {"tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds, "cpu_tok_s": tokens / cpu_seconds,
            "accepted": stats.get("mean_accepted_length"),
            "decode_tok_s": (tokens - len(outs)) / decode_s if decode_s > 0 else None,
            "outputs": [list(o.token_ids) for o in outs], "finished": sum(o.finish_reason == "stop" for o in outs)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.forced_drafts", description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=6, help="prompts per set")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--methods", default="mtp,eagle3,ngram,grammar")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cpu-compile", default="off", help="the engines' cpu_compile: off, gemm or layers")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--name", default="forced_drafts_cpu", help="results file name under bench/results/")
    args = ap.parse_args(argv)

    from transformers import AutoTokenizer

    from engine import LLM, SpecConfig
    from zoo.models import resolve

    torch.set_num_threads(args.threads)
    paths = resolve("smollm2-135m-instruct")
    target = str(paths.target)
    sets = prompt_sets(AutoTokenizer.from_pretrained(target), args.prompts)
    configs: dict[tuple[str, bool], SpecConfig | None] = {("none", False): None}
    for method in args.methods.split(","):
        # mtp-map: MTP drafting from its shipped hot vocabulary (zoo/models.py token_maps), as `tandem serve` runs it
        kind = method.removesuffix("-map")
        token_map = str(paths.token_maps[kind]) if method.endswith("-map") else None
        draft = str(paths.heads[kind]) if kind in paths.heads else None
        for forced in (True, False) if method != "grammar" else (True,):
            configs[(method, forced)] = SpecConfig(method=kind, k=args.k, draft=draft, forced_drafts=forced,
                                                   token_map=token_map)
    engines = {key: LLM(target, max_num_seqs=1, num_kv_blocks=512, speculative=spec,
                       cpu_compile=args.cpu_compile) for key, spec in configs.items()}
    for llm in engines.values():
        llm.engine.guided.compiler().compile_timeout_s = None  # a shared CPU: compile time is not measured here
        for prompts in sets.values():  # warm-up: grammars compiled, prompts in the prefix cache, first-call costs
            run_engine(llm, prompts, 1)
    rows = []
    for name, prompts in sets.items():
        best: dict = {}
        for _ in range(args.repeats):
            for key, llm in engines.items():
                run = run_engine(llm, prompts, args.max_tokens)
                if key not in best or run["tok_s"] > best[key]["tok_s"]:
                    best[key] = run
        base = best[("none", False)]
        for (method, forced), run in best.items():
            off = best.get((method, False))
            row = {"prompts": name, "method": method, "k": 0 if method == "none" else args.k, "forced_drafts": forced,
                   "accepted_incl_bonus": run["accepted"], "tok_s": round(run["tok_s"], 1),
                   "cpu_tok_s": round(run["cpu_tok_s"], 1),
                   "cpu_vs_none": round(run["cpu_tok_s"] / base["cpu_tok_s"], 3),
                   "cpu_vs_forced_off": round(run["cpu_tok_s"] / off["cpu_tok_s"], 3) if forced and off else None,
                   "decode_tok_s": round(run["decode_tok_s"], 1),
                   "vs_none": round(run["tok_s"] / base["tok_s"], 3),
                   "decode_vs_none": round(run["decode_tok_s"] / base["decode_tok_s"], 3),
                   "vs_forced_off": round(run["tok_s"] / off["tok_s"], 3) if forced and off else None,
                   "decode_vs_forced_off": (round(run["decode_tok_s"] / off["decode_tok_s"], 3)
                                            if forced and off else None),
                   "lossless": run["outputs"] == base["outputs"], "tokens": run["tokens"], "finished": run["finished"]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    table = ["| prompts | method | k | forced drafts | accepted/step (incl. bonus) | decode tok/s | vs none "
             "| vs forced off | tok per CPU-s | vs none | vs forced off | lossless |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        acc = f"{r['accepted_incl_bonus']:.2f}" if r["accepted_incl_bonus"] else "-"
        off = f"{r['decode_vs_forced_off']:.2f}x" if r["decode_vs_forced_off"] else "-"
        cpu_off = f"{r['cpu_vs_forced_off']:.2f}x" if r["cpu_vs_forced_off"] else "-"
        table.append(f"| {r['prompts']} | {r['method']} | {r['k']} | {'on' if r['forced_drafts'] else 'off'} | {acc} "
                     f"| {r['decode_tok_s']} | {r['decode_vs_none']:.2f}x | {off} | {r['cpu_tok_s']} "
                     f"| {r['cpu_vs_none']:.2f}x | {cpu_off} | {r['lossless']} |")
    results = {"model": "smollm2-135m-instruct", "device": device_name("cpu"), "threads": args.threads, "cpu_compile": args.cpu_compile, "k": args.k,
               "max_tokens": args.max_tokens, "prompts_per_set": args.prompts, "batch": 1, "runs": rows}
    print(write_results(args.name, results, "\n".join(table)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
