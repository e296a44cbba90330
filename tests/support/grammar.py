"""Random walks through a compiled grammar (any backend), and the check that they end in valid JSON."""
from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from kernels.bitmask import apply_token_bitmask
from structured import llguidance as llg
from structured.request import StructuredOutput
from tests.support.tiny import VOCAB


def closing_bias(tokenizer, closers: str, weight: float, also: tuple[int, ...] = ()):
    """Logit bias favouring the tokens that hold one of `closers` (and the ids in `also`), so random
    walks through a free-form grammar end within their step budget."""
    return torch.tensor([weight if any(c in tokenizer.decode([t]) for c in closers) or t in also else 0.0
                         for t in range(VOCAB)])


def walk_json(compiler, tokenizer, spec, seed: int, max_steps: int = 300, bias=None):
    """walk_tokens ending on the stop token (id 1), its text parsed as JSON."""
    out, token = walk_tokens(compiler, spec, seed, max_steps, bias)
    assert token == 1, token
    return json.loads(tokenizer.decode(out))


def walk_tokens(compiler, spec, seed: int, max_steps: int = 300, bias=None) -> tuple[list[int], int]:
    """Greedy decoding of random logits under the grammar mask (any backend's compiler) until the matcher
    terminates: (the tokens before the last, the last), which ended it; AssertionError if it never does."""
    state = compiler.new_state(compiler.compile(spec), spec)
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(max_steps):
        logits = torch.randn(1, VOCAB, generator=g)
        if bias is not None:
            logits += bias
        mask = compiler.allocate_bitmask(1)
        state.fill_bitmask(mask, 0)
        apply_token_bitmask(logits, mask)
        token = int(logits.argmax())
        assert state.accept(token)
        if state.terminated:
            return out, token
        out.append(token)
    raise AssertionError("grammar did not terminate")


def assert_backend_writes_valid(compiler, tokenizer, schema: dict, backend: str, closers: str,
                                max_steps: int = 300, seeds: int = 8) -> None:
    """Random walks through `schema`'s grammar on `backend` each end in an instance valid against it.
    For llguidance, a keyword xgrammar does not enforce (multipleOf on a number) is added to send the
    schema there; skipped where llguidance is not installed."""
    if backend == "llguidance":
        if not llg.available():
            pytest.skip("llguidance is not installed")
        schema = {**schema, "properties": {**schema["properties"], "w": {"type": "number", "multipleOf": 0.5}}}
    spec = StructuredOutput(json_schema=schema)
    assert spec.plan.backend == backend
    bias = closing_bias(tokenizer, closers, 2.0)
    for seed in range(seeds):
        jsonschema.validate(walk_json(compiler, tokenizer, spec, seed, max_steps=max_steps, bias=bias), schema)
