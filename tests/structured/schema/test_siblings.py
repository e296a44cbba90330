"""structured/schema/siblings.py: keywords beside anyOf/oneOf moved into the branches, untyped string and
number keywords given every type. The rewritten schema accepts exactly what the original accepts (the
jsonschema validator as judge, on objects of every key pattern and on scalars), and what both backends
write under it is valid against the original."""
from __future__ import annotations

import itertools
import json

import jsonschema
import pytest

from engine.errors import InvalidRequestError
from structured.compiler import compiled_schema_source
from structured.request import StructuredOutput
from structured.schema.rewrite import rewrite
from structured.schema.support import first_unenforceable
from tests.support.grammar import assert_backend_writes_valid, walk_json

PROPS = {"id": {"type": "string"}, "path": {"type": "string", "pattern": "^a+$"}, "url": {"type": "string"}}
CASES = {
    # JSONSchemaBench Github_medium o90224's shape: xgrammar wrote any object, undeclared keys included
    "required alternatives beside closed properties": {
        "type": "object", "additionalProperties": False, "properties": PROPS,
        "anyOf": [{"required": ["id", "url"]}, {"required": ["id", "path"]}]},
    "oneOf beside a required property": {
        "type": "object", "properties": {"id": {"type": "string"}, "n": {"type": "integer"}}, "required": ["id"],
        "oneOf": [{"properties": {"id": {"const": "a"}, "n": {"minimum": 5}}},
                  {"properties": {"id": {"const": "b"}, "n": {"maximum": 1}}}]},
    "type and bounds beside anyOf": {"type": "integer", "minimum": 0,
                                     "anyOf": [{"maximum": 1}, {"minimum": 4, "maximum": 6}]},
    "branches through $ref": {"type": "object", "additionalProperties": False, "properties": PROPS,
                              "anyOf": [{"$ref": "#/$defs/u"}, {"$ref": "#/$defs/p"}],
                              "$defs": {"u": {"required": ["url"]}, "p": {"required": ["path"]}}},
    "anyOf beside oneOf": {"type": "object", "properties": PROPS, "additionalProperties": False,
                           "anyOf": [{"required": ["id"]}, {"required": ["url"]}],
                           "oneOf": [{"properties": {"id": {"const": "a"}}, "required": ["id"]},
                                     {"properties": {"id": {"const": "b"}}, "required": ["id"]}]},
    "untyped pattern": {"type": "object", "properties": {"n": {"pattern": "^a+$"}}},
    # JSONSchemaBench Github_trivial o90933 / Github_easy o65361: required names the properties do not declare
    "required but undeclared": {"properties": {"id": {"type": "string"}}, "required": ["id", "n"]},
    "required but undeclared, typed extras": {"type": "object", "properties": {"id": {"type": "string"}},
                                              "required": ["n"], "additionalProperties": {"type": "integer"}},
    "allOf beside a root id": {"id": "http://example.com/s#", "type": "object", "required": ["id", "n"],
                               "allOf": [{"$ref": "#/definitions/e"}],
                               "definitions": {"e": {"type": "object", "properties": {"id": {"type": "string"},
                                                                                      "n": {"type": "integer"}}}}},
    "untyped minimum": {"type": "object", "properties": {"n": {"minimum": 5, "maxLength": 2}}},
}
KEYS = ("id", "path", "url", "n", "zzz")
VALUES = ("a", "b", "aa", "abc", 0, 1, 3, 5, 7, True, None)
OBJECTS = [dict(zip(keys, values)) for n in range(4) for keys in itertools.combinations(KEYS, n)
           for values in itertools.product(VALUES[:4] if n == 3 else VALUES, repeat=n)]
POOL = OBJECTS + list(VALUES) + [[], {"n": []}]


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_rewrite_is_exact(name):
    schema = CASES[name]
    rewritten = rewrite(schema)
    assert first_unenforceable(rewritten) is None, first_unenforceable(rewritten)
    before, after = jsonschema.Draft202012Validator(schema), jsonschema.Draft202012Validator(rewritten)
    assert [x for x in POOL if before.is_valid(x) != after.is_valid(x)] == []
    assert any(before.is_valid(x) for x in POOL)


def test_siblings_move_into_every_branch():
    rewritten = rewrite(CASES["required alternatives beside closed properties"])
    assert set(rewritten) == {"anyOf"}
    for branch in rewritten["anyOf"]:
        assert branch["additionalProperties"] is False and branch["type"] == "object" and "id" in branch["required"]


def test_what_cannot_be_moved_is_refused():
    """A sibling whose conjunction is not simple (patternProperties depends on its own properties) and a
    recursive $ref branch stay beside the anyOf, and the schema goes to the refusal (llguidance)."""
    for schema in ({"type": "object", "patternProperties": {"^x": {"type": "integer"}},
                    "anyOf": [{"required": ["xa"]}, {"required": ["xb"]}]},
                   {"$defs": {"t": {"type": "object", "properties": {"c": {"$ref": "#/$defs/t"}},
                                    "anyOf": [{"$ref": "#/$defs/t"}, {"required": ["c"]}]}},
                    "$ref": "#/$defs/t"}):
        found = first_unenforceable(rewrite(schema))
        assert found is not None and "beside anyOf" in found.reason


def test_what_no_declaration_can_hold_is_refused():
    for schema in ({"type": "object", "properties": {"a": {}}, "required": ["b"], "additionalProperties": False},
                   {"type": "object", "required": ["xb"], "patternProperties": {"^x": {"type": "integer"}}}):
        found = first_unenforceable(rewrite(schema))
        assert found is not None and found.keyword == "required"
    unmerged = {"type": "object", "required": ["a"], "allOf": [{"$ref": "#/$defs/t"}],
                "$defs": {"t": {"type": "object", "properties": {"a": {"type": "string"}},
                                "patternProperties": {"^x": {}}}}}
    found = first_unenforceable(rewrite(unmerged))
    assert found is not None and found.keyword == "allOf"


def test_a_pattern_beside_an_enforced_format_and_a_shadowed_property_are_refused():
    found = first_unenforceable(rewrite({"type": "string", "format": "uri", "pattern": "^https://"}))
    assert found is not None and found.keyword == "pattern"
    shadowed = {"type": "object", "properties": {"id": {"type": "string", "pattern": "^a{3}$"}},
                "patternProperties": {"^[a-z]+$": {"type": "string"}}}
    found = first_unenforceable(rewrite(shadowed))
    assert found is not None and found.keyword == "patternProperties" and "'id'" in found.reason
    unmatched = {"type": "object", "properties": {"id": {"type": "string"}},
                 "patternProperties": {"^x-": {"type": "string"}}}
    assert first_unenforceable(rewrite(unmatched)) is None


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_what_the_backends_write_is_valid(grammar_compiler, grammar_tokenizer, backend):
    schema = {"type": "object", "properties": {
        "r": CASES["required alternatives beside closed properties"],
        "o": CASES["oneOf beside a required property"],
        "t": CASES["type and bounds beside anyOf"],
        "u": {"pattern": "^a+$", "minimum": 5},
        "q": CASES["required but undeclared, typed extras"]},
        "required": ["r", "o", "t", "u", "q"], "additionalProperties": False}
    assert_backend_writes_valid(grammar_compiler, grammar_tokenizer, schema, backend, '"}', max_steps=400)


def test_a_property_that_must_be_absent_is_left_undeclared_for_xgrammar(grammar_compiler, grammar_tokenizer):
    """JSONSchemaBench Github_easy o30275: `{"type": "object", "enum": ["A"]}` is false; optional, the key
    must simply be absent, which xgrammar (no false subschema, never an undeclared key) writes by not
    declaring it; required, nothing satisfies the schema and the compile refuses it."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "object", "enum": ["A"]}},
              "required": ["a"]}
    spec = StructuredOutput(json_schema=schema)
    assert json.loads(compiled_schema_source(spec))["properties"] == {"a": {"type": "integer"}}
    for seed in range(4):
        out = walk_json(grammar_compiler, grammar_tokenizer, spec, seed, max_steps=100)
        jsonschema.validate(out, schema)
    with pytest.raises(InvalidRequestError, match="false"):
        grammar_compiler.compile(StructuredOutput(json_schema={**schema, "required": ["a", "b"]}))


def test_only_schemas_are_walked_for_absent_properties():
    """A property named "properties" is a name, not the keyword: its schema's additionalProperties: false
    stays (25 dev schemas, e.g. GeoJSON-style "properties" members, lost it to a walk of every dict)."""
    schema = {"type": "object", "properties": {"properties": {"type": "object", "additionalProperties": False,
                                                              "properties": {"a": {"type": "string"}}}}}
    assert json.loads(compiled_schema_source(StructuredOutput(json_schema=schema))) == schema
