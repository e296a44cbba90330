"""How a JSON Schema nests: the one table of keywords whose values are subschemas, the one walker over
them (`subschemas`, `map_subschemas`), and local `$ref`s followed to what they name. Every check and
rewrite in structured/schema walks a schema through here, so a keyword added to the table is seen by all.
"""
from __future__ import annotations

from typing import Any

# Annotations: no effect on validation, never a reason to refuse.
ANNOTATIONS = frozenset({"title", "description", "examples", "example", "$comment", "default", "deprecated",
                         "readOnly", "writeOnly", "$schema", "$id", "id", "markdownDescription", "$anchor"})

# Keywords whose value is a schema (`items` may also be a list of schemas: the tuple form before 2020-12).
SCHEMA_VALUED = ("items", "additionalProperties", "additionalItems", "contains", "propertyNames", "not",
                 "if", "then", "else", "unevaluatedProperties", "unevaluatedItems")
# Keywords whose value is a list of schemas.
SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
# Keywords whose value maps names to schemas (`dependencies`: only its object values are schemas; a list
# there names properties).
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies")


def siblings(node: dict, key: str) -> dict:
    """The keywords beside `node[key]` (an anyOf/oneOf) that constrain instances: not annotations, nor
    definitions (which constrain nothing and must stay where $refs point)."""
    return {k: v for k, v in node.items() if k != key and k not in ANNOTATIONS and k not in ("$defs", "definitions")}


def without_annotations(schema: dict) -> dict:
    """The keywords of `schema` that constrain instances (ANNOTATIONS left out)."""
    return {k: v for k, v in schema.items() if k not in ANNOTATIONS}


def pointer(parts: tuple) -> str:
    return "#" + "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in parts)


def map_subschemas(node: dict, fn) -> dict:
    """A copy of `node` with `fn(subschema, keyword)` in place of every schema nested directly in it
    (where `subschemas` finds them: not in property-name lists, literals or annotations)."""
    out = dict(node)
    for sub, parts in subschemas(node, ()):
        if len(parts) == 1:
            out[parts[0]] = fn(sub, parts[0])
            continue
        keyword, at = parts
        if out[keyword] is node[keyword]:
            out[keyword] = list(node[keyword]) if isinstance(node[keyword], list) else dict(node[keyword])
        out[keyword][at] = fn(sub, keyword)
    return out


def subschemas(node: dict, parts: tuple):
    """(subschema, its path) for every schema nested directly in `node`, in declaration order."""
    for keyword, value in node.items():
        if keyword in ANNOTATIONS:
            continue
        if isinstance(value, list) and (keyword == "items" or keyword in SCHEMA_LISTS):
            yield from ((v, parts + (keyword, i)) for i, v in enumerate(value))
        elif keyword in SCHEMA_VALUED and not isinstance(value, list):
            yield value, parts + (keyword,)
        elif keyword in SCHEMA_MAPS and isinstance(value, dict):
            yield from ((v, parts + (keyword, name)) for name, v in value.items()
                        if keyword != "dependencies" or isinstance(v, dict))


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
