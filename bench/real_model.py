"""Benchmarks on the real default model, SmolLM2-135M-Instruct (zoo/models.py), each a ratio in one run.

    python -m bench.real_model spec   [--batches 1,16] [--ks 3] [--methods mtp,eagle3,ngram] [--prompts 8]
    python -m bench.real_model decode [--batches 1,16,64] [--new-tokens 64]

`spec`: per prompt set (MT-Bench first turns and GSM8K test questions unguided; json-mode-eval schemas guided,
with draft masks on and off), per method and k: acceptance length per verification step INCLUDING the bonus
token (the TensorRT-LLM blog's convention) and tokens/s against the engine without speculation, whose greedy
outputs every speculative run must equal (lossless). None of these prompts is in the heads' training data
(zoo/selfdistill.py holds them aside). Writes bench/results/real_spec_cpu.{json,md}.

`decode`: engine tokens/s at each batch, eager and with compiled layers, fp32 and bf16, against transformers'
generate on the same weights, and the weight bytes the engine reads per second at batch 1 (the model's weights
once per step: the CPU's read bandwidth bounds batch-1 decode). Writes bench/results/real_decode_cpu.{json,md}.

Configurations of one comparison run in turn, `--repeats` rounds; each keeps its fastest round (the shared
CPU's least disturbed one).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from bench.common import device_name, shared_data, write_results


def prompt_sets(tokenizer, n: int, data: Path | None = None) -> dict[str, list[tuple[list[int], dict | None]]]:
    """name -> [(prompt ids, schema or None)], the first n of each set (deterministic)."""
    from zoo.selfdistill import chat_ids, schema_prompt

    data = data or shared_data()

    def user(text: str) -> list[int]:
        return chat_ids(tokenizer, [{"role": "user", "content": text}])

    def jsonl(path):
        return [json.loads(line) for line in (data / path).read_text().splitlines() if line.strip()]

    mt = [user(row["turns"][0]) for row in jsonl("prompts/mt-bench/question.jsonl")[:n]]
    gsm = [user(row["question"]) for row in jsonl("prompts/gsm8k/test.jsonl")[:n]]
    items = sorted((data / "json-mode-eval/items").glob("*.json"), key=lambda p: int(p.stem.split("_")[1]))[:n]
    schemas = [json.loads(p.read_text())["schema"] for p in items]
    json_prompts = [(chat_ids(tokenizer, schema_prompt(s)), s) for s in schemas]
    return {"mt-bench": [(p, None) for p in mt], "gsm8k": [(p, None) for p in gsm], "json-mode-eval": json_prompts}


def run_engine(llm, prompts, max_tokens: int) -> dict:
    from engine import SamplingParams, StructuredOutput

    params = [SamplingParams(max_tokens=max_tokens, temperature=0,
                             structured_output=StructuredOutput(json_schema=s) if s is not None else None)
              for _, s in prompts]
    engine = llm.engine
    engine.spec_stats.reset()
    start = time.perf_counter()
    outs = llm.generate([p for p, _ in prompts], params)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    stats = engine.stats().get("spec") or {}
    return {"tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds,
            "accepted": stats.get("mean_accepted_length"), "outputs": [list(o.token_ids) for o in outs]}


def spec(args) -> None:
    from engine import LLM, SpecConfig
    from zoo.models import resolve

    paths = resolve("smollm2-135m-instruct")
    target = str(paths.target)
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    sets = prompt_sets(AutoTokenizer.from_pretrained(target), args.prompts)
    rows: list[dict] = []
    results = {"model": "smollm2-135m-instruct", "device": device_name(args.device), "on": args.device,
               "dtype": args.dtype, "threads": args.threads,
               "max_tokens": args.max_tokens, "prompts": args.prompts, "runs": rows}
    for batch in args.batches:
        configs = [("none", 0, True, None)]
        for method in args.methods:
            if method != "ngram" and method not in paths.heads:
                print(f"skipping {method}: no prebuilt head")
                continue
            draft = str(paths.heads[method]) if method in paths.heads else None
            for k in args.ks:
                configs.append((method, k, True, SpecConfig(method=method, k=k, draft=draft, draft_masks=True)))
                if method != "ngram":
                    configs.append((method, k, False, SpecConfig(method=method, k=k, draft=draft, draft_masks=False)))
        engines = {c[:3]: LLM(target, device=args.device, dtype=args.dtype, max_num_seqs=batch,
                              num_kv_blocks=max(512, batch * 64), speculative=c[3])
                   for c in configs}
        for name, prompts in sets.items():
            prompts = prompts[: max(args.prompts, batch)]
            best: dict = {}
            for _ in range(args.repeats):
                for key, llm in engines.items():
                    if not key[2] and name != "json-mode-eval":
                        continue  # draft masks only change guided requests
                    run = run_engine(llm, prompts, args.max_tokens)
                    if key not in best or run["tok_s"] > best[key]["tok_s"]:
                        best[key] = run
            base = best[("none", 0, True)]
            for (method, k, masks), run in best.items():
                row = {"prompts": name, "batch": batch, "method": method, "k": k, "draft_masks": masks,
                       "tok_s": round(run["tok_s"], 1), "speedup": round(run["tok_s"] / base["tok_s"], 3),
                       "accepted_incl_bonus": run["accepted"], "lossless": run["outputs"] == base["outputs"],
                       "tokens": run["tokens"]}
                rows.append(row)
                print(json.dumps(row), flush=True)
    table = ["| prompts | batch | method | k | draft masks | accepted/step (incl. bonus) | tok/s | vs none | lossless |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        acc = f"{r['accepted_incl_bonus']:.2f}" if r["accepted_incl_bonus"] else "-"
        table.append(f"| {r['prompts']} | {r['batch']} | {r['method']} | {r['k']} | {'on' if r['draft_masks'] else 'off'} "
                     f"| {acc} | {r['tok_s']} | {r['speedup']:.2f}x | {r['lossless']} |")
    print(write_results(args.name or f"real_spec_{args.device}", results, "\n".join(table)))


def decode(args) -> None:
    from transformers import AutoModelForCausalLM

    from engine import LLM, SamplingParams
    from zoo.models import resolve

    target = str(resolve("smollm2-135m-instruct").target)
    torch.set_num_threads(args.threads)
    prompt = list(range(1000, 1000 + args.prompt_len))
    rows = []
    for batch in args.batches:
        systems = {}
        for dtype in ("float32", "bfloat16"):
            # On a GPU the step is a captured CUDA graph; CPU compilation modes do not apply there.
            for compile_mode in (("off", "layers") if args.device == "cpu" else ("graphs",)):
                kw = {"cpu_compile": compile_mode} if args.device == "cpu" else {}
                systems[f"tandem {dtype} {compile_mode}"] = LLM(target, device=args.device, dtype=dtype,
                                                                max_num_seqs=batch, num_kv_blocks=batch * 16 + 64,
                                                                **kw)
        hf_dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
        hf_name = f"transformers {str(hf_dtype).removeprefix('torch.')}"
        hf = AutoModelForCausalLM.from_pretrained(target, dtype=hf_dtype).eval().to(args.device)
        params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
        best: dict = {}
        for llm in systems.values():
            llm.generate([prompt] * batch, SamplingParams(max_tokens=4, temperature=0))  # warm-up and compiles
        for _ in range(args.repeats):
            for name, llm in systems.items():
                start = time.perf_counter()
                llm.generate([prompt] * batch, params)
                best[name] = max(best.get(name, 0.0), batch * args.new_tokens / (time.perf_counter() - start))
            with torch.inference_mode():
                ids = torch.tensor([prompt] * batch, device=args.device)
                start = time.perf_counter()
                out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens,
                                  min_new_tokens=args.new_tokens, do_sample=False)
                out.cpu()  # waits for the GPU
                best[hf_name] = max(best.get(hf_name, 0.0), batch * args.new_tokens / (time.perf_counter() - start))
        weight_bytes = {dt: sum(p.numel() for n, p in hf.named_parameters() if "embed" not in n) * size
                        for dt, size in (("float32", 4), ("bfloat16", 2))}
        for name, tok_s in best.items():
            dtype = name.split()[1]
            row = {"batch": batch, "system": name, "tok_s": round(tok_s, 1),
                   "vs_transformers": round(tok_s / best[hf_name], 2)}
            if batch == 1:
                row["weights_gb_s"] = round(tok_s * weight_bytes[dtype] / 1e9, 1)
            rows.append(row)
            print(json.dumps(row), flush=True)
        del systems, hf
    table = ["| batch | system | tok/s | vs transformers | weights GB/s (batch 1) |", "|---|---|---|---|---|"]
    table += [f"| {r['batch']} | {r['system']} | {r['tok_s']} | {r['vs_transformers']}x | {r.get('weights_gb_s', '-')} |"
              for r in rows]
    results = {"model": "smollm2-135m-instruct", "device": device_name(args.device), "on": args.device,
               "threads": args.threads, "new_tokens": args.new_tokens, "runs": rows}
    print(write_results(args.name or f"real_decode_{args.device}", results, "\n".join(table)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.real_model", description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["spec", "decode"])
    ap.add_argument("--batches", default=None, help="comma-separated (spec: 1,16; decode: 1,16,64)")
    ap.add_argument("--ks", default="3")
    ap.add_argument("--methods", default="mtp,eagle3,ngram")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--name", default=None, help="results file name under bench/results/ (default real_<what>_<device>)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (the engine with its CUDA graphs, transformers in bf16)")
    ap.add_argument("--dtype", default=None, help="spec: the engine's dtype (default: the checkpoint's; bfloat16 on cuda)")
    args = ap.parse_args(argv)
    if args.dtype is None and args.device != "cpu":
        args.dtype = "bfloat16"
    args.batches = [int(b) for b in (args.batches or ("1,16" if args.what == "spec" else "1,16,64")).split(",")]
    args.ks = [int(k) for k in args.ks.split(",")]
    args.methods = args.methods.split(",")
    (spec if args.what == "spec" else decode)(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
