"""Guided JSON on JSONSchemaBench cases with the real default model: what a user gets for a schema.

    python -m bench.guided_json [--cases DIR] [--n 64] [--max-tokens 512] [--batch 16] [--method mtp --k 3]

For `--n` cases spread over the subsets (bench/structured.py's deterministic sample), SmolLM2-135M-Instruct
answers the training prompts' instruction plus the schema (zoo/selfdistill.schema_prompt), greedy, guided by the
schema through the engine (xgrammar, llguidance where xgrammar cannot enforce), with the served default's
speculation (lossless: the outputs are the engine's without it). A schema whose indented text would take more than
`--schema-tokens` of the prompt is shown compact, and left out where even that is too long (the grammar alone then
says what to write: with response_format a client's prompt need not hold the schema). Per subset and overall:
  - refused: the engine cannot enforce the schema and says so (InvalidRequestError when the request is added, or
    finish "error" when its grammar's compile fails);
  - completed: the grammar ended within `--max-tokens` (finish "stop"), of the served;
  - valid: of the completed, the instance validates against the schema (structured/output_check.py, the judge the
    router applies: the schema's own draft, formats asserted; a format the grammar does not enforce shows up here
    as an invalid output).
Issue 30's goal: 100% of completed outputs valid, >= 95% complete within 512 tokens. Writes
bench/results/guided_json_real_cpu.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

import torch

from bench.common import device_name, shared_data, write_results
from bench.structured import sample_cases, subset_of


def validate(text: str, schema: dict) -> str | None:
    """None when `text` is one JSON instance that `schema` accepts, else why not: the served path's own judge
    (structured/output_check.py: the schema's draft, formats asserted)."""
    from structured.output_check import output_violation

    return output_violation({"json_schema": schema}, text)


def prompt_for(tokenizer, schema: dict, budget: int) -> tuple[list[int], str]:
    """The chat prompt ids for a schema and how it shows the schema: "indented" (the training prompts' form),
    "compact" or "none" (when the schema would take more than `budget` tokens)."""
    from zoo.selfdistill import SCHEMA_INSTRUCTION, chat_ids, schema_prompt

    ids = chat_ids(tokenizer, schema_prompt(schema))
    if len(ids) <= budget:
        return ids, "indented"
    compact = chat_ids(tokenizer, [{"role": "user", "content": SCHEMA_INSTRUCTION + json.dumps(schema)}])
    if len(compact) <= budget:
        return compact, "compact"
    bare = [{"role": "user", "content": "Reply with a JSON object. Reply with the JSON only."}]
    return chat_ids(tokenizer, bare), "none"


def run(llm, cases: list[tuple[str, str, dict]], max_tokens: int, budget: int,
        **penalties: float) -> tuple[list[dict], float]:
    """One request per case, all queued at once (the engine batches them); -> (rows, seconds). `penalties`:
    SamplingParams' repetition_penalty / frequency_penalty / presence_penalty (greedy loops are what keeps a small
    model's guided output from completing; a penalty is what a user would try)."""
    from engine import InvalidRequestError, SamplingParams, StructuredOutput

    eng = llm.engine
    rows: dict[str, dict] = {}
    start = time.perf_counter()
    for name, subset, schema in cases:
        ids, shown = prompt_for(eng.tokenizer, schema, budget)
        row = rows[name] = {"case": name, "subset": subset, "refused": None, "schema_in_prompt": shown}
        params = SamplingParams(max_tokens=max_tokens, temperature=0, **penalties,
                                structured_output=StructuredOutput(json_schema=schema))
        try:
            eng.add_request(name, ids, params)
        except InvalidRequestError as e:
            row["refused"] = e.message[:200]
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                rows[out.request_id].update(finish=out.finish_reason, tokens=len(out.token_ids), text=out.text)
                if out.finish_reason == "error":  # its grammar failed to compile: refused, not decoded
                    rows[out.request_id]["refused"] = str(out.error)[:200]
    seconds = time.perf_counter() - start
    for name, _, schema in cases:
        row = rows[name]
        if row["refused"] is None and row["finish"] == "stop":
            row["invalid"] = validate(row["text"], schema)
    return list(rows.values()), seconds


def summarize(rows: list[dict]) -> dict:
    served = [r for r in rows if r["refused"] is None]
    done = [r for r in served if r["finish"] == "stop"]
    valid = [r for r in done if r["invalid"] is None]
    return {"cases": len(rows), "schema_not_in_prompt": sum(r["schema_in_prompt"] == "none" for r in rows),
            "refused": len(rows) - len(served), "served": len(served), "completed": len(done),
            "valid": len(valid), "completed_of_served": len(done) / len(served) if served else None,
            "valid_of_completed": len(valid) / len(done) if done else None,
            "mean_tokens": sum(r["tokens"] for r in served) / len(served) if served else None}


def table(overall: dict, by_subset: dict[str, dict], max_tokens: int) -> str:
    def pct(x):
        return "-" if x is None else f"{100 * x:.1f}%"

    lines = [f"| subset | cases | refused | served | completed within {max_tokens} (of served) | valid (of completed) "
             "| mean tokens |", "|---|---|---|---|---|---|---|"]
    for name, s in [*sorted(by_subset.items()), ("**all**", overall)]:
        mean = "-" if s["mean_tokens"] is None else f"{s['mean_tokens']:.0f}"
        lines.append(f"| {name} | {s['cases']} | {s['refused']} | {s['served']} | {s['completed']} "
                     f"({pct(s['completed_of_served'])}) | {s['valid']} ({pct(s['valid_of_completed'])}) | {mean} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.guided_json", description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=None,
                    help="a JSONSchemaBench-format case directory (default: the shared data's)")
    ap.add_argument("--n", type=int, default=64, help="cases, spread over the subsets")
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--batch", type=int, default=16, help="the engine's max_num_seqs")
    ap.add_argument("--method", default="mtp", help="speculative method (none, mtp, eagle3, ngram)")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--repetition-penalty", type=float, default=1.0, help="HF semantics, prompt and output tokens")
    ap.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI semantics, output tokens")
    ap.add_argument("--schema-tokens", type=int, default=4096, help="prompt budget for the schema's text")
    ap.add_argument("--cpu-compile", default="full")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--name", default="guided_json_real_cpu")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    from engine import LLM, SpecConfig
    from zoo.models import DEFAULT_MODEL, resolve

    model = resolve(DEFAULT_MODEL)
    cases_dir = Path(args.cases) if args.cases else shared_data() / "jsonschemabench" / "cases"
    cases = []
    for path in sample_cases(cases_dir, args.n):
        schema = json.loads(path.read_text(encoding="utf-8")).get("schema")
        if isinstance(schema, dict):
            cases.append((path.stem, subset_of(path), schema))
    spec = None
    if args.method != "none":
        draft = str(model.heads[args.method]) if args.method in model.heads else None
        tmap = model.token_maps.get(args.method)
        spec = SpecConfig(method=args.method, k=args.k, draft=draft, token_map=str(tmap) if tmap else None)
    llm = LLM(str(model.target), max_num_seqs=args.batch, num_kv_blocks=max(1024, args.batch * 96),
              cpu_compile=args.cpu_compile, weight_dtype="bfloat16", speculative=spec)
    penalties = {"repetition_penalty": args.repetition_penalty, "frequency_penalty": args.frequency_penalty}
    rows, seconds = run(llm, cases, args.max_tokens, args.schema_tokens, **penalties)
    groups = defaultdict(list)
    for r in rows:
        groups[r["subset"]].append(r)
    by_subset = {name: summarize(group) for name, group in groups.items()}
    overall = summarize(rows)
    spec_stats = llm.engine.stats().get("spec") or {}
    shown = ", ".join(f"{k} {v}" for k, v in penalties.items() if v != (1.0 if k == "repetition_penalty" else 0.0))
    decoding = "greedy" + (f" with {shown}" if shown else "")
    head = (f"SmolLM2-135M-Instruct, {decoding}, guided by each case's schema, {args.method} k={args.k}, batch "
            f"{args.batch}, {len(rows)} JSONSchemaBench cases, {seconds:.0f} s on {device_name('cpu')}; accepted per "
            f"step {spec_stats.get('mean_accepted_length')}")
    payload = {"device": device_name("cpu"), "model": DEFAULT_MODEL, "cases_dir": str(cases_dir), "n": len(rows),
               "max_tokens": args.max_tokens, **penalties, "method": args.method, "k": args.k, "batch": args.batch,
               "seconds": round(seconds, 1), "overall": overall, "by_subset": by_subset,
               "accepted_per_step": spec_stats.get("mean_accepted_length"),
               "rows": [{k: v for k, v in r.items() if k != "text"} | {"text": (r.get("text") or "")[:300]}
                        for r in rows]}
    print(head)
    print(table(overall, by_subset, args.max_tokens))
    print(write_results(args.name, payload, head + "\n\n" + table(overall, by_subset, args.max_tokens)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
