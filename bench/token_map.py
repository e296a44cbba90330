"""What a hot draft vocabulary (SpecConfig.token_map) saves where vocabularies are large.

A one-model head multiplies its hidden state by its LM head once per draft token. With Llama-3's
128,256-token vocabulary that matrix is most of an MTP head's bytes, which is why FR-Spec (and SGLang's
--speculative-token-map) draft from the most frequent ids only. The zoo's 4,096-token vocabulary hides
this (bench/results/spec_step_token_map_cpu.md), so this benchmark builds a random Llama with a
Llama-3-sized vocabulary and a random MTP head for it (zoo.heads.mtp), and times the engine's step parts
(bench/spec_step.py's StepTimer) without speculation, with MTP k=3, and with MTP k=3 drafting from a map
of the first --map-size ids, in the same process, alternating. Random weights: acceptance means
nothing here, only what a step costs does; outputs are checked equal (greedy) all the same.

    python -m bench.token_map [--vocab 128256] [--map-size 32768] [--batches 1,8] [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import torch

from bench.common import device_name, write_results
from bench.engine import prompts as random_prompts
from bench.spec_step import PARTS, add_rows, run_alternating


def make_checkpoints(root: Path, vocab: int) -> tuple[Path, Path]:
    """A random Llama target (tied embeddings, as Llama-3.2-1B) and a random MTP head beside it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.testing import save_tiny_tokenizer
    from zoo.heads.mtp import MTPHead

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         tie_word_embeddings=True, bos_token_id=0, eos_token_id=1)
    target = LlamaForCausalLM(config).eval()
    target.save_pretrained(root / "target")
    save_tiny_tokenizer(root / "target", 300, ["tokens for a tokenizer the engine never uses here"] * 4)
    MTPHead.from_target(target, torch.Generator().manual_seed(1)).save(root / "mtp")
    return root / "target", root / "mtp"


def bench(args) -> dict:
    from engine import LLM, SamplingParams, SpecConfig

    results = {"device": device_name("cpu"), "vocab": args.vocab, "map_size": args.map_size,
               "max_tokens": args.max_tokens, "repeats": args.repeats, "load_before": os.getloadavg(), "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        target, head = make_checkpoints(Path(tmp), args.vocab)
        token_map = Path(tmp) / "map.json"
        token_map.write_text(json.dumps(list(range(args.map_size))))
        mtp = SpecConfig(method="mtp", k=3, draft=str(head))
        modes = {"none": None, "mtp k=3": mtp,
                 f"mtp k=3 map {args.map_size}": SpecConfig(method="mtp", k=3, draft=str(head), token_map=str(token_map))}
        for batch in args.batches:
            batch_prompts = random_prompts(batch, 32, args.vocab)
            llms = {m: LLM(str(target), max_num_seqs=batch, num_kv_blocks=max(64, batch * 16), block_size=16,
                           speculative=s) for m, s in modes.items()}
            for llm in llms.values():
                llm.generate(batch_prompts, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))  # warm-up
            best = run_alternating(llms, batch_prompts, args.max_tokens, args.repeats,
                                   lambda r: -r["per_step_ms"]["step"])
            add_rows(results, batch, best, lambda mode: "none")
            del llms
    results["load_after"] = os.getloadavg()
    return results


def summarize(results: dict) -> str:
    v, n = results["vocab"], results["map_size"]
    lines = [f"# Hot draft vocabulary on a {v:,}-token vocabulary ({results['device']})", "",
             f"Random Llama (H 256, 4 layers, tied embeddings: the LM head is {v * 256 * 4 / 2**20:.0f} MiB of fp32) "
             f"with a random MTP head; greedy, {results['max_tokens']} new tokens, ignore_eos; modes alternate in "
             f"one process, the cheapest step of {results['repeats']} runs. Load average before "
             f"{results['load_before'][0]:.2f}, after {results['load_after'][0]:.2f}. The map: the first {n:,} ids "
             f"(a draft LM head of {n * 256 * 4 / 2**20:.0f} MiB).", "",
             "Per decode step, CPU ms of the engine's thread:", "",
             "| batch | mode | step ms | step vs none | " + " | ".join(PARTS) + " | same tokens |",
             "|---|---|---|---|" + "---|" * len(PARTS) + "---|"]
    runs = results["runs"]
    for r in runs:
        base = next(b for b in runs if b["batch"] == r["batch"] and b["mode"] == "none")
        ms = r["per_step_ms"]
        lines.append(f"| {r['batch']} | {r['mode']} | {ms['step']:.2f} | {ms['step'] / base['per_step_ms']['step']:.2f}x | "
                     + " | ".join(f"{ms[p]:.2f}" for p in PARTS) + f" | {'yes' if r['lossless'] else 'NO'} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=128256, help="target vocabulary (Llama-3's by default)")
    p.add_argument("--map-size", type=int, default=32768, help="ids in the hot vocabulary (FR-Spec's 32k)")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--name", default="token_map_cpu")
    args = p.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    torch.set_num_threads(args.threads)
    results = bench(args)
    table = summarize(results)
    print(table)
    print(f"wrote {write_results(args.name, results, table)}")


if __name__ == "__main__":
    main()
