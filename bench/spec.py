"""Speculative decoding on the zoo's target: tokens/s and mean accepted length per method and k.

Baselines measured in the same run: our engine without speculation, and transformers' `generate`
(plain greedy, assisted decoding with the zoo's standalone draft, prompt lookup). Prompts: held-out
JSON-schema prompts (schemas the zoo never trained on, in its prompt template) and HumanEval
prompts. Greedy decoding to the model's end token or `--max-tokens`; every speculative run's tokens
are compared with the run without speculation (lossless). Writes bench/results/spec_cpu.{json,md,png}
(spec_cuda.* with --device cuda: the engine with its CUDA graphs, the GPU's name in the results).

    python -m bench.spec [--zoo DIR] [--batches 1,4,16] [--ks 1,2,3,4,5] [--threads 1] [--quick] [--device cuda]

"Batch B" = B requests in flight (max_num_seqs = B, continuous batching) over 2B prompts (at least
--prompts); per-request tokens/s = a request's output tokens over its time from first scheduling to
finish. transformers' assisted decoding and prompt lookup run one prompt at a time (batch 1 only).
Each configuration runs --repeats times and keeps its fastest run (the CPU is shared: the best run is
the one least disturbed by other jobs); our engine's configurations take turns, round by round.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from bench.common import device_name, shared_data, write_results

METHODS = ("mtp", "eagle3", "ngram", "draft_model")
DRAFT_DIR = {"mtp": "mtp", "eagle3": "eagle3", "draft_model": "draft", "ngram": None}


def load_prompts(n: int) -> dict[str, list[str]]:
    from zoo.corpus import heldout_cases
    from zoo.prompts import BOS, json_schema_prompt

    humaneval = shared_data() / "prompts" / "humaneval" / "HumanEval.jsonl"
    code = [BOS + json.loads(line)["prompt"] for line in humaneval.read_text().splitlines()[:n]]
    return {"json": [json_schema_prompt(row["schema"]) for row in heldout_cases()[:n]], "humaneval": code}


def run_engine(target: str, spec, prompts: list[str], batch: int, max_tokens: int, device: str = "cpu") -> dict:
    from engine import LLM, SamplingParams

    llm = LLM(target, device=device, max_num_seqs=batch, num_kv_blocks=max(256, batch * 96), block_size=16,
              speculative=spec)
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    llm.generate(prompts[:batch], SamplingParams(max_tokens=8, temperature=0))  # warm-up
    llm.engine.spec_stats.reset()
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    per_request = [len(o.token_ids) / (o.metrics.finished_time - o.metrics.first_scheduled_time) for o in outs]
    stats = llm.engine.stats().get("spec") or {}
    return {"tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds,
            "per_request_tok_s": statistics.mean(per_request),
            "mean_accepted_length": stats.get("mean_accepted_length"),
            "accepted_length_hist": stats.get("accepted_length_hist"),
            "outputs": [o.token_ids for o in outs]}


def _new_tokens(row: torch.Tensor, width: int, eos: int) -> list[int]:
    new = row[width:].tolist()
    return new[: new.index(eos) + 1] if eos in new else new


@torch.inference_mode()
def run_hf(model, tokenizer, prompts: list[str], batch: int, max_tokens: int, eos: int, **generate_kw) -> dict:
    """transformers' generate over `prompts`, `batch` at a time (left-padded)."""
    tokens, per_request, outputs = 0, [], []
    kw = dict(max_new_tokens=max_tokens, do_sample=False, eos_token_id=eos, pad_token_id=0, **generate_kw)
    first = tokenizer(prompts[:1], return_tensors="pt").to(model.device)
    model.generate(**first, **{**kw, "max_new_tokens": 8})  # warm-up
    start = time.perf_counter()
    for i in range(0, len(prompts), batch):
        chunk = prompts[i : i + batch]
        enc = tokenizer(chunk, return_tensors="pt", padding=True).to(model.device)
        t0 = time.perf_counter()
        out = model.generate(**enc, **kw)
        if out.is_cuda:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        for row in out:
            new = _new_tokens(row, enc["input_ids"].shape[1], eos)
            outputs.append(new)
            tokens += len(new)
            per_request.append(len(new) / dt)
    seconds = time.perf_counter() - start
    return {"tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds,
            "per_request_tok_s": statistics.mean(per_request), "outputs": outputs}


def best_of(repeats: int, fn, *a, **kw) -> dict:
    runs = [fn(*a, **kw) for _ in range(repeats)]
    return max(runs, key=lambda r: r["tok_s"])


def bench(args) -> dict:
    import zoo
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine import SpecConfig

    root = Path(args.zoo) if args.zoo else zoo.built_path()
    if root is None:
        print("building the zoo (tiny) first: a few minutes")
        root = zoo.build()
    paths = zoo.layout(root)
    target = str(paths.target)
    tokenizer = AutoTokenizer.from_pretrained(target, padding_side="left")
    hf = AutoModelForCausalLM.from_pretrained(target).eval().to(args.device)
    hf_draft = AutoModelForCausalLM.from_pretrained(str(paths.draft)).eval().to(args.device)
    eos = tokenizer.eos_token_id
    prompt_sets = load_prompts(max(args.prompts, 2 * max(args.batches)))
    results: dict = {"zoo": str(root), "device": device_name(args.device), "on": args.device,
                     "threads": torch.get_num_threads(),
                     "max_tokens": args.max_tokens, "repeats": args.repeats, "runs": []}

    def record(**row):
        results["runs"].append(row)
        acc = row.get("mean_accepted_length")
        print(f"{row['dataset']:>9} B={row['batch']:<3} {row['system']:<13} {row['method']:<12} k={row['k']} "
              f"{row['tok_s']:8.1f} tok/s  {row['per_request_tok_s']:7.1f} tok/s/req"
              + (f"  accepted {acc:.2f}" if acc else "") + ("" if row.get("lossless", True) else "  NOT LOSSLESS"),
              flush=True)

    for dataset, all_prompts in prompt_sets.items():
        for batch in args.batches:
            prompts = all_prompts[: max(args.prompts, 2 * batch)]
            # Our engine's configurations run in turn, --repeats rounds, so that a burst of load on the
            # shared CPU hits all of them alike; each keeps its fastest run.
            specs = [("none", 0, None)] + [
                (method, k, SpecConfig(method=method, k=k, draft=str(root / DRAFT_DIR[method]) if DRAFT_DIR[method] else None))
                for method in args.methods for k in args.ks]
            best: dict[tuple[str, int], dict] = {}
            for _ in range(args.repeats):
                for method, k, spec in specs:
                    r = run_engine(target, spec, prompts, batch, args.max_tokens, args.device)
                    if (method, k) not in best or r["tok_s"] > best[method, k]["tok_s"]:
                        best[method, k] = r
            base = best["none", 0]
            results.setdefault("sample_outputs", {}).setdefault(dataset, tokenizer.decode(base["outputs"][0]))
            for (method, k), r in best.items():
                extra = {"lossless": r["outputs"] == base["outputs"]} if method != "none" else {}
                record(dataset=dataset, batch=batch, system="tandem", method=method, k=k, **extra,
                       **{x: v for x, v in r.items() if x != "outputs"})
            hf_runs = [("greedy", 0, {})] if args.transformers else []
            if batch == 1 and args.transformers:
                hf_runs += [("assisted", 0, {"assistant_model": hf_draft})]
                hf_runs += [("prompt_lookup", k, {"prompt_lookup_num_tokens": k}) for k in args.ks if k == 3]
            for method, k, kw in hf_runs:
                r = best_of(args.repeats, run_hf, hf, tokenizer, prompts, batch, args.max_tokens, eos, **kw)
                record(dataset=dataset, batch=batch, system="transformers", method=method, k=k,
                       same_tokens_as_tandem=r["outputs"] == base["outputs"],
                       **{x: v for x, v in r.items() if x != "outputs"})
    return results


def _find(runs, **match) -> dict | None:
    return next((r for r in runs if all(r.get(k) == v for k, v in match.items())), None)


def summarize(results: dict) -> str:
    runs = results["runs"]
    lines = [f"# Speculative decoding on {results.get('on', 'cpu').upper()} ({results['device']})", "",
             f"Zoo: `{results['zoo']}`; greedy, up to {results['max_tokens']} new tokens, end token stops; "
             f"best of {results['repeats']} runs per row; our engine's configurations take turns round by round. "
             f"The CPU is shared with other jobs: absolute numbers are noisy (load average "
             f"{results['load_before'][0]:.2f} before, {results['load_after'][0]:.2f} after).", ""]
    for dataset, text in (results.get("sample_outputs") or {}).items():
        lines += [f"The zoo target's greedy output for the first {dataset} prompt (a small model: it repeats "
                  f"itself, which makes drafting easy): `{text[:120]!r}`", ""]
    for dataset in dict.fromkeys(r["dataset"] for r in runs):
        lines += [f"## {dataset}", "",
                  "| batch | system | method | k | tok/s | tok/s/req | mean accepted | vs no-spec | vs HF greedy | lossless |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in (r for r in runs if r["dataset"] == dataset):
            base = _find(runs, dataset=dataset, batch=r["batch"], system="tandem", method="none")
            hfg = _find(runs, dataset=dataset, batch=r["batch"], system="transformers", method="greedy")
            acc = r.get("mean_accepted_length")
            lossless = r.get("lossless", r.get("same_tokens_as_tandem"))
            vs_hf = f"{r['tok_s'] / hfg['tok_s']:.2f}x" if hfg else ""
            lines.append(f"| {r['batch']} | {r['system']} | {r['method']} | {r['k'] or ''} | {r['tok_s']:.1f} | "
                         f"{r['per_request_tok_s']:.1f} | {'' if acc is None else f'{acc:.2f}'} | "
                         f"{r['tok_s'] / base['tok_s']:.2f}x | {vs_hf} | "
                         f"{'' if lossless is None else ('yes' if lossless else 'NO')} |")
        lines.append("")
    lines += ["## Targets", ""] + [f"- {t}" for t in targets(results)]
    return "\n".join(lines)


def targets(results: dict) -> list[str]:
    """The issue's targets, checked against this run."""
    runs, out = results["runs"], []
    for method in ("mtp", "eagle3"):
        r = _find(runs, dataset="json", batch=1, method=method, k=3)
        if r:
            out.append(f"json, batch 1, {method} k=3: mean accepted length {r['mean_accepted_length']:.2f} "
                       f"(target >= 2.5: {'met' if r['mean_accepted_length'] >= 2.5 else 'NOT met'})")
    for dataset in dict.fromkeys(r["dataset"] for r in runs):
        base = _find(runs, dataset=dataset, batch=1, system="tandem", method="none")
        assisted = _find(runs, dataset=dataset, batch=1, system="transformers", method="assisted")
        best = max((r for r in runs if r["dataset"] == dataset and r["batch"] == 1 and r["method"] in ("mtp", "eagle3")),
                   key=lambda r: r["tok_s"], default=None)
        if base and best:
            ok = best["tok_s"] >= 1.5 * base["tok_s"]
            out.append(f"{dataset}, batch 1: best one-model run ({best['method']} k={best['k']}) "
                       f"{best['tok_s'] / base['tok_s']:.2f}x our no-speculation (target >= 1.5x: "
                       f"{'met' if ok else 'NOT met'})")
        # issue 14: item 4 on CPU (MTP k=3 >= 1.8x at batch 1, >= 1.0x at 64); on a GPU, one-model MTP and
        # EAGLE-3 k=3 >= 2x no-speculation at batch 1
        on_gpu = results.get("on", "cpu") != "cpu"
        goals = [("mtp", 1, 2.0), ("eagle3", 1, 2.0)] if on_gpu else [("mtp", 1, 1.8), ("mtp", 64, 1.0)]
        for method, batch, goal in goals:
            spec = _find(runs, dataset=dataset, batch=batch, system="tandem", method=method, k=3)
            none = _find(runs, dataset=dataset, batch=batch, system="tandem", method="none")
            if spec and none:
                ratio = spec["tok_s"] / none["tok_s"]
                out.append(f"{dataset}, batch {batch}: {method} k=3 {ratio:.2f}x our no-speculation (goal >= {goal}x: "
                           f"{'met' if ratio >= goal else 'NOT met'})")
        if assisted and best:
            out.append(f"{dataset}, batch 1: {best['tok_s'] / assisted['tok_s']:.2f}x transformers' assisted decoding "
                       f"(target > 1x: {'met' if best['tok_s'] > assisted['tok_s'] else 'NOT met'})")
    return out


def plot(results: dict, path: Path, k: int = 3) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = results["runs"]
    datasets = list(dict.fromkeys(r["dataset"] for r in runs))
    fig, axes = plt.subplots(1, len(datasets), figsize=(6 * len(datasets), 4.5), squeeze=False)
    for ax, dataset in zip(axes[0], datasets):
        curves = [("tandem", "none", 0)] + [("tandem", m, k) for m in METHODS] + [("transformers", "greedy", 0)]
        for system, method, kk in curves:
            pts = sorted((r["batch"], r["tok_s"], r["per_request_tok_s"]) for r in runs
                         if r["dataset"] == dataset and r["system"] == system and r["method"] == method and r["k"] == kk)
            if pts:
                label = f"{system} {method}" + (f" k={kk}" if kk else "")
                ax.plot([p[1] for p in pts], [p[2] for p in pts], marker="o", label=label)
                for b, x, y in pts:
                    ax.annotate(f"B={b}", (x, y), fontsize=7, textcoords="offset points", xytext=(3, 3))
        ax.set_xlabel("total tokens/s")
        ax.set_ylabel("tokens/s per request")
        ax.set_title(f"{dataset} prompts (zoo target, {results.get('on', 'cpu').upper()})")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--zoo", default=None, help="a built zoo directory (default: the cached default zoo)")
    p.add_argument("--batches", default="1,4,16")
    p.add_argument("--ks", default="1,2,3,4,5")
    p.add_argument("--prompts", type=int, default=8, help="prompts per dataset at batch 1 (2B at batch B)")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: a shared 2-core CPU)")
    p.add_argument("--repeats", type=int, default=2, help="runs per configuration; the fastest is kept")
    p.add_argument("--name", default=None, help="results file name under bench/results/ (default spec_<device>)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (our engine and the transformers baselines)")
    p.add_argument("--quick", action="store_true", help="batch 1 and k=3 only")
    p.add_argument("--methods", default=",".join(METHODS), help="speculative methods to run")
    p.add_argument("--no-transformers", dest="transformers", action="store_false",
                   help="skip the transformers baselines")
    args = p.parse_args(argv)
    args.batches = [1] if args.quick else [int(b) for b in args.batches.split(",")]
    args.ks = [3] if args.quick else [int(k) for k in args.ks.split(",")]
    args.methods = [m for m in args.methods.split(",") if m]
    args.name = args.name or f"spec_{args.device}"
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    results = bench(args)
    results.update(load_before=load_before, load_after=os.getloadavg())
    table = summarize(results)
    md = write_results(args.name, results, table)
    plot(results, md.with_suffix(".png"))
    print(table)
    print(f"wrote {md} and {md.with_suffix('.png')}")


if __name__ == "__main__":
    main()
