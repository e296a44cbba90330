"""structured/schema/negation.py: `not` of a type or of literals, spelled positively: the rewritten schema accepts
only what the original accepts (the jsonschema validator as judge), and what both backends write under
it is valid against the original."""
from __future__ import annotations

import itertools
import re

import jsonschema
import pytest

from structured.schema.negation import complement_pattern, rewrite_not
from structured.schema.rewrite import rewrite
from structured.schema.support import first_unenforceable
from tests.support.grammar import assert_backend_writes_valid

CASES = {
    "not a type": {"not": {"type": "object"}},
    "not number (integers go too)": {"type": ["number", "string"], "not": {"type": "number"}},
    "not integer (so not number either)": {"type": ["number", "null"], "not": {"type": "integer"}},
    "not some strings": {"type": "string", "not": {"enum": ["CAN", "CA", "MEX", "x-y", "a.b"]}},
    "not one string, untyped": {"not": {"const": "logs"}},
    "not some integers in a range": {"type": "integer", "minimum": 0, "maximum": 20, "not": {"enum": [3, 4, 9]}},
}
STRINGS = ["", "C", "CA", "CAN", "CANX", "M", "MEX", "MEXX", "x", "x-", "x-y", "x-yz", "xy", "a.b", "axb", "a.", "logs",
           "log", "logsx", "USA", "x\ny"]
VALUES = [None, True, 0, 1, 1.5, -2, 3, 4, 5, 9, 10, 20, 21, [], {}, [1]] + STRINGS


@pytest.mark.parametrize("name", sorted(CASES))
def test_rewritten_accepts_only_what_the_original_accepts(name):
    schema = CASES[name]
    rewritten = rewrite_not(schema)
    assert "not" not in rewritten
    before, after = jsonschema.Draft202012Validator(schema), jsonschema.Draft202012Validator(rewritten)
    assert [v for v in VALUES if after.is_valid(v) and not before.is_valid(v)] == []
    assert any(after.is_valid(v) for v in VALUES)


def test_the_complement_pattern_is_exact_on_non_empty_single_line_strings():
    values = ["CAN", "CA", "MEX", "x-y", "a.b", "[^]"]
    pattern = re.compile(complement_pattern(values))
    alphabet = "CANMEX-y.ab[^]z"
    for n in range(1, 5):
        for chars in itertools.product(alphabet, repeat=n):
            s = "".join(chars)
            assert bool(pattern.fullmatch(s)) == (s not in values), s


def test_what_cannot_be_spelled_stays():
    for schema in ({"type": "string", "not": {"pattern": "^a"}},
                   {"type": "string", "pattern": "^a", "not": {"enum": ["ab"]}},  # two patterns
                   {"type": "string", "not": {"enum": ['say "hi"']}},  # the JSON escape gap
                   {"not": {"type": ["array", "boolean", "integer", "null", "number", "object", "string"]}}):
        assert rewrite_not(schema) == schema
        assert first_unenforceable(rewrite(schema)) is not None


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_what_the_backends_write_is_valid(grammar_compiler, grammar_tokenizer, backend):
    schema = {"type": "object", "properties": {"c": {"type": "string", "not": {"enum": ["a", "ab", "b"]}},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 9,
                                                     "not": {"enum": [0, 1, 5]}},
                                               "t": {"not": {"type": ["string", "number", "array", "object"]}}},
              "required": ["c", "n", "t"], "additionalProperties": False}
    assert_backend_writes_valid(grammar_compiler, grammar_tokenizer, schema, backend, '"')
