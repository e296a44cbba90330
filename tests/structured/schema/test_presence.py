"""structured/schema/presence.py: each key-presence rewrite accepts exactly the instances the original
schema accepts (the jsonschema validator as judge) over every presence pattern of five keys with two
values each and over non-objects, removes the keyword it rewrites, and leaves other shapes alone."""
from __future__ import annotations

import itertools

import jsonschema
import pytest

from structured.schema.presence import rewrite_presence

P = {k: {"type": "integer"} for k in "abcd"}
D2020 = "https://json-schema.org/draft/2020-12/schema"
CASES = {
    "dependency": {"type": "object", "properties": P, "dependencies": {"a": ["b"]}},
    "two dependencies, any type": {"properties": P, "dependencies": {"a": ["b"], "c": ["d", "b"]}},
    "dependency of a required key": {"type": "object", "properties": P, "required": ["a"],
                                     "dependencies": {"a": ["b", "c"]}},
    "schema dependency": {"type": "object", "properties": P,
                          "dependencies": {"a": {"properties": {"b": {"minimum": 5}}, "required": ["b"]}}},
    "schema dependency of a required key": {"properties": P, "required": ["a"],
                                            "dependencies": {"a": {"properties": {"c": {"maximum": 3}}}}},
    "2020-12 dependentRequired + dependentSchemas": {"$schema": D2020, "type": "object", "properties": P,
                                                     "dependentRequired": {"a": ["c"]},
                                                     "dependentSchemas": {"b": {"required": ["d"]}}},
    "empty and impossible dependencies": {"type": "object", "properties": {"a": P["a"], "b": P["b"]},
                                          "additionalProperties": False, "dependencies": {"z": ["a"], "a": []}},
    "dependency beside an anyOf": {"properties": P, "anyOf": [{"required": ["c"]}, {"required": ["d"]}],
                                   "dependencies": {"a": ["b"]}},
    "not one required key, any type": {"properties": P, "not": {"required": ["a"]}},
    "not two required keys": {"type": "object", "properties": P, "not": {"required": ["a", "b"]}},
    "not allOf required": {"properties": P, "not": {"allOf": [{"required": ["a"]}, {"required": ["b"]}]}},
    "not anyOf required": {"type": ["object", "null"], "properties": P,
                           "not": {"anyOf": [{"required": ["a"]}, {"required": ["c"]}]}},
    "not everything, in a property": {"type": "object", "properties": {"a": {"not": {}}, "b": P["b"]}},
    "oneOf of two required keys": {"type": "object", "properties": P, "oneOf": [{"required": ["a"]}, {"required": ["b"]}]},
    "oneOf of three, any type": {"properties": P, "oneOf": [{"required": ["a"]}, {"required": ["b"]},
                                                             {"required": ["c"]}]},
    "oneOf where one branch implies the other": {"properties": P, "oneOf": [{"required": ["a"]},
                                                                             {"required": ["a", "b"]}]},
    "oneOf beside required": {"type": "object", "properties": P, "required": ["c"],
                              "oneOf": [{"required": ["a", "c"]}, {"required": ["b"]}]},
    "oneOf where two keys may be missing": {"properties": P, "oneOf": [{"required": ["a", "b"]},
                                                                        {"required": ["c", "d"]}]},
    "oneOf of one and two keys (composer's repository schema)": {
        "type": "object", "properties": P, "oneOf": [{"required": ["a"]}, {"required": ["b"]},
                                                     {"required": ["c", "d"]}]},
    "oneOf of five overlapping pairs": {"properties": P, "oneOf": [
        {"required": [x, y]} for x, y in [("a", "b"), ("c", "d"), ("a", "c"), ("b", "d"), ("a", "d")]]},
    "minProperties 1 over closed properties": {"properties": P, "additionalProperties": False, "minProperties": 1},
    "all of closed properties, at most all": {"type": "object", "properties": {"a": P["a"], "b": P["b"]},
                                              "additionalProperties": False, "minProperties": 2, "maxProperties": 3},
    "minProperties met by required": {"properties": P, "required": ["a", "b"], "additionalProperties": False,
                                      "minProperties": 2},
    "nested under a property": {"type": "object", "properties": {"x": {"type": "object", "properties": P,
                                                                       "oneOf": [{"required": ["a"]},
                                                                                 {"required": ["d"]}]}}},
}
LEFT_ALONE = {
    "not of a value": {"type": "integer", "not": {"enum": [3]}},
    "minProperties 2 of open properties": {"properties": P, "minProperties": 2},
    "four dependencies (16 branches)": {"properties": P, "dependencies": {k: ["e"] for k in "abcd"}},
}


def _instances() -> list:
    objects = []
    for present in itertools.chain.from_iterable(itertools.combinations("abcde", n) for n in range(6)):
        for values in itertools.product((1, 7), repeat=len(present)):
            objects.append(dict(zip(present, values)))
    return objects + [{"x": obj} for obj in objects[:40]] + [1, "x", [], None, True, {"x": 3}]


INSTANCES = _instances()


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_rewrite_accepts_exactly_what_the_schema_accepts(name):
    schema = CASES[name]
    rewritten = rewrite_presence(schema)
    for keyword in ("dependencies", "dependentRequired", "dependentSchemas", "not", "oneOf", "minProperties",
                    "maxProperties"):
        assert keyword not in str(rewritten), (keyword, rewritten)
    # `dependencies` is draft 4-7's keyword (2019-09 split it): a schema declaring no draft is read as draft 7
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft7Validator)
    before, after = cls(schema), cls(rewritten)
    wrong = [x for x in INSTANCES if before.is_valid(x) != after.is_valid(x)]
    assert not wrong, (rewritten, wrong[:5])
    assert any(before.is_valid(x) for x in INSTANCES) and not all(before.is_valid(x) for x in INSTANCES)


@pytest.mark.parametrize("name", sorted(LEFT_ALONE))
def test_other_shapes_are_left_alone(name):
    assert rewrite_presence(LEFT_ALONE[name]) == LEFT_ALONE[name]


def test_a_oneof_too_large_to_spell_exactly_is_narrowed_soundly():
    """27 exact branches are past the limit: structured/schema/one_of.py (narrowed_one_of) writes one per branch
    instead, each giving up one key of every other, a language inside the oneOf's."""
    schema = {"oneOf": [{"required": list(keys)} for keys in ("fgh", "ijk", "lmn")]}
    rewritten = rewrite_presence(schema)
    assert "oneOf" not in rewritten and len(rewritten["anyOf"]) == 3
    before, after = jsonschema.Draft7Validator(schema), jsonschema.Draft7Validator(rewritten)
    objects = [dict.fromkeys(keys, 1) for n in range(2, 7) for keys in itertools.combinations("fghijklmn", n)]
    assert [x for x in objects + INSTANCES if after.is_valid(x) and not before.is_valid(x)] == []
    assert sum(after.is_valid(x) for x in objects) > 0


def test_the_input_is_not_modified():
    schema = {"properties": P, "not": {"required": ["a"]}, "dependencies": {"a": ["b"]}}
    copy = {"properties": dict(P), "not": {"required": ["a"]}, "dependencies": {"a": ["b"]}}
    rewrite_presence(schema)
    assert schema == copy
