"""structured/schema/conditional.py: if/then/else on one property as anyOf accepts only what the conditional
accepts (exactly, where the complement is exact), judged by the jsonschema validator on objects of every
presence and value pattern; llguidance serves it and what it writes is valid."""
from __future__ import annotations

import json

import jsonschema
import pytest

from structured import llguidance as llg
from structured.request import StructuredOutput
from structured.schema.conditional import rewrite_conditional
from structured.schema.presence import rewrite_presence
from tests.support.grammar import walk_json

THEN = {"required": ["src"]}
ELSE = {"properties": {"src": False}}
EXACT = {  # exact but for "" and line breaks in a complemented string (structured/schema/negation.py)
    "literal, not required": {"if": {"properties": {"kind": {"enum": ["image", "video"]}}}, "then": THEN, "else": ELSE},
    "a type, required": {"if": {"properties": {"auto": {"type": "object"}}, "required": ["auto"]}, "then": THEN},
    "two types, required, typed": {"if": {"type": "object", "properties": {"v": {"type": ["string", "number"]}},
                                          "required": ["v"]}, "else": THEN},
    "a type, not required, typed": {"if": {"type": "object", "properties": {"kind": {"type": "string"}}},
                                    "then": THEN, "else": ELSE},
}
NARROWER = {  # the complement of a string literal is spelled for strings only
    "typed const": {"type": "object",
                    "if": {"type": "object", "properties": {"kind": {"type": "string", "const": "image"}}},
                    "then": THEN, "else": ELSE},
}
KEY_VALUES = [None, 1, 2.5, "image", "video", "x", {}, [], True]
INSTANCES = ([None, 1, "s", [], True] + [{}] + [{"kind": v} for v in KEY_VALUES] + [{"auto": v} for v in KEY_VALUES]
             + [{"v": v} for v in KEY_VALUES]
             + [{k: v, "src": 1} for k in ("kind", "auto", "v") for v in KEY_VALUES] + [{"src": 1}])


def _judged(schema: dict):
    """(the rewritten schema, instances it accepts that the original rejects, and the reverse)."""
    rewritten = rewrite_conditional(schema)
    assert "if" not in rewritten
    before, after = jsonschema.Draft7Validator(schema), jsonschema.Draft7Validator(rewritten)
    wider = [x for x in INSTANCES if after.is_valid(x) and not before.is_valid(x)]
    return after, wider, [x for x in INSTANCES if before.is_valid(x) and not after.is_valid(x)]


@pytest.mark.parametrize("name", sorted(EXACT))
def test_exact_shapes_accept_the_same_instances(name):
    _, wider, narrower = _judged(EXACT[name])
    assert wider == [] and narrower == []


@pytest.mark.parametrize("name", sorted(NARROWER))
def test_narrower_shapes_accept_only_what_the_conditional_accepts(name):
    after, wider, _ = _judged(NARROWER[name])
    assert wider == []
    assert after.is_valid({"kind": "image", "src": 1}) and after.is_valid({"kind": "x"})


def test_other_conditions_are_left_alone():
    for condition in ({"properties": {"a": {"const": 1}, "b": {"const": 2}}},  # two properties
                      {"required": ["a"]},  # presence only: no property schema
                      {"properties": {"a": {"pattern": "^x"}}}):  # a complement structured.schema.negation cannot spell
        schema = {"if": condition, "then": THEN}
        assert rewrite_conditional(schema) == schema


def test_an_existing_anyof_is_kept_beside_the_conditional():
    schema = {"anyOf": [{"required": ["a"]}, {"required": ["b"]}], **EXACT["literal, not required"]}
    rewritten = rewrite_conditional(schema)
    assert rewritten["anyOf"] == schema["anyOf"] and len(rewritten["allOf"]) == 1
    before, after = jsonschema.Draft7Validator(schema), jsonschema.Draft7Validator(rewritten)
    extra = [{**x, "a": 0} for x in INSTANCES if isinstance(x, dict)]
    assert [x for x in INSTANCES + extra if before.is_valid(x) != after.is_valid(x)] == []


@pytest.mark.skipif(not llg.available(), reason="llguidance is not installed")
def test_llguidance_serves_a_conditional_and_writes_valid_objects(grammar_compiler, grammar_tokenizer):
    compiler, tokenizer = grammar_compiler, grammar_tokenizer
    schema = {"type": "object",
              "properties": {"kind": {"enum": ["a", "b", "c"]}, "n": {"type": "integer", "maximum": 9}},
              "required": ["kind"], "additionalProperties": False,
              "if": {"properties": {"kind": {"const": "a"}}}, "then": {"required": ["n"]},
              "else": {"properties": {"n": False}}}
    spec = StructuredOutput(json_schema=schema)
    assert spec.plan.backend == llg.BACKEND and "if" not in json.dumps(rewrite_presence(schema))
    kinds = set()
    for seed in range(8):
        value = walk_json(compiler, tokenizer, spec, seed, max_steps=200)
        jsonschema.validate(value, schema)
        kinds.add(value["kind"])
    assert len(kinds) >= 2, kinds  # both sides of the condition are reachable
