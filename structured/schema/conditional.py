"""`if`/`then`/`else` on one property, spelled with anyOf for llguidance (issue 11, enforce or refuse).

Neither backend enforces conditionals. `if: I, then: T, else: E` holds exactly when (I and T) or
(not I and E), so the node gets `anyOf: [{allOf: [I, T]}, {allOf: [N, E]}]` (under `allOf` when it
has an anyOf already), where N is "not I" spelled positively. That is possible for the shape schemas
use for it in practice: I says one thing about one property k, `properties: {k: S}`, perhaps with
`required: [k]` and `type: object`, and S is a type or a few literals, whose complement NOT_S
structured/schema/negation.py can spell:

- I without `required`: I holds for non-objects, objects without k, and objects whose k satisfies S;
  N = objects with k whose k satisfies NOT_S ({type: object, required: [k], properties: {k: NOT_S}}),
  or, when I says `type: object`, also every non-object.
- I with `required: [k]`: I holds for non-objects and objects with k satisfying S; N = objects whose k
  is absent or satisfies NOT_S ({type: object, properties: {k: NOT_S}}: `properties` only speaks
  about keys that are present), or, when I says `type: object`, also every non-object.

NOT_S may be narrower than "not S" (structured.schema.negation narrows some complements), so N may be too: the
result is then narrower than the conditional, never wider. A missing `then` or `else` is `true`. Any
other `if` is left alone (and stays refused).
"""
from __future__ import annotations

from typing import Any

from structured.schema.negation import ALL_TYPES, rewrite_not
from structured.schema.walk import without_annotations


def rewrite_conditional(node: dict) -> dict:
    """`node` with its if/then/else as anyOf (module docstring), or `node` when `if` has another shape."""
    if "if" not in node:
        return node
    negation = _negation(node["if"])
    if negation is None:
        return node
    then, otherwise = node.get("then", True), node.get("else", True)
    choice = {"anyOf": [{"allOf": [node["if"], then]}, {"allOf": [negation, otherwise]}]}
    out = {k: v for k, v in node.items() if k not in ("if", "then", "else")}
    if "anyOf" in out:
        out["allOf"] = [*out.get("allOf", []), choice]
    else:
        out["anyOf"] = choice["anyOf"]
    return out


def _negation(condition: Any) -> dict | None:
    if not isinstance(condition, dict):
        return None
    shape = without_annotations(condition)
    properties, required = shape.pop("properties", None), shape.pop("required", [])
    typed = shape.pop("type", None)
    if shape or typed not in (None, "object") or not isinstance(properties, dict) or len(properties) != 1:
        return None
    (key, value), = properties.items()
    if required not in ([], [key]) or not isinstance(value, dict):
        return None
    complement = rewrite_not({"not": value})
    if "not" in complement:
        return None
    objects = ({"type": "object", "required": [key], "properties": {key: complement}} if not required
               else {"type": "object", "properties": {key: complement}})
    if typed != "object":
        return objects
    return {"anyOf": [{"type": [t for t in ALL_TYPES if t != "object"]}, objects]}
