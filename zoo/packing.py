"""Packs tokenized documents into fixed-length training sequences.

A sequence is filled with whole JSON-Schema documents (a document never straddles two sequences, so
the model always sees the schema it has to satisfy), and the room left at its end is filled with a
slice of the code/text stream. A `json_fraction` of the sequences are built this way; the others are
pure code/text. Documents longer than the sequence are dropped (json) or cut (code/text).

Alongside the ids comes a per-token loss weight: 1 for JSON instances and code/text, `prompt_weight`
for the tokens of a JSON document's prompt (the schema is read, not generated, at serving time), 0 on
padding. Everything is a pure function of the inputs and the `random.Random` passed in.
"""
from __future__ import annotations

import random

import torch


class _Cycle:
    """Endless iterator over items, reshuffled (by `rng`) at the start of each pass."""

    def __init__(self, items: list, rng: random.Random):
        if not items:
            raise ValueError("nothing to pack: the document list is empty")
        self.items, self.rng, self.order, self.pos = items, rng, [], 0

    def next(self):
        if self.pos == len(self.order):
            self.order = list(range(len(self.items)))
            self.rng.shuffle(self.order)
            self.pos = 0
        self.pos += 1
        return self.items[self.order[self.pos - 1]]


class _Stream:
    """Endless token stream over documents in shuffled passes."""

    def __init__(self, docs: list[list[int]], rng: random.Random):
        self.docs = _Cycle(docs, rng)
        self.buffer: list[int] = []

    def take(self, n: int) -> list[int]:
        while len(self.buffer) < n:
            self.buffer.extend(self.docs.next())
        out, self.buffer = self.buffer[:n], self.buffer[n:]
        return out


def pack(json_docs: list[list[int]], filler_docs: list[list[int]], seq_len: int, num_sequences: int,
         json_fraction: float, pad_id: int, rng: random.Random, prompt_lens: list[int] | None = None,
         prompt_weight: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (input_ids [N, seq_len] int64, weight [N, seq_len] float32; weight == 0 only on padding).

    prompt_lens[k] is the number of prompt tokens of json_docs[k] (they get `prompt_weight`).
    """
    lens = prompt_lens if prompt_lens is not None else [0] * len(json_docs)
    kept = [(d, p) for d, p in zip(json_docs, lens) if len(d) <= seq_len]
    json_cycle = _Cycle(kept, rng) if kept else None
    filler = _Stream(filler_docs, rng) if filler_docs else None
    ids = torch.full((num_sequences, seq_len), pad_id, dtype=torch.int64)
    weight = torch.zeros((num_sequences, seq_len), dtype=torch.float32)
    pending = None
    for row in range(num_sequences):
        tokens: list[int] = []
        if json_cycle is not None and (filler is None or rng.random() < json_fraction):
            while True:
                doc, prompt_len = pending if pending is not None else json_cycle.next()
                if len(tokens) + len(doc) > seq_len:
                    pending = (doc, prompt_len)  # starts the next json sequence
                    break
                weight[row, len(tokens): len(tokens) + len(doc)] = 1.0
                weight[row, len(tokens): len(tokens) + prompt_len] = prompt_weight
                tokens.extend(doc)
                pending = None
        if filler is not None and len(tokens) < seq_len:
            weight[row, len(tokens):] = 1.0
            tokens.extend(filler.take(seq_len - len(tokens)))
        ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.int64)
    return ids, weight
