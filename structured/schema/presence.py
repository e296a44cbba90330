"""Exact rewrites of key-presence constraints into `anyOf` over which keys are present, for llguidance.

llguidance enforces `anyOf`, `required` and `properties: {k: false}` (k absent) beside a node's other
keywords, but not `dependencies`, `not` or an overlapping `oneOf`. The constraints below only say
which keys an object has, so each is a finite disjunction over key presence, with the same valid
instances (each rewrite states its argument; tests/structured/schema/test_presence.py checks them with
the jsonschema validator on instances of every presence pattern):

- `dependencies` / `dependentRequired` / `dependentSchemas`, `a -> D`: either a is absent, or a and
  D hold: anyOf [{properties: {a: false}}, {required: [a] + D}] (D a schema: {required: [a],
  allOf: [D]}). Vacuous for non-objects, as both branches are. When a is required, only D is left;
  when a can never appear, or D is empty, nothing is. Several dependencies: the branches' product
  (at most 8 branches), a branch that both requires and forbids a key dropped (it is empty).
- `not: {required: R}` (also `not: {allOf: [{required: ..}, ..]}`, the same R): some key of R is
  absent, anyOf over k in R of {properties: {k: false}}; `not: {anyOf: [{required: [a]}, ..]}`:
  every such key is absent. Non-objects satisfy `required`, so `not` rejects them: type object.
- `not: {}` / `not: true`: nothing is valid: the subschema becomes `false`.
- `oneOf` whose branches are only `required` lists R_1..R_n (n >= 2): branch i holds exactly when
  R_i is present and, for every j != i, some key of M_j = R_j minus R_i and the node's own required
  R_0 is absent: one branch {required: R_i, properties: {k_j: false for each j}} per choice of one
  k_j from each M_j (at most 16 branches in all); a branch with some M_j empty can never be the only
  one and is dropped. Non-objects satisfy every branch, so n >= 2 rejects them: type object.

- `minProperties` / `maxProperties` where no undeclared key can appear: see `_property_counts`.

`if`/`then`/`else` on one property becomes anyOf (structured/schema/conditional.py).
A oneOf of other branches becomes anyOf where its branches are provably disjoint, else, for object
branches, anyOf of branches narrowed to be disjoint (structured/schema/one_of.py: narrower, not exact). A node that already has an `anyOf` gets the new disjunction under `allOf` (llguidance intersects);
anything not of these shapes is left as it is (and stays refused).
"""
from __future__ import annotations

import itertools
from typing import Any

from structured.schema.conditional import rewrite_conditional
from structured.schema.one_of import narrowed_one_of, one_of_as_any_of
from structured.schema.walk import ANNOTATIONS, map_subschemas

MAX_BRANCHES = 8


def _plain(node: Any, *keys: str) -> bool:
    """`node` is a dict whose only non-annotation keywords are among `keys`."""
    return isinstance(node, dict) and not (set(node) - ANNOTATIONS - set(keys))


def _required_list(node: dict) -> list[str] | None:
    value = node.get("required", [])
    return value if isinstance(value, list) and all(isinstance(k, str) for k in value) else None


def _absent(key: str) -> dict:
    return {"properties": {key: False}}


def _can_appear(node: dict, key: str) -> bool:
    props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    if key in props:
        return props[key] is not False
    return not (node.get("additionalProperties") is False and not node.get("patternProperties"))


def _objects_only(node: dict) -> dict | None:
    """`node` restricted to objects, or None where its type excludes them or is malformed."""
    t = node.get("type")
    if t is None:
        return {**node, "type": "object"}
    if t == "object":
        return node
    if isinstance(t, list) and "object" in t:
        return {**node, "type": "object"}
    return None


def _with_disjunction(node: dict, branches: list[dict]) -> dict | None:
    """`node` ∧ anyOf(branches), or None where that cannot be written without losing a keyword."""
    if not branches:
        return None  # unsatisfiable: left to the refusal
    if "anyOf" not in node:
        return {**node, "anyOf": branches}
    if "allOf" not in node:
        return {**node, "allOf": [{"anyOf": branches}]}
    if isinstance(node["allOf"], list):
        return {**node, "allOf": node["allOf"] + [{"anyOf": branches}]}
    return None


def _merge_branch(parts: list[dict]) -> dict | None:
    """One branch holding every part (each {properties: {k: false}} or {required: [..], allOf: [..]}),
    or None when it requires a key it forbids (empty)."""
    absent = {k for p in parts for k, v in p.get("properties", {}).items() if v is False}
    required = list(dict.fromkeys(k for p in parts for k in p.get("required", [])))
    if absent & set(required):
        return None
    branch: dict = {}
    if absent:
        branch["properties"] = {k: False for k in sorted(absent)}
    if required:
        branch["required"] = required
    all_of = [s for p in parts for s in p.get("allOf", [])]
    if all_of:
        branch["allOf"] = all_of
    return branch


def _dependencies(node: dict) -> dict:
    keys = [k for k in ("dependencies", "dependentRequired", "dependentSchemas") if k in node]
    if not keys or not all(isinstance(node[k], dict) for k in keys):
        return node
    required = _required_list(node)
    if required is None:
        return node
    out = {k: v for k, v in node.items() if k not in keys}
    choices: list[list[dict]] = []
    for key in keys:
        for name, dep in node[key].items():
            if isinstance(dep, list) and all(isinstance(d, str) for d in dep):
                if not dep or not _can_appear(node, name):
                    continue  # vacuous
                if name in required:
                    required = list(dict.fromkeys(required + dep))
                    continue
                choices.append([_absent(name), {"required": [name] + dep}])
            elif dep is True or _plain(dep):
                continue  # an empty schema: vacuous
            elif isinstance(dep, dict) and key != "dependentRequired":
                if not _can_appear(node, name):
                    continue
                if name in required:
                    if not isinstance(out.get("allOf", []), list):
                        return node
                    out["allOf"] = out.get("allOf", []) + [dep]
                    continue
                choices.append([_absent(name), {"required": [name], "allOf": [dep]}])
            else:
                return node  # malformed, or `false` (a present means invalid: not handled)
    if required:
        out["required"] = required
    if not choices:
        return out
    if 2 ** len(choices) > MAX_BRANCHES:
        return node
    branches = [b for combo in itertools.product(*choices) if (b := _merge_branch(list(combo))) is not None]
    return _with_disjunction(out, branches) or node


def _required_sets(value: Any, key: str) -> list[list[str]] | None:
    """[R, ...] for `{key: [{required: R}, ...]}`-shaped values, None otherwise."""
    if not isinstance(value, list) or not value:
        return None
    sets = []
    for branch in value:
        if not _plain(branch, "required") or _required_list(branch) is None or not branch.get("required"):
            return None
        sets.append(branch["required"])
    return sets


def _not(node: dict) -> Any:
    negated = node.get("not")
    if negated is True or (isinstance(negated, dict) and _plain(negated)):
        return False  # `not` of everything: nothing is valid
    if not isinstance(negated, dict):
        return node
    rest = {k: v for k, v in node.items() if k != "not"}
    if _plain(negated, "required") and _required_list(negated):
        keys = list(dict.fromkeys(negated["required"]))
        some_absent = True
    elif _plain(negated, "allOf") and (sets := _required_sets(negated.get("allOf"), "allOf")):
        keys, some_absent = list(dict.fromkeys(k for s in sets for k in s)), True
    elif _plain(negated, "anyOf") and (sets := _required_sets(negated.get("anyOf"), "anyOf")) \
            and all(len(s) == 1 for s in sets):
        keys, some_absent = [s[0] for s in sets], False
    else:
        return node
    rest = _objects_only(rest)
    if rest is None:
        return node
    if not some_absent or len(keys) == 1:  # every key absent: into the node's own properties
        props = dict(rest.get("properties")) if isinstance(rest.get("properties"), dict) else {}
        if "properties" in rest and not isinstance(rest["properties"], dict):
            return node
        props.update({k: False for k in keys})
        return {**rest, "properties": props}
    return _with_disjunction(rest, [_absent(k) for k in keys]) or node


def _one_of_required(node: dict) -> dict:
    sets = _required_sets(node.get("oneOf"), "oneOf")
    base = _required_list(node)
    if sets is None or len(sets) < 2 or base is None:
        return node
    branches, seen = [], set()
    for i, own in enumerate(sets):
        present = set(own) | set(base)
        missing = [[k for k in dict.fromkeys(other) if k not in present] for j, other in enumerate(sets) if j != i]
        if not all(missing):
            continue  # some branch j holds whenever branch i does: i is never the only one
        # "for every j, one of its missing keys is absent" = any of the choices of one key per j
        for absent in itertools.product(*missing):
            key = (i, frozenset(absent))
            if key not in seen:
                seen.add(key)
                branches.append({"required": list(own), "properties": {k: False for k in dict.fromkeys(absent)}})
            if len(branches) > MAX_BRANCHES * 2:
                return node
    rest = _objects_only({k: v for k, v in node.items() if k != "oneOf"})
    if rest is None:
        return node
    return _with_disjunction(rest, branches) or node


def _property_counts(node: dict) -> dict:
    """min/maxProperties where no undeclared key can appear (additionalProperties false, no
    patternProperties) over declared properties P with required R: maxProperties >= |P| and
    minProperties <= |R| hold for every object; minProperties = |P| is "all of P required"; and
    minProperties 1 is "some key of P present"."""
    props = node.get("properties")
    if node.get("additionalProperties") is not False or node.get("patternProperties") or not isinstance(props, dict):
        return node
    required = _required_list(node)
    low, high = node.get("minProperties"), node.get("maxProperties")
    if required is None or not set(required) <= set(props):
        return node
    out = dict(node)
    if isinstance(high, int) and not isinstance(high, bool) and high >= len(props):
        del out["maxProperties"]
    if isinstance(low, int) and not isinstance(low, bool):
        if low <= len(required):
            del out["minProperties"]
        elif low == len(props):
            del out["minProperties"]
            out["required"] = list(props)
        elif low == 1:
            del out["minProperties"]
            return _with_disjunction(out, [{"required": [k]} for k in props]) or node
    return out


def _presence(node: Any, root: Any) -> Any:
    if not isinstance(node, dict):
        return node
    node = _dependencies(rewrite_conditional(node))
    node = _not(node)
    if not isinstance(node, dict):
        return node
    node = _one_of_required(node)
    node = narrowed_one_of(one_of_as_any_of(node, root), root)
    node = _property_counts(node)
    return map_subschemas(node, lambda sub, _: _presence(sub, root))


def rewrite_presence(schema: Any) -> Any:
    """`schema` with the presence constraints above spelled as anyOf, and oneOfs of disjoint branches
    as anyOf (structured/schema/one_of.py); the input is not modified."""
    return _presence(schema, schema)
