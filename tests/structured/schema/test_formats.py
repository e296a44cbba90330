"""`format` rewritten into what both backends enforce (structured/schema/formats.py): every string either
backend writes under a rewritten format is valid for the original format, by a reference check written
here from the RFCs (or Python's own regex compiler), never by the patterns under test."""
from __future__ import annotations

import datetime
import ipaddress
import json
import re
import uuid

import idna
import jsonschema
import pytest

from structured import llguidance as llg
from structured.request import StructuredOutput
from structured.schema.formats import ENFORCED, REPLACEMENTS
from structured.schema.rewrite import rewrite
from structured.schema.support import first_unenforceable
from tests.support.grammar import closing_bias, walk_json

EOS = 1

# RFC 3986 appendix A, URI-reference, transcribed from the ABNF (IPv6 literals left out: the patterns
# under test never write "[").
_PCT = r"%[0-9A-Fa-f]{2}"
_UNRES = r"[A-Za-z0-9._~-]"
_SUB = r"[!$&'()*+,;=]"
_PCHAR = rf"(?:{_UNRES}|{_PCT}|{_SUB}|[:@])"
_SEG, _SEG_NZ, _SEG_NZ_NC = rf"{_PCHAR}*", rf"{_PCHAR}+", rf"(?:{_UNRES}|{_PCT}|{_SUB}|@)+"
_AUTH = rf"(?:(?:{_UNRES}|{_PCT}|{_SUB}|:)*@)?(?:{_UNRES}|{_PCT}|{_SUB})*(?::[0-9]*)?"
_ABEMPTY = rf"(?:/{_SEG})*"
_HIER = rf"(?://{_AUTH}{_ABEMPTY}|/(?:{_SEG_NZ}(?:/{_SEG})*)?|{_SEG_NZ}(?:/{_SEG})*|)"
_REL = rf"(?://{_AUTH}{_ABEMPTY}|/(?:{_SEG_NZ}(?:/{_SEG})*)?|{_SEG_NZ_NC}(?:/{_SEG})*|)"
_QF = rf"(?:{_PCHAR}|[/?])*"
RFC3986_URI = re.compile(rf"[A-Za-z][A-Za-z0-9+.-]*:{_HIER}(?:\?{_QF})?(?:#{_QF})?")
RFC3986_REFERENCE = re.compile(rf"(?:[A-Za-z][A-Za-z0-9+.-]*:{_HIER}|{_REL})(?:\?{_QF})?(?:#{_QF})?")
# RFC 3339 appendix A (ISO 8601 durations)
_DUR_TIME = r"T(?:[0-9]+H(?:[0-9]+M(?:[0-9]+S)?)?|[0-9]+M(?:[0-9]+S)?|[0-9]+S)"
_DUR_DATE = rf"(?:[0-9]+D|[0-9]+M(?:[0-9]+D)?|[0-9]+Y(?:[0-9]+M(?:[0-9]+D)?)?)(?:{_DUR_TIME})?"
RFC3339_DURATION = re.compile(rf"P(?:{_DUR_DATE}|{_DUR_TIME}|[0-9]+W)")


def _rfc1123(s: str) -> bool:
    labels = s.split(".")
    return len(s) <= 253 and all(re.fullmatch(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?", x) for x in labels)


def _hostname(s: str) -> bool:  # RFC 1123, IDNA (for idn-hostname), and no label of digits only
    idna.encode(s)  # raises if IDNA rejects it
    return _rfc1123(s) and not any(label.isdigit() for label in s.split("."))


def _date(s: str) -> bool:  # what jsonschema checks (datetime.date) with the shape RFC 3339 requires
    return re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", s) is not None and bool(datetime.date.fromisoformat(s))


def _time(s: str) -> bool:  # RFC 3339 full-time
    m = re.fullmatch(r"([0-9]{2}):([0-9]{2}):([0-9]{2})(\.[0-9]+)?(?:[Zz]|[+-]([0-9]{2}):([0-9]{2}))", s)
    return m is not None and int(m[1]) < 24 and int(m[2]) < 60 and int(m[3]) < 61 and \
        (m[5] is None or (int(m[5]) < 24 and int(m[6]) < 60))


def _date_time(s: str) -> bool:
    date, sep, time = s[:10], s[10:11], s[11:]
    return sep in ("T", "t") and _date(date) and _time(time)


def _json_pointer(s: str) -> bool:  # RFC 6901
    return s == "" or (s.startswith("/") and all(re.fullmatch(r"(?:[^~]|~[01])*", t) for t in s[1:].split("/")))


def _regex(s: str) -> bool:
    re.compile(s)
    return True


REFERENCE = {
    "duration": lambda s: RFC3339_DURATION.fullmatch(s) is not None,
    "email": lambda s: re.fullmatch(r"[^@\s]+@[^@\s]+", s) is not None,
    "hostname": _rfc1123,
    "ipv6": lambda s: isinstance(ipaddress.ip_address(s), ipaddress.IPv6Address),
    "uri": lambda s: RFC3986_URI.fullmatch(s) is not None,
    "uuid": lambda s: str(uuid.UUID(s)) == s.lower(),
    "ipv4": lambda s: isinstance(ipaddress.ip_address(s), ipaddress.IPv4Address),
    "date": _date,
    "time": _time,
    "date-time": _date_time,
    "idn-email": lambda s: re.fullmatch(r"[^@\s]+@[^@\s]+", s) is not None,
    "iri": lambda s: RFC3986_REFERENCE.fullmatch(s) is not None and ":" in s.split("/")[0],
    "ip-address": lambda s: isinstance(ipaddress.ip_address(s), ipaddress.IPv4Address),
    "idn-hostname": _hostname,
    "host-name": _hostname,
    "uri-reference": lambda s: RFC3986_REFERENCE.fullmatch(s) is not None,
    "iri-reference": lambda s: RFC3986_REFERENCE.fullmatch(s) is not None,
    "uri-template": lambda s: re.fullmatch(r"(?:[^\x00-\x20\"'%<>\\^`{|}]|\{[A-Za-z0-9_]+\})*", s) is not None,
    "json-pointer": _json_pointer,
    "relative-json-pointer": lambda s: (m := re.fullmatch(r"(0|[1-9][0-9]*)(.*)", s, re.S)) is not None
    and (m[2] == "#" or _json_pointer(m[2])),
    "regex": _regex,
    "color": lambda s: re.fullmatch(r"#[0-9a-f]{6}", s) is not None,
}


def test_every_format_has_a_reference_check():
    assert set(REFERENCE) == set(REPLACEMENTS) | ENFORCED


def test_rewrite_replaces_drops_or_keeps():
    schema = {"type": "object", "properties": {
        "a": {"type": "string", "format": "uri-reference", "maxLength": 40},
        "b": {"type": "string", "format": "idn-email"},
        "c": {"type": "integer", "format": "int64"},  # OpenAPI's: no draft defines it
        "d": {"type": "string", "format": "uuid"},
        "e": {"type": "string", "format": "phone"}}}
    props = rewrite(schema)["properties"]
    assert "format" not in props["a"] and props["a"]["maxLength"] == 40 and props["a"]["pattern"].startswith("^")
    assert props["b"] == {"type": "string", "format": "email"}
    assert props["c"] == {"type": "integer"} and props["e"] == {"type": "string"}
    assert props["d"] == schema["properties"]["d"]
    assert first_unenforceable(rewrite({"type": "string", "format": "color-hex"})) is None


def test_a_pattern_beside_an_unenforced_format_is_refused():
    schema = {"type": "string", "pattern": "^a", "format": "uri-reference"}
    found = first_unenforceable(rewrite(schema))
    assert found is not None and found.keyword == "format" and "uri-reference" in found.reason


@pytest.mark.parametrize("fmt", sorted(ENFORCED))
def test_both_backends_enforce_the_formats_left_alone(grammar_compiler, grammar_tokenizer, fmt):
    """The premise of ENFORCED: two words are no value of any of these formats, and neither backend's
    matcher lets it complete."""
    for spec in _specs(fmt):
        state = grammar_compiler.new_state(grammar_compiler.compile(spec), spec)
        ids = grammar_tokenizer.encode(_as_json(spec, "zz z"), add_special_tokens=False)
        assert not (all(state.accept(t) for t in ids) and state.accept(EOS)), (fmt, spec.plan.backend)


@pytest.mark.parametrize("fmt", sorted(set(REPLACEMENTS) | ENFORCED))
def test_what_the_backends_write_is_valid_for_the_original_format(grammar_compiler, grammar_tokenizer, fmt):
    # Random logits, tilted towards the tokens that can end a string, so long formats end in time.
    bias = closing_bias(grammar_tokenizer, '"', 2.0, (EOS,))
    for spec in _specs(fmt):
        for seed in range(6):
            value = walk_json(grammar_compiler, grammar_tokenizer, spec, seed, max_steps=400, bias=bias)
            if spec.plan.backend == llg.BACKEND:
                jsonschema.validate(value, json.loads(spec.canonical_source()))
                value = value["v"]
            assert REFERENCE[fmt](value), (fmt, spec.plan.backend, value)


def _specs(fmt: str) -> list[StructuredOutput]:
    """The format alone (planned for xgrammar) and beside a number multipleOf 0.5 (which xgrammar does
    not enforce, so the schema is planned for llguidance)."""
    plain = StructuredOutput(json_schema={"type": "string", "format": fmt})
    specs = [plain]
    if llg.available():
        specs.append(StructuredOutput(json_schema={
            "type": "object", "properties": {"v": {"type": "string", "format": fmt},
                                             "w": {"type": "number", "multipleOf": 0.5}},
            "required": ["v", "w"], "additionalProperties": False}))
    assert [s.plan.backend for s in specs] == ["xgrammar", "llguidance"][:len(specs)]
    return specs


def _as_json(spec: StructuredOutput, text: str) -> str:
    return json.dumps(text) if spec.plan.backend != llg.BACKEND else json.dumps({"v": text, "w": 1.5})
