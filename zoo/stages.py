"""The zoo builders' shared stages (zoo/builder.py for the Llama zoos, zoo/moe.py for the DeepSeek-V3-shaped one):
the training documents, the tokenizer and the tokenized corpus, saving an HF-loadable model directory, and
small training helpers. Neither builder imports the other's module for them."""
from __future__ import annotations

import copy
import json
import random
import shutil
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import GenerationConfig

from zoo.corpus import build_corpus, generated_json_docs
from zoo.packing import pack
from zoo.prompts import BOS, END, PAD, json_schema_prompt
from zoo.recipe import Recipe
from zoo.token_map import token_counts
from zoo.tokenizer import TOKENIZER_FILES, load_tokenizer, save_tokenizer, train_tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

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
        copy.deepcopy(model).to(DTYPES[save_dtype]).save_pretrained(out_dir)
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


def tail_mean(values: list[float], n: int = 10) -> float:
    tail = values[-n:]
    return round(sum(tail) / len(tail), 4)


def training_batches(recipe: Recipe, docs: tuple, schedule, seed_offset: int) -> tuple:
    """Training rows (ids, loss weights) for a whole `schedule`, packed from `prepare_data`'s documents `docs`
    (JSON documents, code/text documents, the JSON prompts' lengths, the pad id); the target packs with seed
    offset 1 and the heads with 4, in every zoo."""
    json_docs, filler_docs, prompt_lens, pad = docs
    return pack(json_docs, filler_docs, recipe.seq_len, schedule.steps * schedule.batch_size, recipe.json_fraction,
                pad, random.Random(recipe.seed + seed_offset), prompt_lens, recipe.prompt_weight)
