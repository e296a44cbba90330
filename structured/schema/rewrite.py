"""Exact rewrites of JSON Schemas into schemas xgrammar enforces (issue 11, enforce or refuse).

A rewrite here must keep the set of valid instances the same (or, never wider: a narrower language
only costs completeness, never validity). The rewrites:

- finite schemas: a subschema whose instances are drawn from a finite set of literals (its own
  `enum`/`const`, an `allOf` branch with one, an `anyOf`/`oneOf` whose branches are all finite, or
  `type: boolean`/`null`) is replaced by `{"enum": [the literals the WHOLE subschema accepts]}`, each
  literal checked with the jsonschema validator of the root schema's draft ($refs resolve against the
  root). Then `not`, `if`/`then`/`else`, `oneOf`, `uniqueItems`... under such a node no longer need
  the grammar's help: the validator has already decided every candidate.
- string lengths beside a pattern (xgrammar drops minLength/maxLength when a pattern is present):
  `minLength: 0` is dropped (it holds for every string); for a pattern anchored at both ends, bounds
  the pattern's own match lengths already satisfy are dropped, and when exactly one part of the
  pattern varies in length and is a single character repeated (`[a-z]+`, `\\w*`, `.{2,}`), the
  bounds move into that repetition (`^[a-z]+$` with maxLength 8 -> `^[a-z]{1,8}$`). JSON Schema
  counts code points, and one atom matches one code point both in ECMA regexes and in xgrammar.
- `format`: into what both backends enforce, or dropped when no draft defines it (structured/schema/formats.py).
- `not` of a type or of a few strings or integers: spelled positively (structured/schema/negation.py).
- `propertyNames` of any string, of listed names or of a pattern: as properties, patternProperties
  and additionalProperties (structured/schema/property_names.py).
- keywords beside a `$ref` in a draft 3-7 schema, which those drafts ignore: dropped; a `$ref` to a
  named anchor ("#name"), which xgrammar does not resolve: the anchor's JSON pointer (structured/schema/anchors.py).
- keywords beside an `anyOf`/`oneOf` (xgrammar drops them): moved into each branch; string and
  number keywords of a node with no `type` (xgrammar drops them too): every type spelled out
  (structured/schema/siblings.py).

"""
from __future__ import annotations

import re
from typing import Any

from structured.schema.anchors import pointer_refs
from structured.schema.conjoin import merge_all_of
from structured.schema.formats import rewrite_format
from structured.schema.literals import MAX_LITERALS, candidates, literal_key, validator_of
from structured.schema.negation import rewrite_not
from structured.schema.property_names import rewrite_property_names
from structured.schema.regex import anchored_alternation, bounded_pattern
from structured.schema.siblings import declare_required, distribute, typed
from structured.schema.walk import ANNOTATIONS, map_subschemas

_ENUM_ONLY = frozenset({"enum", "const", "type"})


def _finite_enum(node: dict, root: Any, validator) -> dict | bool | None:
    """`{"enum": [...]}` equal to `node`, False where no value satisfies it, or None (not finite, too
    many literals, or not decidable)."""
    plain = not (set(node) - ANNOTATIONS - _ENUM_ONLY)
    if plain and not ("type" in node and ("enum" in node or "const" in node)):
        return None  # already plain: nothing the grammar cannot enforce
    values = candidates(node, root)
    if values is None or len(values) > MAX_LITERALS:
        return None
    checker = validator.evolve(schema=node)
    kept, seen = [], set()
    try:
        for value in values:
            key = literal_key(value)
            if key not in seen and checker.is_valid(value):
                seen.add(key)
                kept.append(value)
    except Exception:  # noqa: BLE001 - undecidable here (a bad $ref, an odd regex, recursion): keep it
        return None
    if plain and len(kept) == len(values):
        return None  # every literal has the type: the node is fine as it is
    if not kept:
        # A schema bug (`{"type": "object", "enum": ["A"]}`): xgrammar would write the enum and ignore the
        # type. False says what it means; the compiler then refuses it, naming the empty subschema.
        return False
    annotations = {k: v for k, v in node.items() if k in ANNOTATIONS and k not in ("$id", "id", "$schema")}
    return {**annotations, "enum": kept}


def _lengths_into_pattern(node: dict) -> dict:
    """`node` with minLength/maxLength folded into its pattern where that is exact (module docstring)."""
    if not isinstance(node.get("pattern"), str):
        return node
    joined = anchored_alternation(node["pattern"])
    if joined is not None:
        node = {k: (joined if k == "pattern" else v) for k, v in node.items()}
    if not ({"minLength", "maxLength"} & set(node)):
        return node
    node = dict(node)
    if node.get("minLength") == 0:
        del node["minLength"]
    lo, hi = node.get("minLength", 0), node.get("maxLength")
    if not (isinstance(lo, int) and (hi is None or isinstance(hi, int))) or isinstance(lo, bool):
        return node
    if "minLength" not in node and "maxLength" not in node:
        return node
    pattern = bounded_pattern(node["pattern"], lo, hi)
    if pattern is None:
        return node
    return {k: (pattern if k == "pattern" else v) for k, v in node.items() if k not in ("minLength", "maxLength")}


_REF_OVERRIDES = re.compile(r"json-schema\.org/draft-0[3-7]/schema")


def _ref_overrides_siblings(root: Any) -> bool:
    """Up to draft 7, "$ref" stands alone: keywords beside it are ignored (2019-09 made them apply)."""
    return isinstance(root.get("$schema"), str) and _REF_OVERRIDES.search(root["$schema"]) is not None


def _rewrite(node: Any, root: Any, validator, is_root: bool, expanding: frozenset = frozenset(),
             negated: bool = False) -> Any:
    """`node` rewritten (module docstring); `negated`: it is a `not`'s subschema or one of its branches."""
    if not isinstance(node, dict):
        return node
    if "$ref" in node and not is_root and _ref_overrides_siblings(root):
        # what the draft ignores, a backend might apply (llguidance refuses a circular $ref beside keywords)
        node = {k: v for k, v in node.items() if k == "$ref" or k in ANNOTATIONS - {"$schema"}}
    base = node.get("$id", node.get("id"))
    inner_id = not is_root and isinstance(base, str) and not base.startswith("#")  # it moves the ref base
    if not inner_id:
        finite = _finite_enum(node, root, validator)
        if finite is not None:
            return finite
    if "allOf" in node and not inner_id:
        merged = merge_all_of(node, root, expanding)
        if merged is not None:
            node, expanding = merged
    if "$ref" not in node:  # keywords beside a $ref mean different things in different drafts: left alone
        node, expanding = distribute(node, root, expanding)
        node = rewrite_property_names(rewrite_format(rewrite_not(node)), root)
        node, expanding = distribute(node, root, expanding)  # `not` of integers writes an anyOf of ranges
        node = typed(node) if negated else declare_required(typed(node))
    node = _lengths_into_pattern(node)

    def subschema(sub: Any, keyword: str) -> Any:
        branch = keyword == "not" or (negated and keyword in ("anyOf", "allOf", "oneOf"))
        return _rewrite(sub, root, validator, False, expanding, branch)

    return map_subschemas(node, subschema)


def rewrite(schema: Any) -> Any:
    """An equivalent schema with finite subschemas spelled as enums (see the module docstring); the
    input is not modified, key order is kept (the grammar generates properties in declared order)."""
    if not isinstance(schema, dict):
        return schema
    schema = pointer_refs(schema)
    try:
        validator = validator_of(schema)
    except Exception:  # noqa: BLE001 - a schema jsonschema cannot load: the compiler will say why
        return schema
    return _rewrite(schema, schema, validator, True)
