"""Benchmarks on the real default model, SmolLM2-135M-Instruct (zoo/models.py), each a ratio in one run.

    python -m bench.real_model spec   [--batches 1,16] [--ks 3] [--methods mtp,eagle3,ngram] [--prompts 8]
    python -m bench.real_model decode [--batches 1,16,64] [--new-tokens 64]

`spec`: per prompt set (MT-Bench first turns and GSM8K test questions unguided; json-mode-eval schemas guided,
with draft masks on and off), per method and k: acceptance length per verification step INCLUDING the bonus
token (the TensorRT-LLM blog's convention) and tokens/s against the engine without speculation, whose greedy
outputs every speculative run must equal (lossless). None of these prompts is in the heads' training data
(zoo/selfdistill.py holds them aside). Writes bench/results/real_spec_cpu.{json,md}.

`decode`: engine tokens/s at each batch, eager and with compiled layers, fp32 and bf16, against transformers'
generate on the same weights, against llama.cpp at batch 1 on the same weights at the same precision where
llama-cpp-python is installed (bench/llama_cpp.py), and the weight bytes the engine reads per second at batch 1
(the model's weights once per step: the CPU's read bandwidth bounds batch-1 decode). Writes
bench/results/real_decode_cpu.{json,md}.

Configurations of one comparison run in turn, `--repeats` rounds; each keeps its fastest round (the shared
CPU's least disturbed one).
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import time
from pathlib import Path

import torch

from bench.common import device_name, shared_data, write_results
from kernels import cpu_ext


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
            "accepted": stats.get("mean_accepted_length"), "outputs": [list(o.token_ids) for o in outs],
            "k_steps": stats.get("dynamic_k_steps")}


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
               "dtype": args.dtype, "weight_dtype": args.weight_dtype, "cpu_compile": args.cpu_compile,
               "threads": args.threads,
               "max_tokens": args.max_tokens, "prompts": args.prompts, "runs": rows}
    head_sets = _head_sets(args.heads, paths)
    for batch in args.batches:
        configs = [("none", 0, True, "none", False, "-", None)]
        for method in args.methods:
            for label, heads, maps_of in head_sets if method != "ngram" else [("-", {}, {})]:
                if method != "ngram" and method not in heads:
                    print(f"skipping {method}: no {label} head")
                    continue
                draft = str(heads[method]) if method in heads else None
                maps = args.token_maps if method == "mtp" else ["none"]
                for k in args.ks:
                    for tmap in maps:
                        path = None if tmap == "none" else str(_token_map_path(tmap, maps_of, method))
                        configs.append((method, k, True, tmap, False, label, SpecConfig(
                            method=method, k=k, draft=draft, draft_masks=True, token_map=path)))
                        if method != "ngram" and "off" in args.masks:
                            configs.append((method, k, False, tmap, False, label, SpecConfig(
                                method=method, k=k, draft=draft, draft_masks=False, token_map=path)))
                for prior in args.adaptive:  # k chosen each step in [0, max k] from acceptance and measured step cost
                    k, tmap = max(args.ks), maps[0]
                    path = None if tmap == "none" else str(_token_map_path(tmap, maps_of, method))
                    configs.append((method, k, True, tmap, prior, label, SpecConfig(
                        method=method, k=k, draft=draft, draft_masks=True, token_map=path, adaptive_k=True,
                        cost_probe=prior == "probe")))
        kw = {"cpu_compile": args.cpu_compile, "weight_dtype": args.weight_dtype} if args.device == "cpu" else {}
        engines = llm = None  # the previous batch's engines go before this batch's come (each holds weights and KV)
        gc.collect()
        engines = {c[:6]: LLM(target, device=args.device, dtype=args.dtype, max_num_seqs=batch,
                              num_kv_blocks=max(512, batch * 64), speculative=c[6], **kw)
                   for c in configs}
        for name, prompts in sets.items():
            if name not in args.sets:
                continue
            prompts = prompts[: max(args.prompts, batch)]
            best: dict = {}
            for _ in range(args.repeats):
                for key, llm in engines.items():
                    if not key[2] and name != "json-mode-eval":
                        continue  # draft masks only change guided requests
                    run = run_engine(llm, prompts, args.max_tokens)
                    if key not in best or run["tok_s"] > best[key]["tok_s"]:
                        best[key] = run
            base = best[("none", 0, True, "none", False, "-")]
            for (method, k, masks, tmap, adaptive, heads), run in best.items():
                shown = f"adaptive <= {k}" + (" (line prior)" if adaptive == "line" else "") if adaptive else k
                row = {"prompts": name, "batch": batch, "method": method, "heads": heads, "k": shown,
                       "draft_masks": masks, "token_map": tmap, "k_steps": run["k_steps"] if adaptive else None,
                       "tok_s": round(run["tok_s"], 1), "speedup": round(run["tok_s"] / base["tok_s"], 3),
                       "accepted_incl_bonus": run["accepted"], "lossless": run["outputs"] == base["outputs"],
                       "tokens": run["tokens"]}
                rows.append(row)
                print(json.dumps(row), flush=True)
    table = ["| prompts | batch | method | heads | k | draft masks | token map | accepted/step (incl. bonus) | tok/s "
             "| vs none | lossless |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        acc = f"{r['accepted_incl_bonus']:.2f}" if r["accepted_incl_bonus"] else "-"
        k = f"{r['k']} (steps at k=0..: {','.join(map(str, r['k_steps']))})" if r.get("k_steps") else r["k"]
        table.append(f"| {r['prompts']} | {r['batch']} | {r['method']} | {r['heads']} | {k} | {'on' if r['draft_masks'] else 'off'} "
                     f"| {r['token_map']} | {acc} | {r['tok_s']} | {r['speedup']:.2f}x | {r['lossless']} |")
    print(write_results(args.name or f"real_spec_{args.device}", results, "\n".join(table)))


def _token_map_path(tmap: str, maps: dict, method: str) -> Path:
    """--token-maps entry -> file: "shipped" is the head's own map (`maps`: kind -> its token_map.json), else a path."""
    if tmap == "shipped":
        if method not in maps:
            raise SystemExit(f"--token-maps shipped: the {method} head ships no token map")
        return maps[method]
    return Path(tmap)


def _head_sets(spec: str, paths) -> list[tuple[str, dict, dict]]:
    """--heads -> [(label, kind -> head dir, kind -> token map)]: "shipped" is the model's prebuilt heads,
    LABEL=DIR a directory holding mtp/ and eagle3/ as zoo/prebuilt does (e.g. heads being trained, or an older
    export), so head sets compare in one run on the same prompts and engines."""
    out = []
    for item in filter(None, (x.strip() for x in spec.split(","))):
        if item == "shipped":
            out.append(("shipped", dict(paths.heads), dict(paths.token_maps)))
            continue
        label, sep, folder = item.partition("=")
        if not sep:
            raise SystemExit(f"--heads {item!r}: expected shipped or LABEL=DIR")
        root = Path(folder)
        heads = {k: root / k for k in ("mtp", "eagle3") if (root / k / "config.json").is_file()}
        if not heads:
            raise SystemExit(f"--heads {item!r}: {root} holds no mtp/ or eagle3/ head")
        out.append((label, heads, {k: d / "token_map.json" for k, d in heads.items() if (d / "token_map.json").is_file()}))
    return out


def decode(args) -> None:
    from transformers import AutoModelForCausalLM

    from engine import LLM, SamplingParams
    from zoo.models import resolve

    target = str(resolve("smollm2-135m-instruct").target)
    torch.set_num_threads(args.threads)
    calls = iter(range(10**6))

    def fresh_prompt() -> list[int]:
        """A prompt no engine has cached (prefix caching would skip the prefill of a repeated one)."""
        base = 1000 + 97 * next(calls) % 20000
        return list(range(base, base + args.prompt_len))

    rows = []
    for batch in args.batches:
        systems = {}
        for dtype in args.dtypes:
            # On a GPU the step is a captured CUDA graph; CPU compilation modes do not apply there.
            for compile_mode in (args.compile_modes if args.device == "cpu" else ("graphs",)):
                # full-graph: "full" with the whole forward an inductor graph, not the C++ decoder stack (A/B)
                kw = {"cpu_compile": compile_mode.removesuffix("-graph")} if args.device == "cpu" else {}
                if dtype == "bf16w":  # bf16 weights, fp32 arithmetic (engine/layers/weight_dtype.py)
                    kw["weight_dtype"] = "bfloat16"
                os.environ["TANDEM_NATIVE_STACK"] = "0" if compile_mode == "full-graph" else "1"
                systems[f"tandem {dtype} {compile_mode}"] = LLM(target, device=args.device,
                                                                dtype="float32" if dtype == "bf16w" else dtype,
                                                                max_num_seqs=batch, num_kv_blocks=batch * 16 + 64,
                                                                **kw)
                os.environ.pop("TANDEM_NATIVE_STACK")
        hf_dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
        hf_name = f"transformers {str(hf_dtype).removeprefix('torch.')}"
        hf = AutoModelForCausalLM.from_pretrained(target, dtype=hf_dtype).eval().to(args.device)

        def tandem(llm, attention="kernel"):
            def run(prompt, n):
                # "reference": the torch reference attention in place of the C++ CPU kernel (kernels/cpu_ext.py)
                with cpu_ext.turned_off() if attention == "reference" else contextlib.nullcontext():
                    outs = llm.generate([prompt] * batch, SamplingParams(max_tokens=n, temperature=0,
                                                                         ignore_eos=True))
                return list(outs[0].token_ids)
            return run

        @torch.inference_mode()
        def transformers_run(prompt, n):
            ids = torch.tensor([prompt] * batch, device=args.device)
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                              do_sample=False)
            return out[0, len(prompt):].tolist()  # .tolist() waits for the GPU

        runs = {}
        for name, llm in systems.items():
            for attention in (args.cpu_attention if args.device == "cpu" else ("kernel",)):
                if attention == "reference" and name.endswith(" full"):
                    continue  # the full graphs hold the C++ attention itself (engine/models/piecewise.py)
                runs[name + ("" if attention == "kernel" else " ref-attention")] = tandem(llm, attention)
        for name, model in (llama_cpp_systems(args) if batch == 1 else {}).items():
            runs[name] = lambda prompt, n, model=model: model.generate(prompt, n)[0]
        runs[hf_name] = transformers_run
        for run in runs.values():
            run(fresh_prompt(), 4)  # warm-up and compiles
        # Each round: a prefill-only call (1 token) and a whole call (prefill + new_tokens), on fresh prompts of
        # equal length; decode tok/s = the tokens after the first over the whole call's time less the prefill's.
        e2e: dict[str, float] = {}
        best: dict[str, float] = {}
        outputs: dict[str, list[int]] = {}
        for _ in range(args.repeats):
            for name, run in runs.items():
                start = time.perf_counter()
                run(fresh_prompt(), 1)
                prefill = time.perf_counter() - start
                prompt = fresh_prompt()
                start = time.perf_counter()
                outputs[name] = run(prompt, args.new_tokens)
                whole = time.perf_counter() - start
                e2e[name] = max(e2e.get(name, 0.0), batch * args.new_tokens / whole)
                best[name] = max(best.get(name, 0.0), batch * (args.new_tokens - 1) / max(whole - prefill, 1e-9))
        same = {}  # llama.cpp system -> tokens equal to Tandem fp32's before the first difference (one prompt)
        if "tandem float32 off" in runs:
            ref_prompt = fresh_prompt()
            ref = runs["tandem float32 off"](ref_prompt, args.new_tokens)
            for name in runs:
                if name.startswith("llama.cpp"):
                    got = runs[name](ref_prompt, args.new_tokens)
                    same[name] = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), len(got))
        # Every parameter once: the embedding lookup reads one row, but the (tied) LM head reads all of it.
        weight_bytes = {dt: sum(p.numel() for p in hf.parameters()) * size
                        for dt, size in (("float32", 4), ("bfloat16", 2))}
        for name, tok_s in best.items():
            dtype = _DTYPES.get(name.split()[1], name.split()[1])
            row = {"batch": batch, "system": name, "tok_s": round(tok_s, 1), "with_prefill_tok_s": round(e2e[name], 1),
                   "vs_transformers": round(tok_s / best[hf_name], 2)}
            cpp_name = f"llama.cpp {_CPP[dtype]}"
            if cpp_name in best and not name.startswith("llama.cpp"):
                row["vs_llama_cpp"] = round(tok_s / best[cpp_name], 2)
            if name in same:
                row["same_tokens_as_tandem"] = same[name]
            if batch == 1:
                row["weights_gb_s"] = round(tok_s * weight_bytes[dtype] / 1e9, 1)
            rows.append(row)
            print(json.dumps(row), flush=True)
        del systems, hf
    table = ["| batch | system | decode tok/s | with prefill | vs transformers | vs llama.cpp (same precision) "
             "| weights GB/s (batch 1) |", "|---|---|---|---|---|---|---|"]
    table += [f"| {r['batch']} | {r['system']} | {r['tok_s']} | {r['with_prefill_tok_s']} | {r['vs_transformers']}x "
              f"| {str(r['vs_llama_cpp']) + 'x' if 'vs_llama_cpp' in r else '-'} | {r.get('weights_gb_s', '-')} |"
              for r in rows]
    if any("same_tokens_as_tandem" in r for r in rows):
        table.append("\nllama.cpp greedy tokens equal to Tandem fp32's before the first difference (of "
                     f"{args.new_tokens}): " + ", ".join(f"{r['system']} {r['same_tokens_as_tandem']}"
                                                      for r in rows if "same_tokens_as_tandem" in r))
    results = {"model": "smollm2-135m-instruct", "device": device_name(args.device), "on": args.device,
               "threads": args.threads, "new_tokens": args.new_tokens, "runs": rows}
    print(write_results(args.name or f"real_decode_{args.device}", results, "\n".join(table)))


_CPP = {"float32": "f32", "bfloat16": "bf16"}
# a system's name -> the dtype its weights are read in: bf16w is fp32 arithmetic on bf16 weights (llama.cpp's bf16)
_DTYPES = {**{v: k for k, v in _CPP.items()}, "bf16w": "bfloat16"}


def llama_cpp_systems(args) -> dict:
    """llama.cpp on the default model's weights dequantized to f32 and bf16 (bench/llama_cpp.py), batch 1 on the
    CPU, where the binding is installed (`pip install llama-cpp-python`; a benchmark-only dependency)."""
    from bench import llama_cpp
    from engine.models.gguf import cache_root, file_sha256
    from zoo.models import smollm2_gguf

    if args.device != "cpu" or not llama_cpp.available():
        print("llama.cpp: not measured (CPU only; pip install llama-cpp-python)")
        return {}
    src = smollm2_gguf()
    out = {}
    for precision in ("f32", "bf16"):
        # named by the source's content, as the engine's converted directory is (a new package version: new files)
        dense = cache_root() / "gguf" / f"{src.stem}-{file_sha256(src)[:16]}.{precision}.gguf"
        path = llama_cpp.write_dense_gguf(src, dense, precision)
        out[f"llama.cpp {precision}"] = llama_cpp.LlamaCpp(path, args.threads)
    return out


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
    ap.add_argument("--dtypes", default="float32,bfloat16", help="decode: the engine's dtypes (bf16w: fp32 "
                    "arithmetic on bf16 weights, EngineConfig.weight_dtype)")
    ap.add_argument("--compile-modes", default="off,layers,full", help="decode on cpu: the engine's cpu_compile modes "
                    "(full-graph: full with the forward an inductor graph instead of the C++ decoder stack)")
    ap.add_argument("--cpu-attention", default="kernel",
                    help="decode on cpu: kernel (the C++ CPU attention), reference (the torch one), or both: "
                         "kernel,reference")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--name", default=None, help="results file name under bench/results/ (default real_<what>_<device>)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (the engine with its CUDA graphs, transformers in bf16)")
    ap.add_argument("--weight-dtype", default=None, choices=["bfloat16"],
                    help="spec on cpu: bf16 weights under fp32 arithmetic (EngineConfig.weight_dtype)")
    ap.add_argument("--cpu-compile", default="off", help="spec on cpu: the engines' cpu_compile (off, gemm, layers, full)")
    ap.add_argument("--token-maps", default="none", help="spec: MTP token maps to compare, comma-separated: none (the "
                                                         "whole vocabulary), shipped (the head's own), or files")
    ap.add_argument("--heads", default="shipped", help="spec: head sets to compare, comma-separated: shipped (the "
                    "model's prebuilt heads) or LABEL=DIR (a folder holding mtp/ and eagle3/)")
    ap.add_argument("--masks", default="on,off", help="spec: also run heads without draft masks on guided prompts where this names off")
    ap.add_argument("--sets", default="mt-bench,gsm8k,json-mode-eval", help="spec: prompt sets")
    ap.add_argument("--adaptive", nargs="?", const="probe", default="",
                    help="spec: also run each method with adaptive k up to the largest of --ks (SpecConfig.adaptive_k); "
                         "its cost prior, comma-separated: probe (the start-up cost probe, default), line (1 + 0.2 k)")
    ap.add_argument("--dtype", default=None, help="spec: the engine's dtype (default: the checkpoint's; bfloat16 on cuda)")
    args = ap.parse_args(argv)
    if args.dtype is None and args.device != "cpu":
        args.dtype = "bfloat16"
    args.batches = [int(b) for b in (args.batches or ("1,16" if args.what == "spec" else "1,16,64")).split(",")]
    args.ks = [int(k) for k in args.ks.split(",")]
    args.methods = args.methods.split(",")
    args.masks, args.sets = args.masks.split(","), args.sets.split(",")
    args.adaptive = [p for p in args.adaptive.split(",") if p]
    if set(args.adaptive) - {"probe", "line"}:
        ap.error(f"--adaptive: probe or line, not {args.adaptive}")
    args.token_maps = args.token_maps.split(",")
    args.dtypes, args.compile_modes = args.dtypes.split(","), args.compile_modes.split(",")
    args.cpu_attention = args.cpu_attention.split(",")
    (spec if args.what == "spec" else decode)(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
