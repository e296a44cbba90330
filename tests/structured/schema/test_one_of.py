"""structured/schema/one_of.py: a oneOf becomes anyOf only where no instance satisfies two branches, and then
accepts exactly what the oneOf accepts (the jsonschema validator as judge); overlapping branches,
including 1 against 1.0 (one JSON number), are left alone."""
from __future__ import annotations

import itertools

import jsonschema
import pytest

from structured.schema.one_of import one_of_as_any_of

KIND = {"type": "object", "properties": {"kind": {"const": "a"}, "n": {"type": "integer"}}, "required": ["kind"]}
DISJOINT = {
    "types": {"oneOf": [{"type": "string"}, {"type": "integer"}, {"type": "object"}]},
    "literals checked by the validator": {"oneOf": [{"enum": [1, 2]}, {"type": "integer", "minimum": 3}]},
    "a discriminator": {"type": "object", "oneOf": [KIND, {**KIND, "properties": {"kind": {"enum": ["b", "c"]}}}]},
    "a discriminator through $ref": {"definitions": {"a": KIND, "b": {**KIND, "properties": {"kind": {"const": "b"}}}},
                                     "oneOf": [{"$ref": "#/definitions/a"}, {"$ref": "#/definitions/b"}]},
    "a required key the other forbids": {"type": "object", "oneOf": [
        {"properties": {"x": {"type": "integer"}}, "required": ["x"]},
        {"properties": {"y": {"type": "integer"}}, "additionalProperties": False}]},
}
OVERLAPPING = {
    "integer within number": {"oneOf": [{"type": "integer"}, {"type": "number"}]},
    "1 and 1.0": {"type": "object", "oneOf": [{**KIND, "properties": {"kind": {"const": 1}}},
                                              {**KIND, "properties": {"kind": {"const": 1.0}}}]},
    "required keys, objects or not": {"oneOf": [{"required": ["x"]}, {"properties": {"y": False}}]},
    "open objects": {"type": "object", "oneOf": [{"properties": {"x": {"type": "integer"}}, "required": ["x"]},
                                                 {"properties": {"y": {"type": "integer"}}, "required": ["y"]}]},
}
VALUES = [None, True, 0, 1, 1.0, 1.5, 2, 3, 7, "a", "b", "c", "", [], [1]]
INSTANCES = VALUES + [dict(zip(keys, values)) for n in range(3) for keys in itertools.combinations(("kind", "n", "x", "y"), n)
                      for values in itertools.product(("a", "b", 1, 1.0), repeat=n)]


@pytest.mark.parametrize("name", sorted(DISJOINT))
def test_disjoint_branches_become_anyof_with_the_same_instances(name):
    schema = DISJOINT[name]
    rewritten = one_of_as_any_of(schema, schema)
    assert "oneOf" not in rewritten and rewritten["anyOf"] == schema["oneOf"]
    before, after = jsonschema.Draft7Validator(schema), jsonschema.Draft7Validator(rewritten)
    assert [x for x in INSTANCES if before.is_valid(x) != after.is_valid(x)] == []


@pytest.mark.parametrize("name", sorted(OVERLAPPING))
def test_overlapping_branches_stay_oneof(name):
    schema = OVERLAPPING[name]
    assert one_of_as_any_of(schema, schema) == schema
    as_any = {("anyOf" if k == "oneOf" else k): v for k, v in schema.items()}
    # and reading them as anyOf would indeed accept something the oneOf rejects
    before, after = jsonschema.Draft7Validator(schema), jsonschema.Draft7Validator(as_any)
    assert any(after.is_valid(x) and not before.is_valid(x) for x in INSTANCES)


def test_xgrammars_disjointness_proof_does_not_tell_1_from_1_0_either():
    """Regression: structured/schema/support.py compared discriminator literals by their JSON text, so a
    oneOf told apart only by 1 and 1.0 was called disjoint (and served as anyOf)."""
    from structured.schema.support import _provably_disjoint

    schema = OVERLAPPING["1 and 1.0"]
    assert not _provably_disjoint(schema["oneOf"], schema, schema)


OBJ = {"type": "object"}
NARROWABLE = {
    "open objects, each requiring its own key": OVERLAPPING["open objects"],
    "closed objects requiring nothing": {"type": "object", "oneOf": [
        {"properties": {"x": {"type": "integer"}}, "additionalProperties": False},
        {"properties": {"y": {"type": "integer"}}, "additionalProperties": False}]},
    "a discriminator nobody requires": {"oneOf": [
        {**OBJ, "properties": {"kind": {"const": "a"}, "n": {"type": "integer"}}},
        {**OBJ, "properties": {"kind": {"enum": ["b", "c"]}, "x": {"type": "string"}}}]},
    "a discriminator one level down": {"oneOf": [
        {**OBJ, "properties": {"n": {**OBJ, "properties": {"kind": {"const": "a"}}, "required": ["kind"]}}},
        {**OBJ, "properties": {"n": {**OBJ, "properties": {"kind": {"const": "b"}}, "required": ["kind"]}}}]},
    "no type: narrowed to objects": {"oneOf": [{"required": ["x"]}, {"required": ["y"]}, {"required": ["kind"]}]},
}


@pytest.mark.parametrize("name", sorted(NARROWABLE))
def test_narrowed_branches_accept_only_what_the_oneof_accepts(name):
    """Narrower, never wider: every instance the anyOf of narrowed branches accepts, the oneOf accepts
    (sound), and the narrowing leaves something to write."""
    from structured.schema.one_of import narrowed_one_of

    schema = NARROWABLE[name]
    narrowed = narrowed_one_of(schema, schema)
    assert "oneOf" not in narrowed and narrowed["anyOf"]
    before, after = jsonschema.Draft7Validator(schema), jsonschema.Draft7Validator(narrowed)
    instances = INSTANCES + [{"n": {"kind": k}} for k in ("a", "b", "c")] + [{"n": {}}, {"x": "s", "kind": "b"}]
    assert [x for x in instances if after.is_valid(x) and not before.is_valid(x)] == []
    assert any(after.is_valid(x) for x in instances)


def test_what_cannot_be_narrowed_is_left_alone():
    from structured.schema.one_of import narrowed_one_of

    for schema in (OVERLAPPING["integer within number"], OVERLAPPING["1 and 1.0"],
                   {"type": "object", "oneOf": [{"properties": {"x": {"type": "integer"}}},
                                                {"properties": {"x": {"type": "number"}}}]}):
        assert narrowed_one_of(schema, schema) == schema


def test_a_branch_with_no_way_out_is_dropped_and_the_rest_stays_sound():
    """{} overlaps every object: it is kept by giving up "x" (which the other branch requires), while
    {required: [x]} has nothing to give up or require against {}: it is never written."""
    from structured.schema.one_of import narrowed_one_of

    schema = {"type": "object", "oneOf": [{}, {"required": ["x"]}]}
    narrowed = narrowed_one_of(schema, schema)
    assert narrowed["anyOf"] == [{"type": "object", "properties": {"x": False}}]
    assert not jsonschema.Draft7Validator(schema).is_valid({"x": 1})
    assert jsonschema.Draft7Validator(schema).is_valid({"y": 1})
