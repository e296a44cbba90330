"""`$ref`s to named anchors spelled as JSON pointers (issue 11, enforce or refuse).

xgrammar resolves only "#" and "#/..." references: `{"$ref": "#rulePriority"}` (a draft 4-7
location-independent identifier, `"id": "#rulePriority"` on the target; `"$anchor": "rulePriority"`
from 2019-09) drew a warning and then allowed any value (JSONSchemaBench Github_medium o35905 leaked -1
for `"minimum": 0`). `pointer_refs` rewrites each such $ref into the JSON pointer of the subschema that
declares the anchor, which is exact; a $ref still not local after it is refused (structured/schema/support.py).
"""
from __future__ import annotations

from typing import Any

from structured.schema.walk import pointer

_LITERALS = ("enum", "const", "default", "examples", "example")  # values that are data, not schemas


def _anchors(node: Any, parts: tuple, found: dict[str, str]) -> None:
    if isinstance(node, dict):
        for key in ("$id", "id"):
            value = node.get(key)
            if isinstance(value, str) and value.startswith("#") and len(value) > 1 and not value.startswith("#/"):
                found.setdefault(value, pointer(parts))
        if isinstance(node.get("$anchor"), str):
            found.setdefault("#" + node["$anchor"], pointer(parts))
        for key, value in node.items():
            if key not in _LITERALS:
                _anchors(value, parts + (key,), found)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            _anchors(value, parts + (i,), found)


def _replaced(node: Any, anchors: dict[str, str]) -> Any:
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str) and value in anchors:
                out[key] = anchors[value]
            elif key in _LITERALS:
                out[key] = value
            else:
                out[key] = _replaced(value, anchors)
        return out
    if isinstance(node, list):
        return [_replaced(v, anchors) for v in node]
    return node


def pointer_refs(schema: Any) -> Any:
    """`schema` with $refs to named anchors replaced by JSON pointers (the input is not modified)."""
    anchors: dict[str, str] = {}
    _anchors(schema, (), anchors)
    return _replaced(schema, anchors) if anchors else schema
