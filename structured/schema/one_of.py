"""oneOf whose branches no instance can satisfy together is anyOf: "exactly one" equals "at least one".

For llguidance, which refuses oneOf unless told to read it as anyOf. The proofs here are about JSON
Schema's meaning only (unlike structured/schema/support.py's, which may also use what xgrammar's grammar
writes): a pair of branches is disjoint when
- the JSON types they admit do not meet;
- one admits only literals, and the validator rejects each of them under the other;
- the instance must be an object (the node or both branches say so) and
  - a property both require (or the node requires) has literal values in each with none in common, or
    values of JSON types that do not meet, or is an object whose schemas are disjoint by these rules, or
  - one branch (or the node) requires a key the other forbids (`false`, or not declared under
    additionalProperties: false without patternProperties): every instance of the first lacks nothing
    the second needs absent, so it fails the second; one direction is enough.
"""
from __future__ import annotations

from typing import Any

from structured.schema.support import (_branch_types, _forbids, _literals, _properties, _required,
                                      disjoint_by_type_or_literals, json_value_key)
from structured.schema.walk import resolve_ref

MAX_DEPTH = 4  # nested objects a disjointness proof looks into
MAX_NARROWED_BRANCHES = 32


def _literal_values(branch: dict, root: Any, required: set[str]) -> dict[str, set[str]]:
    return {name: {json_value_key(v) for v in lits} for name, sub in _properties(branch).items()
            if name in required and (lits := _literals(sub, root)) is not None}


def pair_disjoint(a: Any, b: Any, root: Any, parent: dict, depth: int = 0) -> bool:
    first = disjoint_by_type_or_literals(a, b, root, parent)
    if isinstance(first, bool):
        return first
    a, b = first
    base = _required(parent)
    la = _literal_values(a, root, _required(a) | base)
    lb = _literal_values(b, root, _required(b) | base)
    if any(not (la[name] & lb[name]) for name in set(la) & set(lb)):
        return True
    if any(_values_disjoint(a, b, name, root, depth) for name in (_required(a) | base) & (_required(b) | base)):
        return True
    return (any(_forbids(b, name) for name in _required(a) | base)
            or any(_forbids(a, name) for name in _required(b) | base))


def _values_disjoint(a: dict, b: dict, name: str, root: Any, depth: int) -> bool:
    """No value satisfies both branches' schemas of property `name` (JSON types that do not meet, or,
    for objects, the same argument one level down; at most MAX_DEPTH levels)."""
    pa, pb = _properties(a), _properties(b)
    if name not in pa or name not in pb:
        return False
    ta, tb = _branch_types(pa[name], root), _branch_types(pb[name], root)
    if ta is not None and tb is not None and not (ta & tb):
        return True
    return depth < MAX_DEPTH and pair_disjoint(pa[name], pb[name], root, {}, depth + 1)


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


def narrowed_one_of(node: dict, root: Any) -> dict:
    """A oneOf whose branches may overlap, as anyOf of branches narrowed until no two overlap: a
    language inside the oneOf's (narrower costs completeness, never validity), or `node` unchanged.

    Each branch i that can be an object is narrowed to objects (`type: object`), and for each other
    branch j it is not already disjoint from (pair_disjoint) it either gives up a key that j requires
    and i does not (i's objects lack it, so they fail j), or requires a key i declares and j forbids or
    declares with a schema no value of i's can satisfy (i's objects have it, so they fail j). A branch
    with neither against some j is dropped (never written: still sound, since what is written fails
    it too). Every written instance then satisfies
    its own branch and fails every other: exactly one, as oneOf asks. With no branch left, `node` is
    returned and stays refused. Measured: bench/results/structured_faithfulness_cpu.md."""
    branches = node.get("oneOf")
    if not isinstance(branches, list) or not 2 <= len(branches) <= MAX_NARROWED_BRANCHES or "anyOf" in node:
        return node
    try:
        resolved = [resolve_ref(b, root) for b in branches]
        kept = []
        for i, (a, ra) in enumerate(zip(branches, resolved)):
            types = _branch_types(a, root)
            if not isinstance(ra, dict) or "$id" in ra or (types is not None and "object" not in types):
                continue
            give_up: list[str] = []
            require: list[str] = []
            for j, rb in enumerate(resolved):
                if i == j or pair_disjoint(a, branches[j], root, node):
                    continue
                if not isinstance(rb, dict):
                    break
                lacks = sorted(_required(rb) - _required(ra) - _required(node))
                # keys i may have and j forbids, or whose values cannot satisfy both: having one fails j
                has = sorted(k for k, v in _properties(ra).items()
                             if v is not False and (_forbids(rb, k) or _values_disjoint(ra, rb, k, root, 0)))
                if set(lacks) & set(give_up) or set(has) & set(require):
                    continue
                if lacks:
                    give_up.append(lacks[0])
                elif has:
                    require.append(has[0])
                else:
                    break
            else:
                kept.append(_narrowed(ra, give_up, require))
    except Exception:  # noqa: BLE001 - a proof that cannot be finished is no proof
        return node
    if not kept:
        return node
    return {("anyOf" if k == "oneOf" else k): (kept if k == "oneOf" else v) for k, v in node.items()}


def _narrowed(branch: dict, give_up: list[str], require: list[str]) -> dict:
    """`branch` (resolved: no $ref) for objects only, which lack `give_up` and have `require`."""
    out = {**branch, "type": "object"}
    if give_up:
        out["properties"] = {**_properties(branch), **{k: False for k in give_up}}
    if require:
        out["required"] = sorted(_required(branch) | set(require))
    return out
