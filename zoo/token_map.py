"""Hot vocabularies from the zoo's training corpus: the token ids a draft head drafts from.

EAGLE-3's draft vocabulary (its `d2t`) and the token maps an MTP head can draft from
(SpecConfig.token_map, engine/speculative/token_map.py) are both the N most frequent target ids of the
corpus the zoo trains on, counted with its tokenizer; one ranking serves both.

    tandem zoo token-map --size 2048 --out map.json   # for the default zoo's target and heads
"""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Iterable

import torch


def token_counts(docs: Iterable[list[int]], vocab_size: int) -> torch.Tensor:
    """How often each id occurs in the tokenized `docs`: [vocab_size] int64."""
    counts = Counter(t for doc in docs for t in doc)
    return torch.tensor([counts.get(i, 0) for i in range(vocab_size)], dtype=torch.int64)


def hot_token_ids(counts: torch.Tensor, size: int, always: tuple[int, ...] = (),
                  tiebreak: torch.Tensor | None = None) -> list[int]:
    """The `size` most frequent ids (ties: the higher `tiebreak` count, then the lower id first), with `always`
    (e.g. eos) among them whatever their counts; sorted."""
    if not 0 < size <= counts.numel():
        raise ValueError(f"a hot vocabulary of {size} ids does not fit a vocabulary of {counts.numel()}")
    second = tiebreak if tiebreak is not None else torch.zeros_like(counts)
    order = sorted(range(counts.numel()), key=lambda t: (-int(counts[t]), -int(second[t]), t))
    return sorted(list(dict.fromkeys(list(always) + order))[:size])


def selfdistill_counts(path: Path, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (response counts, prompt counts) [vocab_size] of self-distilled records (zoo/selfdistill.py): what a
    real target writes ranks its hot vocabulary; what its prompts hold orders the ids no response used (a few
    thousand distinct ids cover the responses, and a map is usually larger)."""
    records = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut by an interrupted writer
    return (token_counts((r["output_ids"] for r in records), vocab_size),
            token_counts((r["prompt_ids"] for r in records), vocab_size))


def write_token_map(path: Path, ids: list[int], counts: torch.Tensor) -> dict:
    """A map file read by engine/speculative/token_map.py, with what share of the corpus' tokens it covers."""
    covered = int(counts[torch.tensor(ids)].sum()) / max(1, int(counts.sum()))
    doc = {"token_ids": ids, "vocab_size": counts.numel(), "corpus_coverage": round(covered, 4)}
    Path(path).write_text(json.dumps(doc) + "\n")
    return doc
