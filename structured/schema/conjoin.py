"""One schema for two: `conjoin` meets two schemas keyword by keyword where that is exact, and
`merge_all_of` folds an allOf into its node with it (the rewrite; the siblings distribution).
"""
from __future__ import annotations

from typing import Any

from structured.schema.walk import ANNOTATIONS, resolve_ref


# keywords whose meaning depends on sibling keywords (or, before draft 2019-09, that ignore them): an
# allOf branch holding one is not merged
_CONTEXTUAL = frozenset({"$ref", "$id", "id", "additionalItems", "unevaluatedProperties", "unevaluatedItems",
                         "patternProperties", "if", "then", "else", "minContains", "maxContains", "$dynamicRef",
                         "$recursiveRef", "exclusiveMinimum", "exclusiveMaximum", "allOf"})


_LOWER = ("minimum", "minLength", "minItems", "minProperties")
_UPPER = ("maximum", "maxLength", "maxItems", "maxProperties")
_NUMERIC = frozenset({"integer", "number"})


def _types(node: dict) -> set[str] | None:
    t = node.get("type")
    return None if t is None else ({t} if isinstance(t, str) else set(t) if isinstance(t, list) else None)


def _meet_types(a: set[str] | None, b: set[str] | None) -> set[str] | None:
    if a is None or b is None:
        return a if b is None else b
    met = a & b
    if "integer" in (a | b) and ("number" in a or "number" in b):
        met |= {"integer"} & (a | b)  # number ∩ integer = integer
    return met


def conjoin(a: dict, b: dict) -> dict | None:
    """One schema accepting exactly what both `a` and `b` accept, or None where that is not simple.

    JSON Schema keywords constrain independently, except those in _CONTEXTUAL and additionalProperties
    (which reads its own schema's properties): bounds tighten, types and required lists meet, a
    property in both is the conjunction of its two schemas, and additionalProperties: false keeps only
    the properties its own schema declares (xgrammar's strict mode writes no undeclared key)."""
    for side in (a, b):
        if set(side) & _CONTEXTUAL:
            return None
        extra = side.get("additionalProperties", False)
        if extra is not False and extra is not True:
            return None
    out = dict(a)
    for key, value in b.items():
        if key in ANNOTATIONS:
            out.setdefault(key, value)
        elif key not in out or out[key] == value:
            out[key] = value
        elif key == "type":
            met = _meet_types(_types(a), _types(b))
            if not met:
                return None
            out[key] = sorted(met)
        elif key == "required" and isinstance(value, list) and isinstance(out[key], list):
            out[key] = list(dict.fromkeys(out[key] + value))
        elif key in _LOWER and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (value, out[key])):
            out[key] = max(out[key], value)
        elif key in _UPPER and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (value, out[key])):
            out[key] = min(out[key], value)
        elif key == "additionalProperties":
            out[key] = False if False in (value, out[key]) else True
        elif key in ("properties", "items") and isinstance(value, dict) and isinstance(out[key], dict):
            if key == "items":
                met = conjoin(out[key], value)
                if met is None:
                    return None
                out[key] = met
            else:
                merged = dict(out[key])
                for name, sub in value.items():
                    if name in merged and merged[name] != sub:
                        if not (isinstance(merged[name], dict) and isinstance(sub, dict)):
                            return None
                        met = conjoin(merged[name], sub)
                        if met is None:
                            return None
                        merged[name] = met
                    else:
                        merged[name] = sub
                out[key] = merged
        else:
            return None
    # additionalProperties false on a side: only what that side declares may appear
    for side in (a, b):
        if side.get("additionalProperties") is False:
            declared = side.get("properties", {}) if isinstance(side.get("properties"), dict) else {}
            props = out.get("properties", {}) if isinstance(out.get("properties"), dict) else {}
            if not set(out.get("required", [])) <= set(declared):
                return None
            out["properties"] = {k: v for k, v in props.items() if k in declared}
    return out


def merge_all_of(node: dict, root: Any, expanding: frozenset = frozenset()) -> tuple[dict, frozenset] | None:
    """(`node` with its allOf folded into it (see conjoin), the $refs inlined on the way), or None where
    that is not simple. `expanding`: $refs already inlined above this node; inlining one again would
    unfold a recursive schema forever, so such a merge is not made."""
    branches = node.get("allOf")
    if not isinstance(branches, list) or not branches:
        return None
    # annotations stay on the node (an "id" at the root names the document its "#/..." refs live in)
    kept = {k: v for k, v in node.items() if k in ANNOTATIONS}
    merged = {k: v for k, v in node.items() if k != "allOf" and k not in ANNOTATIONS}
    for branch in branches:
        if isinstance(branch, dict) and isinstance(branch.get("$ref"), str):
            if branch["$ref"] in expanding:
                return None
            expanding = expanding | {branch["$ref"]}
        branch = resolve_ref(branch, root)
        if not isinstance(branch, dict):
            return None
        merged = conjoin(merged, branch)
        if merged is None:
            return None
    return {**kept, **merged}, expanding
