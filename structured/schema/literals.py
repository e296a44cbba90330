"""Finite schemas: `candidates` (a finite superset of what a schema accepts, when one is evident),
checked one literal at a time with the jsonschema validator of the root's draft (`validator_of`).
"""
from __future__ import annotations

import json
from typing import Any

import jsonschema

from structured.schema.walk import resolve_ref


MAX_LITERALS = 1024  # larger literal sets are left alone (the validator runs once per literal)


def validator_of(root: Any):
    """The jsonschema validator for `root`'s declared draft (2020-12 when it declares none), with format
    checks on: a literal whose format fails is dropped, which can only narrow the language."""
    cls = jsonschema.validators.validator_for(root, default=jsonschema.Draft202012Validator)
    return cls(root, format_checker=cls.FORMAT_CHECKER)


def literal_key(value: Any) -> str:
    """JSON identity of a literal: 1, 1.0 and true are three different values here (they serialize
    differently, so the grammar must list each)."""
    return json.dumps(value, sort_keys=True)


def candidates(node: Any, root: Any, depth: int = 0) -> list | None:
    """A finite superset of the instances `node` accepts, or None when none is evident."""
    node = resolve_ref(node, root)
    if node is False:
        return []
    if not isinstance(node, dict) or depth > 16:
        return None
    if "const" in node:
        return [node["const"]]
    if isinstance(node.get("enum"), list):
        return list(node["enum"])
    if node.get("type") == "boolean":
        return [True, False]
    if node.get("type") == "null":
        return [None]
    for branch in node.get("allOf", []) if isinstance(node.get("allOf"), list) else []:
        found = candidates(branch, root, depth + 1)
        if found is not None:
            return found
    for key in ("anyOf", "oneOf"):
        branches = node.get(key)
        if isinstance(branches, list) and branches:
            union = []
            for branch in branches:
                found = candidates(branch, root, depth + 1)
                if found is None:
                    break
                union += found
            else:
                return union
    return None
