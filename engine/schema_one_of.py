"""oneOf whose branches no instance can satisfy together is anyOf: "exactly one" equals "at least one".

For llguidance, which refuses oneOf unless told to read it as anyOf. The proofs here are about JSON
Schema's meaning only (unlike engine/schema_support.py's, which may also use what xgrammar's grammar
writes): a pair of branches is disjoint when
- the JSON types they admit do not meet;
- one admits only literals, and the validator rejects each of them under the other;
- the instance must be an object (the node or both branches say so) and
  - a property both require (or the node requires) has literal values in each with none in common, or
  - one branch (or the node) requires a key the other forbids (`false`, or not declared under
    additionalProperties: false without patternProperties): every instance of the first lacks nothing
    the second needs absent, so it fails the second; one direction is enough.
"""
from __future__ import annotations

from typing import Any

from engine.schema_support import (_forbids, _literals, _properties, _required, disjoint_by_type_or_literals,
                                   json_value_key)


def _literal_values(branch: dict, root: Any, required: set[str]) -> dict[str, set[str]]:
    return {name: {json_value_key(v) for v in lits} for name, sub in _properties(branch).items()
            if name in required and (lits := _literals(sub, root)) is not None}


def pair_disjoint(a: Any, b: Any, root: Any, parent: dict) -> bool:
    first = disjoint_by_type_or_literals(a, b, root, parent)
    if isinstance(first, bool):
        return first
    a, b = first
    base = _required(parent)
    la = _literal_values(a, root, _required(a) | base)
    lb = _literal_values(b, root, _required(b) | base)
    if any(not (la[name] & lb[name]) for name in set(la) & set(lb)):
        return True
    return (any(_forbids(b, name) for name in _required(a) | base)
            or any(_forbids(a, name) for name in _required(b) | base))


def disjoint(branches: list, root: Any, parent: dict) -> bool:
    return all(pair_disjoint(branches[i], branches[j], root, parent)
               for i in range(len(branches)) for j in range(i + 1, len(branches)))


def one_of_as_any_of(node: dict, root: Any) -> dict:
    """`node` with its oneOf renamed anyOf where the branches are pairwise disjoint (and no anyOf is
    there already), else `node`."""
    branches = node.get("oneOf")
    if not isinstance(branches, list) or not branches or "anyOf" in node:
        return node
    try:
        if not disjoint(branches, root, node):
            return node
    except Exception:  # noqa: BLE001 - a proof that cannot be finished is no proof
        return node
    return {("anyOf" if k == "oneOf" else k): v for k, v in node.items()}
