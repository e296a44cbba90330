"""`propertyNames`, rewritten into what both grammar backends enforce (issue 11, enforce or refuse).

Neither backend enforces propertyNames. Three shapes have a positive form:

- a schema every name satisfies (`true`, `{}`, `{type: string}`: names are strings): dropped, exact;
- `{enum: [names]}` (or const): those names only. Each listed name gets the schema it had (its
  `properties` entry, else additionalProperties), every other declared property `false`, and
  additionalProperties `false`. Exact;
- `{pattern: P}` on a node without patternProperties: declared properties whose name P does not match
  become `false`, names P matches get additionalProperties' schema through `patternProperties: {P:
  ...}`, and additionalProperties becomes `false`. Exact when additionalProperties admits anything;
  otherwise narrower (a declared property P matches must then satisfy both schemas).

$refs to such schemas are followed. Anything else keeps its propertyNames (and stays refused).
"""
from __future__ import annotations

import re
from typing import Any

from structured.schema.walk import resolve_ref, without_annotations


def rewrite_property_names(node: dict, root: Any) -> dict:
    """`node` without its propertyNames where the module docstring says how, else `node`."""
    if "propertyNames" not in node:
        return node
    names = resolve_ref(node["propertyNames"], root)
    rest = {k: v for k, v in node.items() if k != "propertyNames"}
    if names is True or (isinstance(names, dict) and without_annotations(names) in ({}, {"type": "string"})):
        return rest
    if not isinstance(names, dict):
        return node
    shape = without_annotations(names)
    if shape.get("type") == "string":  # names are strings: the type adds nothing
        del shape["type"]
    properties = rest.get("properties", {})
    extra = rest.get("additionalProperties", True)
    if not isinstance(properties, dict) or "patternProperties" in rest:
        return node
    if set(shape) in ({"enum"}, {"const"}):
        allowed = [shape["const"]] if "const" in shape else shape["enum"]
        if not isinstance(allowed, list) or not all(isinstance(n, str) for n in allowed):
            return node
        kept = {n: properties.get(n, extra) for n in allowed}
        gone = {n: False for n in properties if n not in kept}
        return {**rest, "properties": {**kept, **gone}, "additionalProperties": False}
    if set(shape) == {"pattern"} and isinstance(shape["pattern"], str):
        try:
            regex = re.compile(shape["pattern"])
        except re.error:
            return node
        fixed = {n: (s if regex.search(n) else False) for n, s in properties.items()}
        return {**rest, "properties": fixed, "patternProperties": {shape["pattern"]: extra},
                "additionalProperties": False}
    return node
