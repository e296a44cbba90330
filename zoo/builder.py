"""Builds a zoo directory from a recipe: corpus -> tokenizer -> target -> heads and draft model.

Layout of a built zoo (all HF-loadable where HF has a class for it):
    tokenizer/  tokenizer.json, tokenizer_config.json (chat template), special_tokens_map.json
    target/     LlamaForCausalLM: config.json, model.safetensors, generation_config.json + tokenizer
    draft/      a shallow LlamaForCausalLM with the same tokenizer (two-model speculation)
    mtp/        DeepSeek-V3 MTP layer: config.json, model.safetensors (zoo.heads.mtp)
    eagle3/     EAGLE-3 head: config.json, model.safetensors (zoo.heads.eagle3)
    zoo.json    manifest: recipe, cache key, versions, losses, build time and peak memory
"""
from __future__ import annotations

import json
import resource
import time
from pathlib import Path

import torch
from tqdm import tqdm

from zoo.cache import code_version, software_versions
from zoo.distill import distill
from zoo.heads.eagle3 import Eagle3Head, default_aux_layer_ids, draft_vocab
from zoo.heads.mtp import MTPHead
from zoo.recipe import Recipe
from zoo.stages import DTYPES, prepare_data, save_hf_model, tail_mean, torch_threads, training_batches
from zoo.token_map import token_counts
from zoo.training import new_llama, train_lm

PARTS = ("tokenizer", "target", "draft", "mtp", "eagle3")


def build_zoo(recipe: Recipe, out_dir: Path) -> dict:
    """Build every part into `out_dir` (created); -> the manifest (also written to zoo.json)."""
    started = time.perf_counter()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if recipe.moe is not None:
        from zoo.moe import build_moe_zoo  # a DeepSeek-V3-shaped target and its own MTP layer

        return build_moe_zoo(recipe, out_dir)
    stages = tqdm(total=5, desc=f"zoo[{recipe.name}]", unit="stage")
    with torch_threads(recipe.threads):
        stages.set_postfix_str("corpus + tokenizer")
        tokenizer, special, json_docs, prompt_lens, filler_docs = prepare_data(recipe, out_dir)
        stages.update()

        stages.set_postfix_str("target")
        sched = recipe.target_schedule
        docs = (json_docs, filler_docs, prompt_lens, special["pad"])
        ids, weight = training_batches(recipe, docs, sched, 1)
        target = new_llama(recipe.target, tokenizer.get_vocab_size(), special, recipe.seed)
        target_losses = train_lm(target, ids, weight, sched, desc="target", bf16=recipe.bf16_autocast)
        save_hf_model(target, out_dir / "target", out_dir / "tokenizer", recipe.save_dtype)
        stages.update()

        stages.set_postfix_str("heads + draft")
        counts = token_counts(json_docs + filler_docs, tokenizer.get_vocab_size())
        d2t, t2d = draft_vocab(counts, recipe.draft_vocab_size, always=(special["eos"],))
        aux_ids = default_aux_layer_ids(recipe.target.num_layers)
        generator = torch.Generator().manual_seed(recipe.seed + 2)
        mtp = MTPHead.from_target(target, generator)
        eagle3 = Eagle3Head.from_target(target, d2t, t2d, aux_ids, generator)
        draft = new_llama(recipe.draft_model, tokenizer.get_vocab_size(), special, recipe.seed + 3)
        with torch.no_grad():
            draft.get_input_embeddings().weight.copy_(target.get_input_embeddings().weight)
        hs = recipe.heads_schedule
        ids, weight = training_batches(recipe, docs, hs, 4)
        head_losses = distill(target, {"mtp": mtp, "eagle3": eagle3, "draft": draft}, ids, weight, hs,
                              recipe.ttt_depth, aux_ids, hard_labels=tuple(recipe.hard_labels),
                              bf16=recipe.bf16_autocast)
        stages.update()

        stages.set_postfix_str("save")
        mtp.save(out_dir / "mtp", DTYPES[recipe.save_dtype])
        eagle3.save(out_dir / "eagle3", DTYPES[recipe.save_dtype])
        save_hf_model(draft, out_dir / "draft", out_dir / "tokenizer", recipe.save_dtype)
        stages.update()
    manifest = {
        "recipe": recipe.to_dict(),
        "parts": {name: name for name in PARTS},
        "target_parameters": sum(p.numel() for p in target.parameters()),
        "draft_parameters": sum(p.numel() for p in draft.parameters()),
        "eagle3_aux_layer_ids": aux_ids,
        "losses": {
            "target_first": target_losses[0], "target_last": tail_mean(target_losses),
            **{f"{name}_last": tail_mean(v) for name, v in head_losses.items()},
        },
        "versions": software_versions(),
        "code_version": code_version()[:16],
        "build_seconds": round(time.perf_counter() - started, 1),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }
    stages.update()
    stages.close()
    (out_dir / "zoo.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def main(argv: list[str] | None = None) -> int:
    """Child-process entry used by zoo.cache: build one recipe into --dest."""
    import argparse

    parser = argparse.ArgumentParser(description="build one zoo recipe into a directory")
    parser.add_argument("--recipe", required=True, help="the recipe as JSON (Recipe.to_dict)")
    parser.add_argument("--dest", required=True, type=Path)
    args = parser.parse_args(argv)
    manifest = build_zoo(Recipe.from_dict(json.loads(args.recipe)), args.dest)
    print(json.dumps({k: manifest[k] for k in ("build_seconds", "peak_rss_mb", "losses")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
