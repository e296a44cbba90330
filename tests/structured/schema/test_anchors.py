"""structured/schema/anchors.py: $refs to named anchors become JSON pointers (exact: the jsonschema validator
gives the same verdicts before and after); a $ref that stays non-local is refused."""
from __future__ import annotations

import jsonschema

from structured.schema.anchors import pointer_refs
from structured.schema.rewrite import rewrite
from structured.schema.support import first_unenforceable

# JSONSchemaBench Github_medium o35905's shape (draft 4 "id" anchors), and 2019-09's $anchor
DRAFT4 = {"$schema": "http://json-schema.org/draft-04/schema#",
          "definitions": {"prio": {"id": "#prio", "type": "integer", "minimum": 0},
                          "rule": {"id": "#rule", "type": "object", "properties": {"priority": {"$ref": "#prio"}}}},
          "type": "object", "properties": {"a": {"$ref": "#rule"}, "b": {"$ref": "#prio"}}}
ANCHOR = {"$schema": "https://json-schema.org/draft/2020-12/schema",
          "$defs": {"n": {"$anchor": "n", "type": "string", "enum": ["x", "y"]}},
          "type": "object", "properties": {"n": {"$ref": "#n"}}}
POOL = [{}, {"a": {"priority": -1}}, {"a": {"priority": 2}}, {"b": -3}, {"b": 3}, {"b": "s"}, {"n": "x"},
        {"n": "z"}, {"n": 1}, {"a": 1}]


def _validator(schema):
    return jsonschema.validators.validator_for(schema)(schema)


def test_anchor_refs_become_pointers_with_the_same_verdicts():
    for schema in (DRAFT4, ANCHOR):
        out = rewrite(schema)
        assert first_unenforceable(out) is None
        before, after = _validator(schema), _validator(out)
        assert [x for x in POOL if before.is_valid(x) != after.is_valid(x)] == []
    assert pointer_refs(DRAFT4)["properties"]["b"] == {"$ref": "#/definitions/prio"}
    assert pointer_refs(ANCHOR)["properties"]["n"] == {"$ref": "#/$defs/n"}


def test_refs_that_stay_non_local_are_refused():
    for ref in ("#nowhere", "http://json-schema.org/draft-04/schema#", "other.json#/a"):
        found = first_unenforceable(rewrite({"type": "object", "properties": {"x": {"$ref": ref}}}))
        assert found is not None and found.keyword == "$ref", ref
