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

import copy
import json
import random
import resource
import shutil
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import GenerationConfig

from zoo.cache import code_version, software_versions
from zoo.corpus import build_corpus, generated_json_docs
from zoo.distill import distill
from zoo.heads.eagle3 import Eagle3Head, default_aux_layer_ids, draft_vocab
from zoo.heads.mtp import MTPHead
from zoo.packing import pack
from zoo.prompts import BOS, END, PAD, json_schema_prompt
from zoo.recipe import Recipe
from zoo.token_map import token_counts
from zoo.tokenizer import TOKENIZER_FILES, load_tokenizer, save_tokenizer, train_tokenizer
from zoo.training import new_llama, train_lm

PARTS = ("tokenizer", "target", "draft", "mtp", "eagle3")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@contextmanager
def torch_threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _special_ids(tokenizer) -> dict[str, int]:
    return {"pad": tokenizer.token_to_id(PAD), "bos": tokenizer.token_to_id(BOS), "eos": tokenizer.token_to_id(END)}


def save_hf_model(model, out_dir: Path, tokenizer_dir: Path, save_dtype: str = "float32") -> None:
    """save_pretrained plus the tokenizer files, so the directory is a self-contained HF model.

    Weights are stored in `save_dtype`; the config keeps float32, the dtype a CPU runs them in, so
    loaders that follow the config (engine, transformers' dtype="auto") upcast them exactly.
    """
    special = model.config
    model.generation_config = GenerationConfig(
        bos_token_id=special.bos_token_id, eos_token_id=special.eos_token_id, pad_token_id=special.pad_token_id,
    )
    if save_dtype == "float32":
        model.save_pretrained(out_dir)
    else:
        copy.deepcopy(model).to(_DTYPES[save_dtype]).save_pretrained(out_dir)
    config_path = out_dir / "config.json"
    config = json.loads(config_path.read_text())
    if save_dtype != "float32":
        config["dtype"] = config["torch_dtype"] = "float32"
    # Loaders older than transformers 5 read these two top-level keys.
    config.setdefault("rope_theta", config.get("rope_parameters", {}).get("rope_theta", 10000.0))
    config.setdefault("torch_dtype", "float32")
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / name, out_dir / name)


def _encode_texts(tokenizer, texts: list[str]) -> list[list[int]]:
    return [e.ids for e in tokenizer.encode_batch(texts)]


def _encode(tokenizer, docs) -> list[list[int]]:
    return _encode_texts(tokenizer, [d.text for d in docs])


def training_docs(recipe: Recipe) -> list:
    """The documents every model of the zoo trains on (and the tokenizer samples from), in order."""
    corpus = build_corpus(recipe.stdlib_modules)
    train = corpus.train + tuple(generated_json_docs(recipe.generated_per_schema, recipe.seed))
    return _limit(_short_schemas(train, recipe.max_schema_chars), recipe.max_docs_per_domain)


def corpus_token_counts(recipe, tokenizer_dir: Path) -> torch.Tensor:
    """The counts the builder takes for `recipe` (its training documents, tokenized by the zoo's own
    tokenizer); about 40 s for the default recipe on two cores."""
    tokenizer = load_tokenizer(tokenizer_dir)
    docs = [e.ids for e in tokenizer.encode_batch([d.text for d in training_docs(recipe)])]
    return token_counts(docs, tokenizer.get_vocab_size())


def prepare_data(recipe: Recipe, out_dir: Path) -> tuple:
    """Train and save the tokenizer (out_dir/tokenizer) and tokenize the training documents; -> (tokenizer,
    special ids, JSON documents, their prompt lengths, code/text documents), the inputs of `pack`."""
    train_docs = training_docs(recipe)
    rng = random.Random(recipe.seed)
    sample = rng.sample(train_docs, min(recipe.tokenizer_docs, len(train_docs)))
    tokenizer = train_tokenizer((d.text for d in sample), recipe.vocab_size)
    save_tokenizer(tokenizer, out_dir / "tokenizer", model_max_length=2048)
    tokenizer = load_tokenizer(out_dir / "tokenizer")
    json_train = [d for d in train_docs if d.domain == "json"]
    json_docs = _encode(tokenizer, json_train)
    prompt_lens = [len(ids) for ids in _encode_texts(tokenizer, [d.text[: d.prompt_chars] for d in json_train])]
    filler_docs = _encode(tokenizer, [d for d in train_docs if d.domain != "json"])
    return tokenizer, _special_ids(tokenizer), json_docs, prompt_lens, filler_docs


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
        ids, weight = pack(json_docs, filler_docs, recipe.seq_len, sched.steps * sched.batch_size,
                           recipe.json_fraction, special["pad"], random.Random(recipe.seed + 1),
                           prompt_lens, recipe.prompt_weight)
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
        ids, weight = pack(json_docs, filler_docs, recipe.seq_len, hs.steps * hs.batch_size,
                           recipe.json_fraction, special["pad"], random.Random(recipe.seed + 4),
                           prompt_lens, recipe.prompt_weight)
        head_losses = distill(target, {"mtp": mtp, "eagle3": eagle3, "draft": draft}, ids, weight, hs,
                              recipe.ttt_depth, aux_ids, hard_labels=tuple(recipe.hard_labels),
                              bf16=recipe.bf16_autocast)
        stages.update()

        stages.set_postfix_str("save")
        mtp.save(out_dir / "mtp", _DTYPES[recipe.save_dtype])
        eagle3.save(out_dir / "eagle3", _DTYPES[recipe.save_dtype])
        save_hf_model(draft, out_dir / "draft", out_dir / "tokenizer", recipe.save_dtype)
        stages.update()
    manifest = {
        "recipe": recipe.to_dict(),
        "parts": {name: name for name in PARTS},
        "target_parameters": sum(p.numel() for p in target.parameters()),
        "draft_parameters": sum(p.numel() for p in draft.parameters()),
        "eagle3_aux_layer_ids": aux_ids,
        "losses": {
            "target_first": target_losses[0], "target_last": _tail_mean(target_losses),
            **{f"{name}_last": _tail_mean(v) for name, v in head_losses.items()},
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


def _short_schemas(docs, max_schema_chars: int | None) -> list:
    if max_schema_chars is None:
        return list(docs)
    overhead = len(json_schema_prompt({})) - len("{}")
    return [d for d in docs if d.domain != "json" or d.prompt_chars - overhead <= max_schema_chars]


def _limit(docs, per_domain: int | None) -> list:
    if per_domain is None:
        return list(docs)
    seen: Counter = Counter()
    kept = []
    for doc in docs:
        seen[doc.domain] += 1
        if seen[doc.domain] <= per_domain:
            kept.append(doc)
    return kept


def _tail_mean(values: list[float], n: int = 10) -> float:
    tail = values[-n:]
    return round(sum(tail) / len(tail), 4)


if __name__ == "__main__":
    raise SystemExit(main())
