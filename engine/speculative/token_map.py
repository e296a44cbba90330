"""A draft head's hot vocabulary (`SpecConfig.token_map`): the target token ids a head may draft.

A head's LM head is a large share of its draft step: it multiplies the step's hidden state by the
whole [V, H] vocabulary matrix, once per draft token. Most drafts that get accepted are frequent
tokens, so drafting from the N most frequent ones (FR-Spec, Zhao et al. 2025; SGLang's
`--speculative-token-map`) multiplies N rows instead of V and loses little acceptance. Output stays
lossless: verification runs on the target's full vocabulary, and a draft distribution that is zero
outside the map is as valid as any other.

The map is a file listing the ids: JSON (a list of integers, or {"token_ids": [...]}) or a torch file
holding a 1-D integer tensor (SGLang's format; read with weights_only). `tandem zoo token-map` writes
one for the zoo from its training corpus' token counts (zoo/token_map.py).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from engine.errors import ModelLoadError


def read_token_map(path: str | Path, vocab_size: int) -> torch.Tensor:
    """-> the map's token ids [N] int64, sorted (draft id i is target id ids[i]). A missing or unreadable
    file, an id outside [0, vocab_size), a repeated id or an empty map is a ModelLoadError naming the file."""
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"speculative token map {path} does not exist")
    try:
        if path.suffix == ".json":
            raw = json.loads(path.read_text())
            if isinstance(raw, dict):
                raw = raw.get("token_ids")
        else:
            raw = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # json, pickle or zip errors: all mean "not a token map"
        raise ModelLoadError(f"cannot read speculative token map {path}: {type(e).__name__}: {e}") from e
    if isinstance(raw, torch.Tensor):
        if raw.dim() != 1 or raw.is_floating_point() or raw.is_complex():
            raise ModelLoadError(f"speculative token map {path} holds a {raw.dim()}-d {raw.dtype} tensor; "
                                 f"expected a 1-d tensor of token ids")
        ids = raw.to(torch.int64)
    elif isinstance(raw, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in raw):
        ids = torch.tensor(raw, dtype=torch.int64)
    else:
        raise ModelLoadError(f"speculative token map {path} must be a list of integer token ids "
                             f"(or {{\"token_ids\": [...]}}, or a 1-d integer tensor)")
    if ids.numel() == 0:
        raise ModelLoadError(f"speculative token map {path} is empty")
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise ModelLoadError(f"speculative token map {path} has ids outside the target vocabulary [0, {vocab_size}): "
                             f"min {int(ids.min())}, max {int(ids.max())}")
    ids = ids.sort().values
    if bool((ids[1:] == ids[:-1]).any()):
        raise ModelLoadError(f"speculative token map {path} lists some token ids more than once")
    return ids
