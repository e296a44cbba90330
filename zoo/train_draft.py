"""Trains an MTP or EAGLE-3 head for any Llama-family HF target (`tandem zoo train-draft`).

The data file is JSON lines, one document per line, as {"text": ...}, {"schema": ..., "instance": ...}
(rendered with zoo.prompts.json_schema_document) or {"messages": [...]} (rendered with the target
tokenizer's chat template); a file with any other suffix is read as plain text, one document per
blank-line-separated block. Runs on the GPU when there is one (target in bfloat16, head in float32).
"""
from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from zoo.distill import distill
from zoo.heads.eagle3 import Eagle3Head, default_aux_layer_ids, draft_vocab
from zoo.heads.mtp import MTPHead
from zoo.packing import pack
from zoo.prompts import json_schema_document
from zoo.recipe import Schedule


class DataError(ValueError):
    """The training data file is missing, empty or has a line the trainer cannot read."""


def read_documents(path: Path, tokenizer) -> list[str]:
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file {path} does not exist")
    if path.suffix != ".jsonl":
        docs = [block.strip() for block in path.read_text(encoding="utf-8").split("\n\n") if block.strip()]
    else:
        docs = []
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                if "text" in row:
                    docs.append(row["text"])
                elif "schema" in row:
                    docs.append(json_schema_document(row["schema"], row["instance"]))
                else:
                    docs.append(tokenizer.apply_chat_template(row["messages"], tokenize=False))
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise DataError(f"{path}:{number}: expected text, schema+instance or messages ({err})") from err
    if not docs:
        raise DataError(f"data file {path} holds no documents")
    return docs


def _encode(tokenizer, docs: list[str]) -> list[list[int]]:
    encoded = tokenizer(docs, add_special_tokens=False)["input_ids"]
    bos = tokenizer.bos_token_id
    return [ids if bos is None or (ids and ids[0] == bos) else [bos] + ids for ids in encoded]


def train_draft_head(target_dir: Path, kind: str, data_file: Path, out_dir: Path, *, steps: int = 200,
                     batch_size: int = 8, seq_len: int = 512, lr: float = 2e-3, depth: int = 3,
                     draft_vocab_size: int | None = None, seed: int = 0, device: str | None = None) -> dict:
    if kind not in ("mtp", "eagle3"):
        raise ValueError(f"kind must be mtp or eagle3, got {kind!r}")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype).to(device).eval()
    docs = _encode(tokenizer, read_documents(data_file, tokenizer))
    vocab = target.get_input_embeddings().weight.shape[0]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    schedule = Schedule(steps=steps, batch_size=batch_size, lr=lr, warmup_steps=max(1, steps // 20))
    whole = [d for d in docs if len(d) <= seq_len]
    long = [d for d in docs if len(d) > seq_len]
    ids, weight = pack(whole, long, seq_len, steps * batch_size, 1.0 if not long else 0.8, pad, random.Random(seed))
    generator = torch.Generator().manual_seed(seed)
    num_layers = target.config.num_hidden_layers
    aux_ids = None
    if kind == "mtp":
        head = MTPHead.from_target(target, generator)
    else:
        counts = Counter(t for doc in docs for t in doc)
        token_counts = torch.tensor([counts.get(i, 0) for i in range(vocab)])
        size = draft_vocab_size or (vocab if vocab <= 8192 else min(32000, vocab))
        always = tuple(t for t in (tokenizer.eos_token_id,) if t is not None)
        d2t, t2d = draft_vocab(token_counts, size, always)
        aux_ids = default_aux_layer_ids(num_layers)
        head = Eagle3Head.from_target(target, d2t, t2d, aux_ids, generator)
    torch.manual_seed(seed)
    losses = distill(target, {kind: head}, ids, weight, schedule, depth, aux_ids, device=device, desc=kind)
    head.to("cpu").save(Path(out_dir))
    return {"kind": kind, "out": str(out_dir), "device": device, "documents": len(docs),
            "first_loss": losses[kind][0], "last_loss": losses[kind][-1]}
