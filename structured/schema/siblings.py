"""Keywords xgrammar drops from a schema object, put where it reads them (issue 11, enforce or refuse).

Measured with xgrammar 0.2.x on the compact JSON grammar (tests/structured/schema/test_siblings.py walks
both backends and judges every output with the jsonschema validator):

- beside `anyOf` / `oneOf`, every other keyword is dropped: `{"type": "object", "properties": {...},
  "additionalProperties": false, "anyOf": [{"required": ["a"]}, {"required": ["b"]}]}` wrote any
  object at all, `{"type": "integer", "anyOf": [...]}` a string. `distribute` moves the siblings
  into each branch, which is exact: S and (B1 or B2) = (S and B1) or (S and B2), and for oneOf,
  exactly one of (S and Bi) holds iff S holds and exactly one Bi does. Each conjunction is
  structured.schema.conjoin's `conjoin` (bounds tighten, types meet, properties conjoin, ...); where
  one is not simple the node is left as it is and structured.schema.support refuses it (sending it to
  llguidance, which reads siblings).
- in an object with no `type`, string and number keywords are dropped (`{"pattern": "^a$"}` wrote
  any string, `{"minimum": 5}` the number 3), while an explicit list of types keeps each type's
  keywords. `typed` gives such a node every JSON type, which is what an untyped node means.
- beside `allOf`, every other keyword is dropped too; structured.schema.conjoin's merge_all_of folds the
  branches into the node where it can, and what stays is refused.
- a `required` name that `properties` does not declare is neither written nor required (the engine's
  strict mode writes declared keys only; `{"required": ["a", "zz"], "additionalProperties": {...}}`
  accepted objects without "zz"). `declare_required` declares it with the schema an undeclared key
  has there (additionalProperties, or any value), which is exact; under additionalProperties false
  no object can hold it and the node stays refused.
"""
from __future__ import annotations

import json
from typing import Any

from structured.schema.conjoin import conjoin
from structured.schema.walk import ANNOTATIONS, map_subschemas, resolve_ref, siblings

ALL_TYPES = ["null", "boolean", "object", "array", "number", "string"]
# keywords that constrain only strings / only numbers (xgrammar drops them without a `type`)
TYPED_KEYWORDS = frozenset({"pattern", "minLength", "maxLength", "format", "minimum", "maximum",
                            "exclusiveMinimum", "exclusiveMaximum", "multipleOf"})
MAX_GROWTH = 16  # a distribution that would write a node this many times larger is not made


def distribute(node: dict, root: Any, expanding: frozenset) -> tuple[dict, frozenset]:
    """(`node` with the keywords beside its anyOf/oneOf moved into each branch, the $refs inlined on
    the way added to `expanding`), or `node` unchanged where a conjunction is not simple (a branch
    $ref already being inlined, a contextual keyword) or would grow too large."""
    for key in ("anyOf", "oneOf"):
        branches = node.get(key)
        if not isinstance(branches, list) or not branches:
            continue
        beside = siblings(node, key)
        if not beside:
            continue
        conjoined, inlined = [], expanding
        for branch in branches:
            if isinstance(branch, dict) and isinstance(branch.get("$ref"), str):
                if branch["$ref"] in expanding:
                    return node, expanding  # a recursive schema: inlining it again would never end
                inlined = inlined | {branch["$ref"]}
            resolved = resolve_ref(branch, root)
            if resolved is False:
                continue  # a branch nothing satisfies
            if resolved is True:
                resolved = {}
            if not isinstance(resolved, dict) or "$id" in resolved or "id" in resolved:
                return node, expanding  # (an inner $id moves the base its own $refs resolve against)
            met = conjoin(beside, {k: v for k, v in resolved.items() if k not in ANNOTATIONS})
            if met is None:
                return node, expanding
            conjoined.append({**{k: v for k, v in resolved.items() if k in ANNOTATIONS - {"$id", "id", "$schema"}},
                              **met})
        if not conjoined:
            return node, expanding  # no branch can hold: left for the compiler to report
        out = {k: v for k, v in node.items() if k not in beside and k != key}
        out[key] = conjoined
        if len(json.dumps(out)) > MAX_GROWTH * len(json.dumps(node)):
            return node, expanding
        return out, inlined
    return node, expanding


def typed(node: dict) -> dict:
    """`node` with every JSON type spelled out when it has string/number keywords and no `type`."""
    if "type" in node or not (TYPED_KEYWORDS & set(node)):
        return node
    if {"enum", "const", "$ref", "anyOf", "oneOf", "allOf"} & set(node):
        return node  # the literals or the branches decide the types
    return {"type": list(ALL_TYPES), **node}


def declare_required(node: dict) -> dict:
    """`node` with each required name it does not declare added to its properties (module docstring).
    Not for a subschema of a `not` (structured.schema.rewrite skips those): there a bare `{"required": [..]}`
    is the shape structured/schema/presence.py spells positively for llguidance."""
    required, properties = node.get("required"), node.get("properties", {})
    if not isinstance(required, list) or not isinstance(properties, dict) or "$ref" in node:
        return node
    missing = [name for name in required if isinstance(name, str) and name not in properties]
    extra = node.get("additionalProperties", True)
    if not missing or extra is False or node.get("patternProperties") or not isinstance(extra, (bool, dict)):
        return node  # nothing to declare, or what an undeclared key may hold depends on more than this
    value = {} if extra is True else extra
    return {**node, "properties": {**properties, **{name: value for name in missing}}}


def without_absent_properties(node: Any) -> Any:
    """For xgrammar only: optional properties whose schema is `false` (the key must be absent) removed
    from `properties`, recursively. xgrammar refuses a `false` subschema outright, and its strict mode
    never writes an undeclared key, so where no additionalProperties / patternProperties could admit
    the key again, leaving it undeclared says the same. (llguidance reads `false` itself and would
    write undeclared keys, so its schema keeps them.) A required `false` property is left: no
    object satisfies it, and the compiler's refusal says so."""
    if not isinstance(node, dict):
        return node
    out = map_subschemas(node, lambda sub, _: without_absent_properties(sub))
    properties, required = out.get("properties"), out.get("required", [])
    if (isinstance(properties, dict) and out.get("additionalProperties", False) is False
            and not out.get("patternProperties") and isinstance(required, list)):
        out["properties"] = {k: v for k, v in properties.items() if v is not False or k in required}
    return out
