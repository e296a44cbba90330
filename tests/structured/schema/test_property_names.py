"""structured/schema/property_names.py: propertyNames as properties/patternProperties/additionalProperties
accepts what the original accepts (exactly, or narrower where the docstring says), judged by the
jsonschema validator on objects of every key pattern; both backends write only valid objects under it."""
from __future__ import annotations

import itertools

import jsonschema
import pytest

from structured import llguidance as llg
from structured.request import StructuredOutput
from structured.schema.property_names import rewrite_property_names
from tests.support.grammar import walk_json

P = {"a1": {"type": "integer"}, "b": {"type": "string"}}
EXACT = {
    "any string": {"type": "object", "properties": P, "propertyNames": {"type": "string"}},
    "listed names": {"type": "object", "properties": P, "propertyNames": {"enum": ["a1", "zz"]},
                     "additionalProperties": {"type": "boolean"}},
    "a pattern, open": {"type": "object", "properties": P, "propertyNames": {"pattern": "^[a-z][0-9]$"}},
    "through a $ref": {"type": "object", "properties": P, "propertyNames": {"$ref": "#/$defs/name"},
                       "$defs": {"name": {"type": "string", "pattern": "^[a-z]+$"}}},
}
NARROWER = {
    "a pattern, closed": {"type": "object", "properties": P, "propertyNames": {"pattern": "^[a-z]"},
                          "additionalProperties": {"type": "integer"}},
}
KEYS = ("a1", "b", "zz", "c7", "x", "Q")
VALUES = (1, "s", True)
INSTANCES = [dict(zip(keys, values)) for n in range(3) for keys in itertools.combinations(KEYS, n)
             for values in itertools.product(VALUES, repeat=n)]


def _judged(schema: dict):
    rewritten = rewrite_property_names(schema, schema)
    assert "propertyNames" not in rewritten
    before, after = jsonschema.Draft202012Validator(schema), jsonschema.Draft202012Validator(rewritten)
    wider = [x for x in INSTANCES if after.is_valid(x) and not before.is_valid(x)]
    return wider, [x for x in INSTANCES if before.is_valid(x) and not after.is_valid(x)]


@pytest.mark.parametrize("name", sorted(EXACT))
def test_exact_shapes(name):
    assert _judged(EXACT[name]) == ([], [])


@pytest.mark.parametrize("name", sorted(NARROWER))
def test_narrower_shapes_are_sound(name):
    wider, narrower = _judged(NARROWER[name])
    assert wider == [] and narrower  # {"b": "s"}: b matches the pattern, so it must now be an integer too


def test_other_shapes_are_left_alone():
    for names in ({"maxLength": 3}, {"pattern": "^a", "maxLength": 3}, {"enum": [1]}):
        schema = {"type": "object", "propertyNames": names}
        assert rewrite_property_names(schema, schema) == schema
    beside = {"type": "object", "patternProperties": {"^x": {}}, "propertyNames": {"pattern": "^[a-z]"}}
    assert rewrite_property_names(beside, beside) == beside


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_what_the_backends_write_is_valid(grammar_compiler, grammar_tokenizer, backend):
    if backend == "llguidance" and not llg.available():
        pytest.skip("llguidance is not installed")
    schema = {"type": "object", "properties": {"a1": {"type": "integer", "maximum": 9}},
              "propertyNames": {"enum": ["a1", "zz"]}, "additionalProperties": {"type": "boolean"},
              "required": ["a1"]}
    if backend == "llguidance":  # a keyword xgrammar does not enforce sends it to llguidance
        schema["properties"]["w"] = {"type": "number", "multipleOf": 0.5}
        schema["propertyNames"]["enum"].append("w")
    spec = StructuredOutput(json_schema=schema)
    assert spec.plan.backend == backend
    for seed in range(6):
        jsonschema.validate(walk_json(grammar_compiler, grammar_tokenizer, spec, seed, max_steps=200), schema)
