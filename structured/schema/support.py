"""What xgrammar cannot be trusted with: JSON Schema keywords it does not enforce.

Enforce or refuse (issue 11): a completed output that is invalid against its schema must never be
returned as if it were fine. `first_unenforceable` walks a schema and names the first keyword whose
constraint the grammar would not enforce (measured on JSONSchemaBench by bench/structured.py: the
keywords below are those under which the matcher accepted instances the schema rejects); the
compiler refuses such a schema with a 400 before compiling. Pure annotations are ignored.

Compiles it cannot bound in time are the compile worker's (structured/compile_worker.py).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from engine.errors import InvalidRequestError
from structured.schema.formats import ENFORCED, unenforced_format
from structured.schema.literals import candidates, validator_of
from structured.schema.regex import regex_problem
from structured.schema.walk import ANNOTATIONS, pointer, resolve_ref, siblings, subschemas, without_annotations

# Keywords whose constraint xgrammar's JSON-schema grammar does not carry at all (it ignores them),
# so a matcher completes on instances the schema rejects (measured: bench/structured.py). Values: why.
UNENFORCED: dict[str, str] = {
    "not": "negation is ignored",
    "if": "conditionals are ignored", "then": "conditionals are ignored", "else": "conditionals are ignored",
    "dependencies": "property dependencies are ignored",
    "dependentRequired": "property dependencies are ignored",
    "dependentSchemas": "property dependencies are ignored",
    "contains": "contains is ignored", "minContains": "contains is ignored", "maxContains": "contains is ignored",
    "propertyNames": "property name constraints are ignored",
    "unevaluatedProperties": "unevaluated keywords are not tracked",
    "unevaluatedItems": "unevaluated keywords are not tracked",
    "$dynamicRef": "dynamic references are not resolved", "$recursiveRef": "dynamic references are not resolved",
}


@dataclass(frozen=True, slots=True)
class Unenforceable:
    keyword: str
    path: str  # JSON pointer of the keyword, "#/properties/tags/uniqueItems"
    reason: str


def _violation(node: dict, parts: tuple, root: Any) -> Unenforceable | None:
    """The first keyword of one schema object (not its subschemas) that cannot be enforced."""
    for keyword, value in node.items():
        if keyword in ANNOTATIONS:
            continue
        reason = _unenforced(keyword, value, node, root)
        if reason is not None:
            return Unenforceable(keyword, pointer(parts + (keyword,)), reason)
    return None


def _unenforced(keyword: str, value: Any, node: dict, root: Any = None) -> str | None:
    if keyword in UNENFORCED:
        return UNENFORCED[keyword]
    if keyword == "$ref" and isinstance(value, str) and value != "#" and not value.startswith("#/"):
        return "only local JSON-pointer references (\"#/...\") are resolved; this one would allow any value"
    if keyword == "uniqueItems" and value is True:
        return "item uniqueness is not enforced"
    if keyword in ("minProperties", "maxProperties"):
        # enforced on plain objects, not under additionalProperties/nested objects (measured: leaks in
        # JSONSchemaBench Github_hard o4249, JsonSchemaStore resjson)
        return "property counts are not enforced exactly"
    if keyword == "multipleOf" and not (node.get("type") == "integer" and isinstance(value, int)):
        return "multipleOf is enforced only for integers"
    if keyword == "allOf" and isinstance(value, list) and len(value) > 1:
        return "an intersection of several schemas is only approximated"
    if keyword == "required" and isinstance(value, list):
        declared = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        missing = [name for name in value if name not in declared]
        if missing:
            return f"required property {missing[0]!r} is not declared in properties, so it is never written"
    if keyword == "allOf" and isinstance(value, list) and siblings(node, keyword):
        return "keywords beside allOf are ignored (here they could not be merged with its branches)"
    if keyword in ("anyOf", "oneOf") and isinstance(value, list) and siblings(node, keyword):
        return f"keywords beside {keyword} are ignored (here they could not be moved into its branches)"
    if keyword == "oneOf" and isinstance(value, list) and not _provably_disjoint(value, root, node):
        return "oneOf is enforced as anyOf unless its branches are provably disjoint"
    if keyword == "format":
        return unenforced_format(value)
    if keyword == "pattern" and isinstance(value, str):
        if node.get("format") in ENFORCED:
            return "a pattern beside a format: only the format is enforced"
        if "minLength" in node or "maxLength" in node:
            return "a pattern combined with minLength/maxLength drops the length bounds"
        problem = regex_problem(value)
        if problem is not None:
            return problem
    if keyword == "patternProperties" and isinstance(value, dict):
        for regex in value:
            problem = regex_problem(regex)
            if problem is not None:
                return problem
        named = _named_and_matched(node, value)
        if named is not None:
            return (f"property {named!r} is named in properties and matched by patternProperties: only one of "
                    "the two schemas is enforced")
    return None


def _named_and_matched(node: dict, pattern_properties: dict) -> str | None:
    """A property `node` declares whose name a patternProperties regex with a non-trivial schema also
    matches (the instance must then satisfy both; xgrammar checks one), or None."""
    properties = node.get("properties")
    if not isinstance(properties, dict):
        return None
    for regex, schema in pattern_properties.items():
        if schema is True or (isinstance(schema, dict) and not without_annotations(schema)):
            continue
        try:
            compiled = re.compile(regex)
        except re.error:
            compiled = None  # Python cannot read it: assume it matches
        for name in properties:
            if compiled is None or compiled.search(name):
                return name
    return None


def _branch_types(branch: Any, root: Any, depth: int = 0) -> set[str] | None:
    """The JSON types a branch admits (through $refs and nested anyOf/oneOf), or None if unknown."""
    branch = resolve_ref(branch, root)
    if branch is False:
        return set()
    if not isinstance(branch, dict) or depth > 16:
        return None
    t = branch.get("type")
    if isinstance(t, str):
        t = [t]
    if isinstance(t, list) and t:
        types = set(t)
        return types | {"number"} if "integer" in types else types | ({"integer"} if "number" in types else set())
    if "const" in branch:
        return {_json_type(branch["const"])} | ({"number"} if _json_type(branch["const"]) == "integer" else set())
    if isinstance(branch.get("enum"), list) and branch["enum"]:
        return {_json_type(v) for v in branch["enum"]} | (
            {"number"} if any(_json_type(v) == "integer" for v in branch["enum"]) else set())
    for key in ("anyOf", "oneOf"):
        if isinstance(branch.get(key), list) and branch[key]:
            union: set[str] = set()
            for sub in branch[key]:
                types = _branch_types(sub, root, depth + 1)
                if types is None:
                    return None
                union |= types
            return union
    return None


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    return {float: "number", str: "string", list: "array", dict: "object", type(None): "null"}[type(value)]


def json_value_key(value: Any) -> str:
    """JSON equality of literals: 1 and 1.0 are one number (json.dumps would tell them apart)."""
    def norm(v):
        if isinstance(v, float) and v.is_integer():
            return int(v)
        if isinstance(v, dict):
            return {k: norm(x) for k, x in v.items()}
        if isinstance(v, list):
            return [norm(x) for x in v]
        return v
    return json.dumps(norm(value), sort_keys=True)


def _literals(branch: Any, root: Any) -> list | None:
    branch = resolve_ref(branch, root)
    if isinstance(branch, dict) and "const" in branch:
        return [branch["const"]]
    if isinstance(branch, dict) and isinstance(branch.get("enum"), list):
        return branch["enum"]
    return None


def _required(node: Any) -> set[str]:
    required = node.get("required") if isinstance(node, dict) else None
    return {r for r in required if isinstance(r, str)} if isinstance(required, list) else set()


def _properties(node: Any) -> dict:
    return node["properties"] if isinstance(node, dict) and isinstance(node.get("properties"), dict) else {}


def _discriminator(branch: Any, root: Any, parent_required: set[str]) -> dict[str, list]:
    """property -> the literal values a branch requires for it (const/enum on a property the branch or
    the node around the oneOf requires)."""
    required = _required(branch) | parent_required
    return {name: lits for name, sub in _properties(branch).items()
            if name in required and (lits := _literals(sub, root)) is not None}


def _forbids(branch: Any, name: str) -> bool:
    """Whether every object `branch` accepts lacks property `name` (additionalProperties false and
    `name` neither declared nor matched by patternProperties, or the property's schema is false)."""
    props = _properties(branch)
    if name in props:
        return props[name] is False
    return branch.get("additionalProperties") is False and not branch.get("patternProperties")


def _emitted_keys(branch: dict, parent: dict) -> set[str] | None:
    """Every key the grammar can write for an object of this branch (xgrammar's strict mode, which the
    engine compiles with, treats an absent additionalProperties as false): the properties the branch
    and the node around the oneOf declare; None when either admits other keys, or when the branch
    declares no properties or requires one it does not declare (xgrammar then writes keys of its own:
    JSONSchemaBench Github_hard o71321 leaked an object with both branches' required keys)."""
    for node in (branch, parent):
        if node.get("patternProperties") or node.get("additionalProperties", False) is not False \
                or node.get("unevaluatedProperties", False) is not False:
            return None
    if not _properties(branch) or not _required(branch) <= set(_properties(branch)) | set(_properties(parent)):
        return None
    return set(_properties(branch)) | set(_properties(parent)) | _required(parent)


def _excludes(a: dict, b: dict, parent: dict) -> bool:
    """No object the grammar writes for branch `a` satisfies branch `b`: `b` requires a key `a` never
    writes, or `a` (or the node around) requires a key `b` forbids."""
    keys = _emitted_keys(a, parent)
    if keys is not None and _required(b) - keys:
        return True
    return any(_forbids(b, name) for name in _required(a) | _required(parent))


def _finite_excludes(finite: Any, other: Any, root: Any) -> bool:
    """`finite` accepts only literals, and the validator rejects each of them under `other`."""
    values = candidates(finite, root)
    if values is None or len(values) > 256:
        return False
    try:
        checker = validator_of(root).evolve(schema=other)
        return not any(checker.is_valid(v) for v in values)
    except Exception:  # noqa: BLE001 - undecidable here: not proven
        return False


def disjoint_by_type_or_literals(a: Any, b: Any, root: Any, parent: dict) -> bool | tuple[dict, dict]:
    """The first steps of both backends' oneOf proofs: True if the JSON types the branches admit do not meet,
    or one admits only literals the other rejects; False if nothing more can be shown (not both objects);
    else the two branches resolved, for the caller's object-level argument."""
    ta, tb = _branch_types(a, root), _branch_types(b, root)
    if ta is not None and tb is not None and not (ta & tb):
        return True
    if _finite_excludes(a, b, root) or _finite_excludes(b, a, root):
        return True
    a, b = resolve_ref(a, root), resolve_ref(b, root)
    if not isinstance(a, dict) or not isinstance(b, dict):
        return False
    # the rest reasons about objects: the instance must be one (the node's type, or both branches')
    if not (parent.get("type") == "object" or (ta == {"object"} and tb == {"object"})):
        return False
    return a, b


def _pair_disjoint(a: Any, b: Any, root: Any, parent: dict) -> bool:
    first = disjoint_by_type_or_literals(a, b, root, parent)
    if isinstance(first, bool):
        return first
    a, b = first
    da, db = _discriminator(a, root, _required(parent)), _discriminator(b, root, _required(parent))
    for name in set(da) & set(db):
        if not ({json_value_key(v) for v in da[name]} & {json_value_key(v) for v in db[name]}):
            return True
    return _excludes(a, b, parent) and _excludes(b, a, parent)


def _provably_disjoint(branches: list, root: Any = None, parent: dict | None = None) -> bool:
    """No instance the grammar writes can match two branches: cheap sufficient tests only (types,
    literals checked by the validator, a required discriminating property, required keys the other
    branch forbids or never writes), so that "exactly one" equals "at least one" and anyOf is exact."""
    parent = parent or {}
    return all(_pair_disjoint(branches[i], branches[j], root, parent)
               for i in range(len(branches)) for j in range(i + 1, len(branches)))


def first_unenforceable(schema: Any) -> Unenforceable | None:
    """The first keyword (depth first, in declaration order) that xgrammar would not enforce, or None.

    Every subschema is walked, $defs included, whether or not a $ref reaches it: a definition nobody
    references costs a refusal at worst, never a wrong answer."""
    stack = [(schema, ())]
    while stack:
        node, parts = stack.pop()
        if not isinstance(node, dict):
            continue  # true/false schemas and malformed values: the compiler's to judge
        found = _violation(node, parts, schema)
        if found is not None:
            return found
        stack.extend(reversed(list(subschemas(node, parts))))
    return None


def refusal_message(found: Unenforceable) -> str:
    return (f"json_schema keyword {found.keyword!r} at {found.path} cannot be enforced by xgrammar "
            f"({found.reason}); remove it or relax the schema")


def check_enforceable(schema: Any) -> None:
    """Raise InvalidRequestError (HTTP 400, param response_format) naming the first unenforceable keyword."""
    found = first_unenforceable(schema)
    if found is not None:
        raise InvalidRequestError(refusal_message(found), param="response_format")
