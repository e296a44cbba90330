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
- `format`: into what both backends enforce, or dropped when no draft defines it (engine/schema_formats.py).
- `not` of a type or of a few strings or integers: spelled positively (engine/schema_not.py).
- `propertyNames` of any string, of listed names or of a pattern: as properties, patternProperties
  and additionalProperties (engine/schema_property_names.py).
- keywords beside a `$ref` in a draft 3-7 schema, which those drafts ignore: dropped; a `$ref` to a
  named anchor ("#name"), which xgrammar does not resolve: the anchor's JSON pointer (engine/schema_anchors.py).
- keywords beside an `anyOf`/`oneOf` (xgrammar drops them): moved into each branch; string and
  number keywords of a node with no `type` (xgrammar drops them too): every type spelled out
  (engine/schema_siblings.py).

"""
from __future__ import annotations

import json
import re
import warnings
from typing import Any

import jsonschema

from engine.schema_anchors import pointer_refs
from engine.schema_formats import rewrite_format
from engine.schema_not import rewrite_not
from engine.schema_property_names import rewrite_property_names
from engine.schema_siblings import declare_required, distribute, typed
from engine.schema_support import ANNOTATIONS

MAX_LITERALS = 1024  # larger literal sets are left alone (the validator runs once per literal)
_ENUM_ONLY = frozenset({"enum", "const", "type"})


def validator_of(root: Any):
    """The jsonschema validator for `root`'s declared draft (2020-12 when it declares none), with format
    checks on: a literal whose format fails is dropped, which can only narrow the language."""
    cls = jsonschema.validators.validator_for(root, default=jsonschema.Draft202012Validator)
    return cls(root, format_checker=cls.FORMAT_CHECKER)


def literal_key(value: Any) -> str:
    """JSON identity of a literal: 1, 1.0 and true are three different values here (they serialize
    differently, so the grammar must list each)."""
    return json.dumps(value, sort_keys=True)


UNRESOLVED = object()  # what `follow_pointer` returns for a pointer that names nothing


def follow_pointer(root: Any, ref: str) -> Any:
    """The node a local JSON pointer ("#/a/b", with ~0 / ~1 escapes) names in `root`, or UNRESOLVED."""
    target = root
    for part in filter(None, ref[1:].split("/")):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(target, dict) and part in target:
            target = target[part]
        elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
            target = target[int(part)]
        else:
            return UNRESOLVED
    return target


def resolve_ref(node: Any, root: Any, depth: int = 0) -> Any:
    """`node` with local "#/..." $refs followed; None (unknown) for a $ref beside other keywords, whose
    meaning depends on the draft (drafts up to 7 ignore the siblings), or one that does not resolve."""
    while isinstance(node, dict) and "$ref" in node:
        ref = node["$ref"]
        if set(node) - ANNOTATIONS - {"$ref"} or not isinstance(ref, str) or not ref.startswith("#") or depth >= 16:
            return None
        target = follow_pointer(root, ref)
        if target is UNRESOLVED:
            return None
        node, depth = target, depth + 1
    return node


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


_QUANTIFIER = re.compile(r"(\*|\+|\?|\{\d+(?:,\d*)?\})\??")


def _width(regex: str) -> tuple[int, int] | None:
    """(min, max) code points a regex matches (max 2**31 - 1 or more for unbounded), or None."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # "possible nested set": [[ in ECMA classes
            lo, hi = re._parser.parse(regex).getwidth()  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - Python cannot parse it: no claim about it
        return None
    return lo, hi


def _atoms(body: str) -> list[tuple[str, str]] | None:
    """`body` split into (atom, quantifier) at the top level, or None where it has a top-level `|`."""
    out, i = [], 0
    while i < len(body):
        ch = body[i]
        if ch == "|":
            return None
        if ch == "\\":
            j = i + 2
        elif ch == "[":
            j = i + 1
            j += body[j] == "^" if j < len(body) else 0
            j += body[j] == "]" if j < len(body) else 0
            while j < len(body) and body[j] != "]":
                j += 2 if body[j] == "\\" else 1
            j += 1
        elif ch == "(":
            depth, j = 0, i
            while j < len(body):
                if body[j] == "\\":
                    j += 2
                    continue
                depth += body[j] == "("
                depth -= body[j] == ")"
                j += 1
                if depth == 0:
                    break
        else:
            j = i + 1
        if j > len(body):
            return None
        q = _QUANTIFIER.match(body, j)
        k = q.end() if q else j
        out.append((body[i:j], body[j:k]))
        i = k
    return out


def _group_alternatives(body: str) -> list[str] | None:
    """The alternatives of a body that is one group `(a|b)` / `(?:a|b)` with a `|` at its top, else None."""
    atoms = _atoms(body)
    if atoms is None or len(atoms) != 1 or atoms[0][1] or not atoms[0][0].startswith("("):
        return None
    inner = atoms[0][0][3:-1] if atoms[0][0].startswith("(?:") else atoms[0][0][1:-1]
    if inner.startswith("?"):
        return None
    parts = _split_top(inner)
    return parts if len(parts) > 1 else None


def bounded_pattern(pattern: str, min_length: int, max_length: int | None) -> str | None:
    """A regex equal to `pattern` (anchored ^...$) restricted to lengths [min_length, max_length] with
    no length keywords needed, or None where this cannot be written simply."""
    from engine.schema_support import _regex_problem

    if not (pattern.startswith("^") and pattern.endswith("$") and not pattern.endswith("\\$")):
        return None
    if _regex_problem(pattern) is not None:
        return None
    body = pattern[1:-1]
    if "[]" in body or "[^]" in body:
        return None  # an empty class in ECMA, a literal ] in Python: the parsers disagree
    alternatives = _group_alternatives(body)
    if alternatives is not None:
        big = max_length if max_length is not None else float("inf")
        kept = []
        for alternative in alternatives:
            width = _width(alternative)
            if width is None:
                return None
            if width[1] < min_length or width[0] > big:
                continue  # no string of this alternative has an allowed length
            bounded = bounded_pattern("^" + alternative + "$", min_length, max_length)
            if bounded is None:
                return None
            kept.append(bounded[1:-1])
        return "^(?:" + "|".join(kept) + ")$" if kept else None
    width = _width(pattern)
    atoms = _atoms(body)
    if width is None or atoms is None or "".join(a + q for a, q in atoms) != body:
        return None
    big = max_length if max_length is not None else float("inf")
    if width[0] >= min_length and width[1] <= big:
        return pattern  # the pattern implies the bounds
    widths = [_width(a + q) for a, q in atoms]
    if any(w is None for w in widths):
        return None
    varying = [i for i, w in enumerate(widths) if w[0] != w[1]]
    if len(varying) != 1:
        return None
    i = varying[0]
    atom, _ = atoms[i]
    if _width(atom) != (1, 1) or atom.startswith("("):
        return None
    fixed = sum(w[0] for j, w in enumerate(widths) if j != i)
    lo = max(widths[i][0], min_length - fixed)
    hi = widths[i][1] if widths[i][1] < 2**31 - 1 else None
    if max_length is not None:
        hi = max_length - fixed if hi is None else min(hi, max_length - fixed)
    if hi is not None and (hi < lo or hi < 0):
        return None  # no string fits: left to the refusal
    repeat = f"{{{lo},{'' if hi is None else hi}}}"
    return "^" + "".join(a + (repeat if j == i else q) for j, (a, q) in enumerate(atoms)) + "$"


def _split_top(regex: str) -> list[str]:
    """`regex` split at its top-level `|` (outside groups and classes)."""
    parts, depth, start, i, in_class = [], 0, 0, 0, False
    while i < len(regex):
        ch = regex[i]
        if ch == "\\":
            i += 2
            continue
        if in_class:
            in_class = ch != "]"
        elif ch == "[":
            in_class = True
        elif ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        elif ch == "|" and depth == 0:
            parts.append(regex[start:i])
            start = i + 1
        i += 1
    parts.append(regex[start:])
    return parts


def anchored_alternation(pattern: str) -> str | None:
    """`^a$|(^b$)` -> `^(?:a|b)$` (and `^$|^b$` -> `^(?:b)?$`): alternatives each anchored at both ends,
    which xgrammar would otherwise read with the inner anchors dropped; None when not of that form."""
    alternatives = _split_top(pattern)
    if len(alternatives) < 2:
        return None
    inner = []
    for alternative in alternatives:
        atoms = _atoms(alternative)
        if atoms is not None and len(atoms) == 1 and not atoms[0][1] and alternative.startswith("(") \
                and not alternative.startswith("(?"):
            alternative = alternative[1:-1]  # one plain group around the whole alternative
        if not (alternative.startswith("^") and alternative.endswith("$") and not alternative.endswith("\\$")):
            return None
        body = alternative[1:-1]
        from engine.schema_support import _regex_problem

        if "|" in _split_top(body)[0] or len(_split_top(body)) > 1 or _regex_problem("^" + body + "$") is not None:
            return None
        inner.append(body)
    nonempty = [b for b in inner if b]
    if not nonempty:
        return "^$"
    group = "(?:" + "|".join(nonempty) + ")"
    return "^" + group + ("?" if len(nonempty) < len(inner) else "") + "$"


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


def _conjoin(a: dict, b: dict) -> dict | None:
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
                met = _conjoin(out[key], value)
                if met is None:
                    return None
                out[key] = met
            else:
                merged = dict(out[key])
                for name, sub in value.items():
                    if name in merged and merged[name] != sub:
                        if not (isinstance(merged[name], dict) and isinstance(sub, dict)):
                            return None
                        met = _conjoin(merged[name], sub)
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
    """(`node` with its allOf folded into it (see _conjoin), the $refs inlined on the way), or None where
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
        merged = _conjoin(merged, branch)
        if merged is None:
            return None
    return {**kept, **merged}, expanding


_SCHEMA_VALUED = ("items", "additionalProperties", "additionalItems", "contains", "propertyNames", "not",
                  "if", "then", "else", "unevaluatedProperties", "unevaluatedItems")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies")


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
    out = {}
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
    for key, value in node.items():
        if key in ANNOTATIONS or key in ("enum", "const"):
            out[key] = value
        elif key in _SCHEMA_VALUED and isinstance(value, dict):
            out[key] = _rewrite(value, root, validator, False, expanding, key == "not")
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            branches = negated and key in ("anyOf", "allOf", "oneOf")
            out[key] = [_rewrite(v, root, validator, False, expanding, branches) for v in value]
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: _rewrite(v, root, validator, False, expanding) if isinstance(v, dict) else v
                        for name, v in value.items()}
        else:
            out[key] = value
    return out


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
