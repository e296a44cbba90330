"""A small schema-driven JSON instance generator for the training corpus.

`generate_instances(schema, rng, n)` draws up to n instances from a JSON Schema and keeps only those
that `jsonschema` (with format checking) accepts, so every instance it returns is valid. It covers
what the short real-world schemas of the corpus use: local `$ref`, `allOf`/`anyOf`/`oneOf`, `enum`,
`const`, type lists, object properties with `required`, `additionalProperties`, arrays with tuple or
item schemas and size bounds, numeric bounds and `multipleOf`, string formats and lengths, and simple
`pattern`s (sampled from the parsed regex). Values are drawn with hints from the property name, so
`"email"` gets an address and `"city"` a city. Everything is a pure function of the rng state.
"""
from __future__ import annotations

import random
import string
from typing import Any
from urllib.parse import unquote

import jsonschema

MAX_DEPTH = 6
_WORDS = (
    "alpha bravo river stone cloud maple orbit delta quartz ember cedar harbor summit lumen "
    "atlas nova pixel vector signal beacon canyon meadow falcon willow copper silver garden "
    "market ticket order report status update project sample record event"
).split()
_FIRST = "Alice Bob Carol David Elena Farid Grace Hiro Ines Jonas Kira Liam Maya Noor Omar Priya".split()
_LAST = "Smith Garcia Chen Novak Okafor Silva Tanaka Muller Rossi Kim Haddad Larsen".split()
_CITIES = "Paris Lagos Tokyo Lima Oslo Austin Pune Seoul Quito Cairo Denver Porto".split()
_COUNTRIES = "France Nigeria Japan Peru Norway USA India Korea Ecuador Egypt Canada Portugal".split()
_SENTENCES = (
    "A short description of the item.",
    "Updated after the last review.",
    "Used for testing the service.",
    "The default configuration value.",
    "Created by the nightly job.",
)


class GenerationError(Exception):
    """The generator cannot produce a value for this (sub)schema."""


def _pointer(root: Any, ref: str) -> Any:
    if not ref.startswith("#"):
        raise GenerationError(f"external $ref {ref!r}")
    node = root
    for part in [p for p in ref[1:].split("/") if p]:
        part = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, list):
            node = node[int(part)]
        elif isinstance(node, dict) and part in node:
            node = node[part]
        else:
            raise GenerationError(f"unresolvable $ref {ref!r}")
    return node


def _merge(base: dict, extra: dict) -> dict:
    merged = dict(base)
    for key, value in extra.items():
        if key == "properties" and isinstance(merged.get(key), dict) and isinstance(value, dict):
            merged[key] = {**merged[key], **value}
        elif key == "required" and isinstance(merged.get(key), list) and isinstance(value, list):
            merged[key] = merged[key] + [r for r in value if r not in merged[key]]
        else:
            merged[key] = value
    return merged


class _Sampler:
    def __init__(self, root: Any, rng: random.Random):
        self.root = root
        self.rng = rng

    def value(self, schema: Any, depth: int = 0, name: str = "") -> Any:
        if depth > MAX_DEPTH:
            raise GenerationError("too deep")
        if schema is True or schema == {}:
            return self.scalar(name)
        if schema is False or not isinstance(schema, dict):
            raise GenerationError("schema admits nothing")
        if "$ref" in schema:
            rest = {k: v for k, v in schema.items() if k != "$ref"}
            target = _pointer(self.root, schema["$ref"])
            return self.value(_merge(target, rest) if isinstance(target, dict) else target, depth + 1, name)
        if "allOf" in schema:
            merged = {k: v for k, v in schema.items() if k != "allOf"}
            for part in schema["allOf"]:
                if isinstance(part, dict):
                    if "$ref" in part:
                        part = _pointer(self.root, part["$ref"])
                    merged = _merge(merged, part)
            return self.value(merged, depth + 1, name)
        for key in ("oneOf", "anyOf"):
            if key in schema and schema[key]:
                rest = {k: v for k, v in schema.items() if k != key}
                option = self.rng.choice(schema[key])
                return self.value(_merge(rest, option) if isinstance(option, dict) else option, depth + 1, name)
        if "const" in schema:
            return schema["const"]
        if "enum" in schema and schema["enum"]:
            return self.rng.choice(schema["enum"])
        kind = self.kind(schema)
        if kind == "object":
            return self.object(schema, depth, name)
        if kind == "array":
            return self.array(schema, depth, name)
        if kind == "string":
            return self.string(schema, name)
        if kind in ("integer", "number"):
            return self.number(schema, kind, name)
        if kind == "boolean":
            return self.rng.random() < 0.5
        return None

    def kind(self, schema: dict) -> str:
        kind = schema.get("type")
        if isinstance(kind, list):
            choices = [k for k in kind if k != "null"] or kind
            return self.rng.choice(choices) if self.rng.random() < 0.9 else self.rng.choice(kind)
        if isinstance(kind, str):
            return kind
        if "properties" in schema or "required" in schema or "additionalProperties" in schema:
            return "object"
        if "items" in schema or "prefixItems" in schema:
            return "array"
        if any(k in schema for k in ("minLength", "maxLength", "pattern", "format")):
            return "string"
        if any(k in schema for k in ("minimum", "maximum", "multipleOf")):
            return "number"
        return self.rng.choice(["string", "integer", "boolean"])

    def object(self, schema: dict, depth: int, name: str) -> dict:
        properties = schema.get("properties") or {}
        required = [r for r in schema.get("required", []) if isinstance(r, str)]
        keep = 0.6 if depth < 3 else 0.25
        out: dict[str, Any] = {}
        for key, sub in properties.items():
            if key in required or self.rng.random() < keep:
                out[key] = self.value(sub, depth + 1, key)
        for key in required:
            if key not in out:
                out[key] = self.scalar(key)
        if not out and properties and depth < 3:  # an empty object teaches little
            key = self.rng.choice(sorted(properties))
            out[key] = self.value(properties[key], depth + 1, key)
        extra = schema.get("additionalProperties")
        want = int(schema.get("minProperties", 0))
        if not properties and isinstance(extra, dict) and self.rng.random() < 0.7:
            want = max(want, self.rng.randint(1, 2))
        while len(out) < want and extra is not False:
            key = self.rng.choice(_WORDS) + str(len(out))
            out[key] = self.value(extra if isinstance(extra, dict) else {}, depth + 1, key)
        return out

    def array(self, schema: dict, depth: int, name: str) -> list:
        lo = int(schema.get("minItems", 0))
        hi = int(schema.get("maxItems", lo + 3))
        count = self.rng.randint(lo, max(lo, min(hi, lo + 3)))
        prefix = schema.get("prefixItems")
        items = schema.get("items", {})
        if isinstance(items, list):  # draft-04..07 tuple form
            prefix, items = items, schema.get("additionalItems", {})
        out = []
        for i in range(count):
            sub = prefix[i] if prefix and i < len(prefix) else items
            if sub is False:
                break
            out.append(self.value(sub, depth + 1, name))
        if schema.get("uniqueItems"):
            unique = []
            for item in out:
                if item not in unique:
                    unique.append(item)
            out = unique
        return out

    def string(self, schema: dict, name: str) -> str:
        fmt = schema.get("format")
        if fmt:
            return self.formatted(fmt)
        if "pattern" in schema:
            try:
                return _RegexSampler(self.rng).sample(schema["pattern"])
            except Exception as err:  # unsupported regex constructs: fall back to plain text
                if isinstance(err, RecursionError):
                    raise GenerationError("pattern too deep") from err
        text = self.text_for(name)
        lo, hi = int(schema.get("minLength", 0)), int(schema.get("maxLength", 10**6))
        while len(text) < lo:
            text += self.rng.choice(string.ascii_lowercase)
        return text[:hi]

    def number(self, schema: dict, kind: str, name: str) -> float | int:
        lo, hi = schema.get("minimum"), schema.get("maximum")
        xlo, xhi = schema.get("exclusiveMinimum"), schema.get("exclusiveMaximum")
        if isinstance(xlo, (int, float)) and not isinstance(xlo, bool):
            lo = xlo + (1 if kind == "integer" else 0.5)
        elif xlo is True and lo is not None:
            lo = lo + 1
        if isinstance(xhi, (int, float)) and not isinstance(xhi, bool):
            hi = xhi - (1 if kind == "integer" else 0.5)
        elif xhi is True and hi is not None:
            hi = hi - 1
        lo = 0 if lo is None else lo
        hi = lo + (100 if "year" not in name.lower() else 30) if hi is None else hi
        if "year" in name.lower() and lo == 0:
            lo, hi = 1990, max(hi, 2025)
        step = schema.get("multipleOf")
        if kind == "integer" or self.rng.random() < 0.4:
            value = self.rng.randint(int(-(-lo // 1)), max(int(-(-lo // 1)), int(hi // 1)))
        else:
            value = round(self.rng.uniform(lo, hi), 2)
        if isinstance(step, (int, float)) and step > 0:
            value = step * round(value / step)
            value = int(value) if kind == "integer" or float(value).is_integer() else value
        return value

    def formatted(self, fmt: str) -> str:
        r = self.rng
        day = f"20{r.randint(10, 25)}-{r.randint(1, 12):02d}-{r.randint(1, 28):02d}"
        clock = f"{r.randint(0, 23):02d}:{r.randint(0, 59):02d}:{r.randint(0, 59):02d}"
        table = {
            "date-time": f"{day}T{clock}Z",
            "date": day,
            "time": f"{clock}Z",
            "email": f"{r.choice(_FIRST).lower()}.{r.choice(_LAST).lower()}@example.com",
            "uri": f"https://example.com/{r.choice(_WORDS)}/{r.randint(1, 999)}",
            "uri-reference": f"/{r.choice(_WORDS)}/{r.randint(1, 99)}",
            "url": f"https://www.example.org/{r.choice(_WORDS)}",
            "hostname": f"{r.choice(_WORDS)}.example.net",
            "ipv4": ".".join(str(r.randint(1, 254)) for _ in range(4)),
            "ipv6": "2001:db8::" + format(r.randint(1, 65535), "x"),
            "uuid": "-".join("".join(r.choice("0123456789abcdef") for _ in range(n)) for n in (8, 4, 4, 4, 12)),
        }
        return table[fmt] if fmt in table else self.text_for(fmt)

    def text_for(self, name: str) -> str:
        r, low = self.rng, name.lower()
        if "email" in low:
            return self.formatted("email")
        if low.endswith("url") or low.endswith("uri") or "link" in low or "href" in low:
            return self.formatted("uri")
        if "date" in low:
            return self.formatted("date")
        if "first" in low:
            return r.choice(_FIRST)
        if "last" in low or "surname" in low:
            return r.choice(_LAST)
        if "name" in low or "author" in low or "user" in low:
            return f"{r.choice(_FIRST)} {r.choice(_LAST)}"
        if "city" in low or "location" in low:
            return r.choice(_CITIES)
        if "country" in low:
            return r.choice(_COUNTRIES)
        if "desc" in low or "comment" in low or "message" in low or "note" in low:
            return r.choice(_SENTENCES)
        if low == "id" or low.endswith("id"):
            return f"{r.choice(_WORDS)}-{r.randint(100, 9999)}"
        if "phone" in low:
            return f"+1-555-{r.randint(100, 999)}-{r.randint(1000, 9999)}"
        words = r.randint(1, 2)
        return " ".join(r.choice(_WORDS) for _ in range(words))

    def scalar(self, name: str) -> Any:
        return self.text_for(name) if self.rng.random() < 0.7 else self.rng.randint(0, 100)


class _RegexSampler:
    """Draws a string matching a simple regex by walking Python's parsed pattern."""

    def __init__(self, rng: random.Random):
        self.rng = rng

    def sample(self, pattern: str) -> str:
        from re import _parser  # the stdlib's own regex parser (sre_parse)

        return self.walk(_parser.parse(pattern))

    def walk(self, parsed) -> str:
        from re import _constants as c

        out = []
        for op, arg in parsed:
            if op is c.LITERAL:
                out.append(chr(arg))
            elif op is c.NOT_LITERAL:
                out.append("x" if chr(arg) != "x" else "y")
            elif op is c.ANY:
                out.append(self.rng.choice(string.ascii_letters))
            elif op is c.IN:
                out.append(self.char_class(arg))
            elif op in (c.MAX_REPEAT, c.MIN_REPEAT, c.POSSESSIVE_REPEAT):
                lo, hi, sub = arg
                hi = min(hi, lo + 4)
                out.extend(self.walk(sub) for _ in range(self.rng.randint(lo, hi)))
            elif op is c.SUBPATTERN:
                out.append(self.walk(arg[-1]))
            elif op is c.BRANCH:
                out.append(self.walk(self.rng.choice(arg[1])))
            elif op is c.AT:
                continue
            else:
                raise GenerationError(f"regex op {op}")
        return "".join(out)

    def char_class(self, items) -> str:
        from re import _constants as c

        choices: list[str] = []
        for op, arg in items:
            if op is c.NEGATE:
                return "z"
            if op is c.LITERAL:
                choices.append(chr(arg))
            elif op is c.RANGE:
                lo, hi = arg
                choices.extend(chr(x) for x in range(lo, min(hi, lo + 61) + 1))
            elif op is c.CATEGORY:
                name = str(arg)
                choices.extend("0123456789" if "DIGIT" in name else string.ascii_letters + "_")
        if not choices:
            raise GenerationError("empty character class")
        return self.rng.choice(choices)


def make_validator(schema: Any):
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


def generate_instances(schema: Any, rng: random.Random, n: int, attempts: int = 4) -> list[Any]:
    """Up to n distinct valid instances of `schema` (fewer, possibly none, for hard schemas)."""
    validator = make_validator(schema)
    sampler = _Sampler(schema, rng)
    found: list[Any] = []
    for _ in range(n * attempts):
        if len(found) == n:
            break
        try:
            candidate = sampler.value(schema)
        except (GenerationError, RecursionError, ValueError, IndexError, TypeError, OverflowError):
            continue
        try:
            ok = candidate not in found and validator.is_valid(candidate)
        except Exception:  # a schema the validator itself cannot apply (bad regex, odd keywords)
            return found
        if ok:
            found.append(candidate)
    return found


__all__ = ["GenerationError", "generate_instances", "make_validator"]
