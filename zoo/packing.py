"""Packs tokenized documents into fixed-length training sequences.

A sequence is filled with whole JSON-Schema documents (a document never straddles two sequences, so
the model always sees the schema it has to satisfy), and the room left at its end is filled with a
slice of the code/text stream. A `json_fraction` of the sequences are built this way; the others are
pure code/text. Documents longer than the sequence are dropped (json) or cut (code/text).
Everything is a pure function of the inputs and the `random.Random` passed in.
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
         json_fraction: float, pad_id: int, rng: random.Random) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (input_ids [N, seq_len] int64, real [N, seq_len] bool: False only on padding)."""
    json_docs = [d for d in json_docs if len(d) <= seq_len]
    json_cycle = _Cycle(json_docs, rng) if json_docs else None
    filler = _Stream(filler_docs, rng) if filler_docs else None
    ids = torch.full((num_sequences, seq_len), pad_id, dtype=torch.int64)
    real = torch.zeros((num_sequences, seq_len), dtype=torch.bool)
    pending = None
    for row in range(num_sequences):
        tokens: list[int] = []
        if json_cycle is not None and (filler is None or rng.random() < json_fraction):
            while True:
                doc = pending if pending is not None else json_cycle.next()
                if len(tokens) + len(doc) > seq_len:
                    pending = doc  # starts the next json sequence
                    break
                tokens.extend(doc)
                pending = None
        if filler is not None and len(tokens) < seq_len:
            tokens.extend(filler.take(seq_len - len(tokens)))
        ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.int64)
        real[row, : len(tokens)] = True
    return ids, real
