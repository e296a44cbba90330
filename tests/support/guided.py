"""Guided requests over finite languages (an enum-only JSON schema, a bounded regex, a choice), mixed
batches of them with unguided requests, and the check that an output belongs to its language. Even the
random test model completes these grammars, so every guided output must finish with "stop" and be valid."""
from __future__ import annotations

import json
import re

import jsonschema

from engine import SamplingParams, StructuredOutput
from tests.support.spec import random_prompts

SCHEMA = {"type": "object", "properties": {"kind": {"enum": ["cat", "dog", "bird"]}, "ok": {"type": "boolean"},
                                           "size": {"enum": [1, 22, 333]}},
          "required": ["kind", "ok", "size"], "additionalProperties": False}
REGEX = "[a-c]{2}-[0-9]{2}"
CHOICES = ["yes", "no", "maybe later"]
GUIDES = {"json_schema": StructuredOutput(json_schema=SCHEMA), "regex": StructuredOutput(regex=REGEX),
          "choice": StructuredOutput(choice=CHOICES)}


def is_valid(kind: str, text: str) -> bool:
    """Whether `text` belongs to the language of GUIDES[kind]."""
    if kind == "json_schema":
        try:
            jsonschema.validate(json.loads(text), SCHEMA)
        except (json.JSONDecodeError, jsonschema.ValidationError):
            return False
        return True
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    return text in CHOICES


def guided_params(i: int, kind: str | None) -> SamplingParams:
    """Request i's parameters: guided by GUIDES[kind] (unguided for None), every third one sampled (seeded)."""
    sampled = i % 3 == 1
    return SamplingParams(max_tokens=48, temperature=0.8 if sampled else 0.0, seed=7 + i,
                          structured_output=GUIDES[kind] if kind else None)


def guided_batch(n: int) -> tuple[list[list[int]], list[SamplingParams], list[str | None]]:
    """(prompts, parameters, kinds) of n requests cycling through GUIDES; every fourth is unguided (None)."""
    kinds = [list(GUIDES)[i % 3] if i % 4 != 3 else None for i in range(n)]  # every fourth is unguided
    return random_prompts(n, seed=21), [guided_params(i, k) for i, k in enumerate(kinds)], kinds
