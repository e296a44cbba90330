"""`not` of a type or of a few literals, rewritten into what both grammar backends enforce (issue 11).

Neither backend enforces `not` (xgrammar ignores it, llguidance refuses it). Two common shapes have an
exact or narrower positive form (structured/schema/rewrite.py's rule: narrower only costs completeness):

- `not: {type: T}`: the node's own types (all seven when it names none) minus T. Excluding "number"
  excludes integers too; excluding "integer" alone would leave the non-integral numbers, which no
  type names, so "number" goes as well (narrower).
- `not: {enum: [...]}` / `not: {const: v}` on a string node (or an untyped one: every other type, or,
  beside other keywords, narrowed to strings):
  a pattern matching the non-empty strings outside the set, built from the set's trie: a string is
  outside it when it leaves the trie (a character no listed value continues with, then anything) or
  stops at a trie node where no value ends ("." excludes line breaks: narrower again). Values holding
  '"' or '\\' are left alone: a negated class excluding those lets JSON escapes through in llguidance
  (structured/llguidance.py, escape_gap). On an integer node: the integers between the excluded ones,
  as anyOf of ranges (exact).

Anything else keeps its `not` (and stays refused). A node that already has a `pattern` (strings) or
an `anyOf` (integers) is left alone too: the new constraint would have to be intersected with it.
"""
from __future__ import annotations

from structured.schema.walk import ANNOTATIONS, without_annotations

ALL_TYPES = ("array", "boolean", "integer", "null", "number", "object", "string")
MAX_VALUES = 64
MAX_PATTERN_CHARS = 8192
_META = set("\\^$.|?*+()[]{}/-")


def rewrite_not(node: dict) -> dict:
    """`node` with its `not` spelled positively where the module docstring says how, else `node`."""
    negated = node.get("not")
    if not isinstance(negated, dict):
        return node
    shape = without_annotations(negated)
    rest = {k: v for k, v in node.items() if k != "not"}
    if shape.get("type") in ("string", "integer") and len(shape) == 2 and ({"const", "enum"} & set(shape)):
        # {type: string, enum: L} is the strings of L: the same literals when L holds only strings
        literals = [shape["const"]] if "const" in shape else shape["enum"]
        wanted = str if shape["type"] == "string" else int
        if isinstance(literals, list) and all(type(v) is wanted for v in literals):
            shape = {"enum": literals}
    if set(shape) == {"type"}:
        return _without_types(rest, shape["type"]) or node
    values = [shape["const"]] if set(shape) == {"const"} else shape.get("enum") if set(shape) == {"enum"} else None
    if not isinstance(values, list) or not values or len(values) > MAX_VALUES:
        return node
    types = _types(node)
    if all(isinstance(v, str) for v in values) and types in ({"string"}, set(ALL_TYPES)) and "pattern" not in node:
        pattern = complement_pattern(values)
        if pattern is None:
            return node
        if types == {"string"} or "anyOf" in rest or set(rest) - ANNOTATIONS:
            return {**rest, "type": "string", "pattern": pattern}
        # untyped and alone: every non-string too (exact but for "" and line breaks)
        return {**rest, "anyOf": [{"type": [t for t in ALL_TYPES if t != "string"]},
                                  {"type": "string", "pattern": pattern}]}
    if all(type(v) is int for v in values) and types == {"integer"} and "anyOf" not in node:
        gaps = _integer_gaps(sorted(set(values)), rest)
        return {**rest, "anyOf": gaps} if gaps else node
    return node


def _types(node: dict) -> set[str]:
    t = node.get("type", list(ALL_TYPES))
    return {t} if isinstance(t, str) else set(t) if isinstance(t, list) else set()


def _without_types(rest: dict, excluded) -> dict | None:
    excluded = {excluded} if isinstance(excluded, str) else set(excluded) if isinstance(excluded, list) else None
    if not excluded or not excluded <= set(ALL_TYPES):
        return None
    if excluded & {"number", "integer"}:
        excluded |= {"number", "integer"}
    kept = sorted(_types(rest) - excluded)
    if not kept:
        return None  # nothing left: unsatisfiable as written, for the backend to say
    return {**rest, "type": kept[0] if len(kept) == 1 else kept}


def _escape(ch: str) -> str:
    return "\\" + ch if ch in _META else ch


def _class_escape(ch: str) -> str:
    return "\\" + ch if ch in "\\]^-" else ch


def complement_pattern(values: list[str]) -> str | None:
    """An anchored regex matching exactly the strings not in `values` (None when it would be unsafe or
    too long: see the module docstring)."""
    if any('"' in v or "\\" in v for v in values):
        return None
    trie: dict = {}
    for value in values:
        node = trie
        for ch in value:
            node = node.setdefault(ch, {})
        node[None] = True  # a value ends here
    alternatives: list[str] = []

    def walk(node: dict, prefix: str) -> None:
        children = sorted(k for k in node if k is not None)
        if children:
            alternatives.append(prefix + "[^" + "".join(_class_escape(c) for c in children) + "].*")
        else:
            alternatives.append(prefix + ".+")
        if None not in node and prefix:  # the empty string is left out (narrower): "(...)?" would
            alternatives.append(prefix)   # hit xgrammar's optional-group bug (structured/schema/formats.py)
        for ch in children:
            walk(node[ch], prefix + _escape(ch))

    walk(trie, "")
    pattern = "^(?:" + "|".join(alternatives) + ")$"
    return pattern if len(pattern) <= MAX_PATTERN_CHARS else None


_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")


def _integer_gaps(excluded: list[int], node: dict) -> list[dict]:
    """The ranges between the excluded integers, each within the node's own bounds and saying `type:
    integer` itself: xgrammar writes an anyOf branch as if alone, without the node's type or bounds
    (measured: {"maximum": 4} beside type integer and minimum 0 let it write an object, then 10^26)."""
    gaps = [(None, excluded[0] - 1)] + [(a + 1, b - 1) for a, b in zip(excluded, excluded[1:]) if b - a > 1]
    gaps.append((excluded[-1] + 1, None))
    low, high = node.get("minimum"), node.get("maximum")
    out = []
    for lo, hi in gaps:
        lo = lo if not isinstance(low, (int, float)) else low if lo is None else max(lo, low)
        hi = hi if not isinstance(high, (int, float)) else high if hi is None else min(hi, high)
        if lo is not None and hi is not None and lo > hi:
            continue
        gap = {"type": "integer", **{k: node[k] for k in _BOUNDS if k in node}}
        gap.update({k: v for k, v in (("minimum", lo), ("maximum", hi)) if v is not None})
        out.append(gap)
    return out
