"""Structured outputs on the zoo target, in the engine: what guided decoding yields and what it costs.

For a directory of JSONSchemaBench-format cases (default: the zoo's own held-out schemas; pass any
other with --cases, as the held-out evaluation does), with greedy decoding and at most --max-tokens:
  - refused (the grammar cannot be compiled or enforced), completed (the grammar ended), and valid
    (jsonschema) among the completed;
  - mean accepted tokens per step at k = 3 for MTP, EAGLE-3 and ngram, with draft masks on and off;
  - guided vs unguided tokens/s with MTP k = 3 at batch 1 and 16 (same prompts, same output lengths;
    grammars compiled before timing: compile cost is bench/structured.py's);
  - side by side, the same schemas and prompts through transformers + xgrammar's logits processor
    (xgrammar.contrib.hf.LogitsProcessor; the schema compiled as is, compact JSON, no refusal):
    completed, valid of completed, tok/s at batch 1, next to the engine's (no speculation, batch 1).
The compile/faithfulness side of the benchmark is bench/structured.py.

    python -m bench.structured_decode [--zoo DIR] [--cases DIR] [--n 24]
"""
from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from bench.common import device_name, write_results


def load_cases(cases_dir: str | None, n: int) -> list[dict]:
    """[{name, schema}] : a seeded sample of a case directory, or the zoo's held-out split."""
    if cases_dir is None:
        from zoo.corpus import heldout_cases

        return [{"name": f"zoo-heldout-{i}", "schema": row["schema"]} for i, row in enumerate(heldout_cases()[:n])]
    files = sorted(Path(cases_dir).glob("*.json"))
    random.Random(0).shuffle(files)
    out = []
    for f in files:
        case = json.loads(f.read_text())
        if isinstance(case.get("schema"), dict):
            out.append({"name": f.stem, "schema": case["schema"]})
        if len(out) == n:
            break
    return out


def generate(llm, prompts: list[str], schemas: list[dict | None], max_tokens: int | list[int],
             ignore_eos: bool = False) -> tuple[list, float, list[str]]:
    """Outputs (None where refused), seconds, refusal reasons. A list of max_tokens gives each request its own."""
    from engine import InvalidRequestError, SamplingParams, StructuredOutput

    eng = llm.engine
    ids, refused, outs = {}, [], {}
    start = time.perf_counter()
    for i, (prompt, schema) in enumerate(zip(prompts, schemas)):
        structured = StructuredOutput(json_schema=schema) if schema is not None else None
        limit = max_tokens[i] if isinstance(max_tokens, list) else max_tokens
        params = SamplingParams(max_tokens=limit, temperature=0, structured_output=structured, ignore_eos=ignore_eos)
        try:
            eng.add_request(f"r{i}", prompt, params)
            ids[f"r{i}"] = i
        except InvalidRequestError as e:
            refused.append(e.message)
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                outs[ids[o.request_id]] = o
    seconds = time.perf_counter() - start
    return [outs.get(i) for i in range(len(prompts))], seconds, refused


def hf_xgrammar(target_dir: str, tokenizer, prompts: list[str], schemas: list[dict], max_tokens: int) -> dict:
    """Greedy transformers generate() with xgrammar's HF logits processor, one request at a time: each
    schema compiled by xgrammar as a transformers user would (compact JSON, no rewrite, no refusal).
    Completed = it wrote EOS within max_tokens (the grammar ended); tok/s excludes compiles."""
    import jsonschema
    import xgrammar as xgr
    from transformers import AutoModelForCausalLM
    from xgrammar.contrib.hf import LogitsProcessor

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    eos = tokenizer.eos_token_id
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=model.config.vocab_size, stop_token_ids=[eos])
    compiler = xgr.GrammarCompiler(info)
    out = {"compile_failed": 0, "completed": 0, "valid": 0, "tokens": 0, "seconds": 0.0, "invalid_samples": []}
    for prompt, schema in zip(prompts, schemas):
        try:
            compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(", ", ": "))
        except Exception:  # noqa: BLE001 - xgrammar cannot compile it: not served
            out["compile_failed"] += 1
            continue
        ids = torch.tensor([tokenizer.encode(prompt)])
        start = time.perf_counter()
        with torch.no_grad():
            got = model.generate(ids, max_new_tokens=max_tokens, do_sample=False, eos_token_id=eos,
                                 pad_token_id=eos, logits_processor=[LogitsProcessor(compiled)])
        out["seconds"] += time.perf_counter() - start
        new = got[0, ids.shape[1]:].tolist()
        out["tokens"] += len(new)
        if not new or new[-1] != eos:
            continue
        out["completed"] += 1
        text = tokenizer.decode(new[:-1])
        try:
            jsonschema.validate(json.loads(text), schema)
            out["valid"] += 1
        except (json.JSONDecodeError, jsonschema.ValidationError, jsonschema.SchemaError):
            out["invalid_samples"].append(text[:200])
    out["tok_s"] = out["tokens"] / out["seconds"] if out["seconds"] else None
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--zoo", default=None, help="a built zoo directory (default: the default zoo)")
    ap.add_argument("--cases", default=None, help="a JSONSchemaBench-format case directory")
    ap.add_argument("--n", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--name", default="structured_decode_cpu")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    import jsonschema

    import zoo
    from engine import LLM, SpecConfig
    from zoo.prompts import json_schema_prompt

    paths = zoo.layout(args.zoo or zoo.build())
    cases = load_cases(args.cases, args.n)
    prompts = [json_schema_prompt(c["schema"]) for c in cases]
    schemas = [c["schema"] for c in cases]
    kw = dict(max_num_seqs=64, num_kv_blocks=4096, block_size=16)
    results: dict = {"device": device_name("cpu"), "zoo": str(paths.root), "cases": args.cases or "zoo held-out",
                     "n": len(cases), "max_tokens": args.max_tokens}

    # 1. what guided greedy decoding yields (no speculation: the reference output)
    outs, seconds, refused = generate(LLM(str(paths.target), **kw), prompts, schemas, args.max_tokens)
    done = [(o, s) for o, s in zip(outs, schemas) if o is not None and o.finish_reason == "stop"]
    valid = 0
    for o, s in done:
        try:
            jsonschema.validate(json.loads(o.text), s)
            valid += 1
        except (json.JSONDecodeError, jsonschema.ValidationError, jsonschema.SchemaError):
            pass
    served = sum(o is not None for o in outs)
    results["quality"] = {"refused": len(refused), "served": served, "completed": len(done), "valid": valid,
                          "refusals": refused[:10], "samples": [o.text for o, _ in done[:3]]}
    print(results["quality"], flush=True)

    # 1b. side by side at batch 1: the engine (no speculation, grammars compiled before the clock) and
    # transformers + xgrammar's logits processor on the same prompts and schemas; interleaved, best of
    # two (the machine is shared)
    llm = LLM(str(paths.target), **{**kw, "max_num_seqs": 1})
    generate(llm, prompts, schemas, 1)
    engine_tok_s, hf = 0.0, None
    for _ in range(2):
        got, secs, _ = generate(llm, prompts, schemas, args.max_tokens)
        engine_tok_s = max(engine_tok_s, sum(len(o.token_ids) for o in got if o is not None) / secs)
        run = hf_xgrammar(str(paths.target), llm.engine.tokenizer, prompts, schemas, args.max_tokens)
        hf = run if hf is None or run["tok_s"] > hf["tok_s"] else hf
    results["side_by_side"] = {"engine": {**results["quality"], "tok_s": engine_tok_s}, "hf_xgrammar": hf}
    print(results["side_by_side"], flush=True)

    # 2. acceptance at k = 3 with draft masks on and off (same outputs: greedy is lossless)
    heads = {"mtp": str(paths.mtp), "eagle3": str(paths.eagle3), "ngram": None}
    results["acceptance"] = []
    for method, draft in heads.items():
        for masks in (True, False):
            spec = SpecConfig(method=method, k=3, draft=draft, draft_masks=masks)
            llm = LLM(str(paths.target), speculative=spec, **kw)
            got, secs, _ = generate(llm, prompts, schemas, args.max_tokens)
            same = all((a is None and b is None) or (a is not None and b is not None and a.token_ids == b.token_ids)
                       for a, b in zip(got, outs))
            row = {"method": method, "draft_masks": masks, "lossless": same,
                   "mean_accepted": llm.engine.stats()["spec"]["mean_accepted_length"],
                   "tok_s": sum(len(o.token_ids) for o in got if o is not None) / secs}
            results["acceptance"].append(row)
            print(row, flush=True)

    # 3. guided vs unguided speed, MTP k = 3: the unguided run makes exactly as many tokens per request
    # as the guided one did (its outputs run to max_tokens otherwise, and lengths change tokens/s)
    lengths = [len(o.token_ids) if o is not None else 1 for o in outs]
    results["speed"] = []
    for batch in (1, 16):
        best: dict[bool, dict] = {}
        for _ in range(2):  # interleaved, best of two: the machine is shared
            for guided in (False, True):
                spec = SpecConfig(method="mtp", k=3, draft=str(paths.mtp))
                llm = LLM(str(paths.target), speculative=spec, **{**kw, "max_num_seqs": batch})
                if guided:  # grammars compiled (and the compile process started) before the clock runs
                    generate(llm, prompts, schemas, 1)
                    got, secs, _ = generate(llm, prompts, schemas, args.max_tokens)
                else:
                    got, secs, _ = generate(llm, prompts, [None] * len(prompts), lengths, ignore_eos=True)
                tokens = sum(len(o.token_ids) for o in got if o is not None)
                row = {"batch": batch, "guided": guided, "tok_s": tokens / secs, "tokens": tokens,
                       "mean_accepted": llm.engine.stats()["spec"]["mean_accepted_length"]}
                if guided not in best or row["tok_s"] > best[guided]["tok_s"]:
                    best[guided] = row
        results["speed"] += [best[False], best[True]]
        print(best, flush=True)

    q = results["quality"]
    lines = [f"# Structured outputs in the engine ({results['device']})", "",
             f"Zoo `{paths.root.name}`, {q['served'] + q['refused']} schemas ({results['cases']}), greedy, at most "
             f"{args.max_tokens} tokens, torch threads {args.threads}; the CPU is shared with other jobs.", "",
             "| refused | served | completed (of served) | valid (of completed) |", "|---|---|---|---|",
             f"| {q['refused']} | {q['served']} | {q['completed']} ({q['completed'] / max(1, q['served']):.0%}) | "
             f"{q['valid']} ({q['valid'] / max(1, q['completed']):.0%}) |", "",
             "| method (k=3) | draft masks | mean accepted | tok/s | equals guided no-spec |", "|---|---|---|---|---|"]
    lines += [f"| {r['method']} | {'on' if r['draft_masks'] else 'off'} | {r['mean_accepted']:.2f} | {r['tok_s']:.0f} | "
              f"{'yes' if r['lossless'] else 'NO'} |" for r in results["acceptance"]]
    e, h = results["side_by_side"]["engine"], results["side_by_side"]["hf_xgrammar"]
    n_cases = q["served"] + q["refused"]
    lines += ["", "Side by side, same prompts and schemas, greedy, batch 1 (no speculation; best of two interleaved "
              "runs each, grammars compiled before the clock):", "",
              "| system | served | completed (of served) | valid (of completed) | tok/s |", "|---|---|---|---|---|",
              f"| Tandem engine (xgrammar + llguidance, refusals) | {e['served']} | {e['completed']} | {e['valid']} "
              f"({e['valid'] / max(1, e['completed']):.0%}) | {e['tok_s']:.0f} |",
              f"| transformers + xgrammar LogitsProcessor | {n_cases - h['compile_failed']} | {h['completed']} | "
              f"{h['valid']} ({h['valid'] / max(1, h['completed']):.0%}) | {h['tok_s']:.0f} |"]
    lines += [f"- invalid completed output (transformers + xgrammar): `{t[:160]}`" for t in h["invalid_samples"][:4]]
    lines += ["", "| batch | guided | tok/s | mean accepted (MTP k=3) |", "|---|---|---|---|"]
    lines += [f"| {r['batch']} | {'yes' if r['guided'] else 'no'} | {r['tok_s']:.0f} | {r['mean_accepted']:.2f} |"
              for r in results["speed"]]
    lines += ["", "Sample completed outputs:", *[f"- `{t[:160]}`" for t in q["samples"]]]
    print(write_results(args.name, results, "\n".join(lines)).read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
