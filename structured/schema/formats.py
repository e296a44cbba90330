"""`format`, rewritten into what both grammar backends enforce (issue 11, enforce or refuse).

Measured (xgrammar 0.2.8, llguidance 1.9, random walks through each grammar checked against
jsonschema's format checker: tests/structured/schema/test_formats.py): both enforce duration, email,
hostname, ipv6, uri and uuid. xgrammar's ipv4 admits leading zeros ("052.67.198.2") and its date any
day up to 31 in any month ("1225-02-31"), both rejected by jsonschema; for the other formats xgrammar
writes any string (a leak: jsonschema asserts the standard formats) and llguidance refuses the schema
("Unknown format"). So, before either backend sees the schema:

- a standard format neither enforces becomes a format or pattern whose strings are all valid for it:
  exact where the format is a regular language (json-pointer, relative-json-pointer without the
  2020-12 index offsets), otherwise a narrower one (every email is an idn-email, every URI an IRI;
  uri-reference, uri-template, hostnames, regex and CSS colours get a conservative subset). Narrower
  only costs completeness, never validity (structured/schema/rewrite.py's rule);
- a format no JSON Schema draft defines (OpenAPI's int32/int64/byte/password, "color-hex",
  "semver", ...) is an annotation: the specification says unknown formats never fail validation, and
  jsonschema's FormatChecker ignores them. It is dropped, so it no longer refuses the schema;
- draft 3's phone, style and utc-millisec are defined but asserted by no validator: annotations too.

A node that has a `pattern` beside a format it does not enforce keeps its format (two patterns cannot
be merged into one regex without lookarounds): structured/schema/support.py then refuses it for xgrammar
and llguidance refuses it in turn, with a 400 naming the format.
"""
from __future__ import annotations

# Formats both backends enforce (measured: tests/structured/schema/test_formats.py).
ENFORCED = frozenset({"duration", "email", "hostname", "ipv6", "uri", "uuid"})

# Hostname labels that start with a letter, hyphens single and inside, at most 62 characters, at most
# four labels (so at most 251 in all): valid for RFC 1123/952 host names and for IDNA (no "--" at
# positions 3-4, no label of digits only).
_LABEL = r"[a-z][a-z0-9]{0,13}(?:-[a-z0-9]{1,15}){0,3}"
HOSTNAME = rf"^{_LABEL}(?:\.{_LABEL}){{0,3}}$"
# RFC 3986 URI-reference, built only from unreserved characters (and = & in the query): an optional
# scheme, an optional //host, non-empty path segments (so a relative path never starts with "//" and
# its first segment has no ":"), a query and a fragment.
_UNRESERVED = r"A-Za-z0-9._~"  # and "-", last in each class
URI_REFERENCE = (rf"^(?:[a-z][a-z0-9+.-]*:)?(?://[a-z0-9.-]*)?(?:/?[{_UNRESERVED}-]+)*/?"
                 rf"(?:\?[{_UNRESERVED}=&-]*)?(?:#[{_UNRESERVED}-]*)?$")
# RFC 6570: literals from the allowed set and simple {var} expressions.
URI_TEMPLATE = r"^(?:[A-Za-z0-9._~/:?#=&-]|\{[A-Za-z0-9_]{1,32}\})*$"
# RFC 6901, exact. [^/~] excludes neither '"' nor '\\', so no JSON escape slips through it
# (structured/llguidance.py, escape_gap).
_TOKEN = r"(?:[^/~]|~[01])*"
JSON_POINTER = rf"^(?:/{_TOKEN})*$"
RELATIVE_JSON_POINTER = rf"^(?:0|[1-9][0-9]*)(?:#|(?:/{_TOKEN})*)$"
# Regexes that are valid in ECMA 262 and Python alike: optional anchors at the ends around literal
# characters and escaped metacharacters. Positive classes only (a negated class excluding "\\" lets
# JSON escapes through in llguidance).
LITERAL_REGEX = r"^\^?(?:[A-Za-z0-9 _.,:;!@#%&=<>'/-]|\\[\\.^$|?*+()\[\]{}])*\$?$"
CSS_COLOR = r"^#[0-9a-f]{6}$"
# Exact: dotted quads without leading zeros (Python's ipaddress, which jsonschema uses, refuses them).
_OCTET = r"(?:25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"
IPV4 = rf"^(?:{_OCTET}\.){{3}}{_OCTET}$"
# Exact RFC 3339 full-date for years 0001-9999 (datetime.date, which jsonschema uses, has no year 0):
# days 01-28 in any month, 29-30 in all but February, 31 in the long months, February 29 in leap years.
_YEAR = r"(?:[1-9][0-9]{3}|0[1-9][0-9]{2}|00[1-9][0-9]|000[1-9])"
_LEAP = r"(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)"
_DATE = (rf"(?:{_YEAR}-(?:(?:0[1-9]|1[0-2])-(?:0[1-9]|1[0-9]|2[0-8])|(?:0[13-9]|1[0-2])-(?:29|30)"
         rf"|(?:0[13578]|1[02])-31)|{_LEAP}-02-29)")
# RFC 3339 full-time, narrower: no leap second, no fraction, upper-case Z. (xgrammar 0.2.8 drops the
# leading "." of an optional "(\.[0-9]+)?": bench/results/structured_faithfulness_cpu.md, o58443.)
_TIME = r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
DATE, TIME, DATE_TIME = f"^{_DATE}$", f"^{_TIME}$", f"^{_DATE}T{_TIME}$"

# Standard format -> the narrower constraint that replaces it.
REPLACEMENTS: dict[str, dict] = {
    "idn-email": {"format": "email"},
    "iri": {"format": "uri"},
    "ipv4": {"pattern": IPV4},
    "ip-address": {"pattern": IPV4},  # draft 3's name
    "date": {"pattern": DATE},
    "time": {"pattern": TIME},
    "date-time": {"pattern": DATE_TIME},
    "idn-hostname": {"pattern": HOSTNAME},
    "host-name": {"pattern": HOSTNAME},  # draft 3's name
    "uri-reference": {"pattern": URI_REFERENCE},
    "iri-reference": {"pattern": URI_REFERENCE},
    "uri-template": {"pattern": URI_TEMPLATE},
    "json-pointer": {"pattern": JSON_POINTER},
    "relative-json-pointer": {"pattern": RELATIVE_JSON_POINTER},
    "regex": {"pattern": LITERAL_REGEX},
    "color": {"pattern": CSS_COLOR},  # draft 3
}
DRAFT3_UNASSERTED = frozenset({"phone", "style", "utc-millisec"})
STANDARD = ENFORCED | frozenset(REPLACEMENTS) | DRAFT3_UNASSERTED


def rewrite_format(node: dict) -> dict:
    """`node` with its `format` replaced as the module docstring says (a new dict when it changes)."""
    value = node.get("format")
    if not isinstance(value, str) or value in ENFORCED:
        return node
    if value not in STANDARD or value in DRAFT3_UNASSERTED:
        return {k: v for k, v in node.items() if k != "format"}
    replacement = REPLACEMENTS[value]
    if "pattern" in replacement and "pattern" in node:
        return node  # refused later: see the module docstring
    out = {}
    for key, v in node.items():
        if key == "format":
            out.update(replacement)
        else:
            out[key] = v
    return out


def unenforced_format(value) -> str | None:
    """Why a `format` left after rewrite_format is not enforced, or None."""
    if isinstance(value, str) and value in STANDARD and value not in ENFORCED:
        return f"format {value!r} beside a pattern is not enforced"
    return None
