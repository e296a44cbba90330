"""The self-distilled records as training rows (zoo.selfdistill_train): token ids with per-token weights,
length-bucketed batches, and per-source oversampling.

Rows: one self-distilled record per row (prompt + response, cut at `seq_len`), weight 1 on response tokens
and `prompt_weight` on prompt tokens, 0 on padding; rows are bucketed by length so padding stays small.
`source_weights` ("jsonschemabench=2,chat=1.5") oversamples records by source: a weight w puts a record in
floor(w) copies of each epoch and one more with probability w - floor(w) (0 leaves the source out). It is
sampling, not a loss factor, because each batch's loss is normalized by its own token weight: a factor on a
batch that holds only one source would cancel out.

Labels are the target's argmax (hard-label distillation), except on the responses of records generated
greedily under a grammar: there the emitted token is the argmax over what the grammar allows, which is what
verification under the grammar accepts, and it differs from the unmasked argmax on ~7% of SmolLM2's guided JSON
tokens (where the model would write a newline or a space a compact grammar forbids). `emitted_from` marks them.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import torch


def parse_source_weights(text: str) -> dict[str, float]:
    """ "jsonschemabench=2,chat=1.5" -> {"jsonschemabench": 2.0, "chat": 1.5}; ValueError naming a bad item."""
    weights = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, eq, value = item.partition("=")
        try:
            weight = float(value) if eq and name.strip() else -1.0
        except ValueError:
            weight = -1.0
        if weight < 0:
            raise ValueError(f"source_weights: {item!r} is not SOURCE=WEIGHT with a weight >= 0")
        weights[name.strip()] = weight
    return weights


def emitted_from(rec: dict) -> int | None:
    """Where a record's emitted tokens are its labels (the first response index), or None: greedy under a
    grammar only (a sampled token is a draw, not the argmax; an unguided greedy one equals the argmax)."""
    return len(rec["prompt_ids"]) if rec.get("guided") and not rec.get("temperature") else None


def read_rows(path: Path, seq_len: int, prompt_weight: float, sources: list[str] | None = None,
              emitted: list[int | None] | None = None) -> list[tuple[list[int], list[float]]]:
    """(ids, weight) per usable record; `sources` and `emitted`, when given, receive each row's record source
    and `emitted_from`."""
    rows = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by an interrupted writer
        ids = (rec["prompt_ids"] + rec["output_ids"])[:seq_len]
        weight = ([prompt_weight] * len(rec["prompt_ids"]) + [1.0] * len(rec["output_ids"]))[:seq_len]
        if len(ids) > 8:
            rows.append((ids, weight))
            if sources is not None:
                sources.append(rec.get("source", "unknown"))
            if emitted is not None:
                emitted.append(emitted_from(rec))
    return rows


def emitted_labels(top: torch.Tensor, ids: torch.Tensor, starts: list[int | None], lengths: list[int]) -> torch.Tensor:
    """top [B, T] (the target's argmax at each index: its prediction of token index+1) with, for each row r whose
    starts[r] is set, its emitted tokens ids[r, s:lengths[r]] as the predictions at indices s-1.. (a new tensor)."""
    top = top.clone()
    for r, (start, n) in enumerate(zip(starts, lengths)):
        if start is not None and 0 < start < n:
            top[r, start - 1: n - 1] = ids[r, start:n]
    return top


def epoch_rows(repeats: list[float] | None, count: int, rng: random.Random) -> list[int]:
    """One epoch's row indices: each row once, or by its repeat weight (module docstring)."""
    if repeats is None:
        return list(range(count))
    out = []
    for i, w in enumerate(repeats):
        whole = int(w)
        out += [i] * (whole + (rng.random() < w - whole))
    return out


def batches(rows, batch_tokens: int, pad: int, rng: random.Random, repeats: list[float] | None = None):
    """Endless length-bucketed batches: (row indices, ids [B, T], weight [B, T]) with B * T <= batch_tokens;
    `repeats` (a weight per row) oversamples rows per epoch."""
    while True:
        order = sorted(epoch_rows(repeats, len(rows), rng), key=lambda i: (len(rows[i][0]), rng.random()))
        groups, group = [], []
        for i in order:
            longest = max(len(rows[j][0]) for j in group + [i])
            if group and longest * (len(group) + 1) > batch_tokens:
                groups.append(group)
                group = []
            group.append(i)
        groups.append(group)
        rng.shuffle(groups)
        for group in groups:
            t = max(len(rows[i][0]) for i in group)
            ids = torch.full((len(group), t), pad, dtype=torch.long)
            weight = torch.zeros(len(group), t)
            for r, i in enumerate(group):
                n = len(rows[i][0])
                ids[r, :n] = torch.tensor(rows[i][0])
                weight[r, :n] = torch.tensor(rows[i][1])
            yield group, ids, weight
