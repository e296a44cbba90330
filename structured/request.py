"""Structured output: grammars compiled by xgrammar (or llguidance), one matcher per request, token
masks per step.

`StructuredOutput` is what a user asks for (a JSON Schema, any JSON object, a regex, a grammar in
GBNF-like EBNF or in Lark, a choice of strings, or an xgrammar structural tag: free text with tagged,
schema-constrained regions, which is how tool calls are constrained). Its `plan` names the backend:
xgrammar for everything, except a Lark grammar and a JSON schema with a keyword xgrammar would not
enforce (structured/schema/support.py), which go to llguidance (structured/llguidance.py); such a schema
is refused only if llguidance cannot enforce it either.
`GrammarCompiler` turns it into the backend's compiled grammar, cached by a hash of backend and
canonical source (structured/cache.py, bounded by count and by bytes), off the critical path (a
thread pool, the compile itself in a child process with a time limit) so a request's prompt can run
while its grammar compiles; compiled grammars serialize (`SerializedGrammar`) for the prefill ->
decode hand-over. `GrammarState` (structured/state.py) is one request's matcher: it fills the
request's bitmask row, accepts sampled tokens and rolls back rejected drafts (speculation).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import cached_property

from engine.errors import InvalidRequestError
from structured import llguidance as llg
from structured.schema.rewrite import rewrite
from structured.schema.support import check_enforceable, first_unenforceable, refusal_message

_KINDS = ("json_schema", "regex", "grammar", "choice", "structural_tag")
XGRAMMAR = "xgrammar"
LARK_REFUSAL = "the grammar is in Lark's syntax (rules written `name: ...`), which llguidance compiles, not xgrammar"
BACKENDS = (XGRAMMAR, llg.BACKEND)
__all__ = ["GrammarPlan", "SerializedGrammar", "StructuredOutput", "check_structured_enforceable"]


@dataclass(frozen=True, slots=True)
class GrammarPlan:
    """Which backend compiles a request's grammar, and why xgrammar cannot (the 400's text when no
    backend can)."""

    backend: str  # one of BACKENDS
    refusal: str | None = None  # set when xgrammar would not enforce the schema


@dataclass(frozen=True, slots=True)
class SerializedGrammar:
    """A compiled grammar as a hand-over carries it."""

    backend: str  # one of BACKENDS
    text: str  # xgrammar: CompiledGrammar.serialize_json(); llguidance: the grammar its matcher is built from


@dataclass(frozen=True)
class StructuredOutput:
    """Exactly one of the fields is set."""

    json_schema: dict | str | None = None
    json_object: bool = False  # any JSON object (OpenAI's response_format json_object)
    regex: str | None = None
    # A grammar, read by its syntax: EBNF in xgrammar's dialect (GBNF-like, rules written `name ::= ...`),
    # compiled by xgrammar, or Lark (rules written `name: ...`, from `start`), compiled by llguidance
    grammar: str | None = None
    choice: tuple[str, ...] | None = None
    # xgrammar's structural tag, {"type": "structural_tag", "format": {...}} (a dict or its JSON text):
    # tool calls (router/tools.py builds it from `tools` and `tool_choice`)
    structural_tag: dict | str | None = None
    compact: bool = True  # JSON without free whitespace: one line, ", " and ": " separators

    def __post_init__(self) -> None:
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        set_fields = [n for n in _KINDS if getattr(self, n) is not None]
        set_fields += ["json_object"] if self.json_object else []
        if len(set_fields) != 1:
            raise InvalidRequestError(f"structured output needs exactly one of json_schema, json_object, regex, "
                                      f"grammar, choice, structural_tag; got {set_fields or 'none'}",
                                      param="response_format")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise InvalidRequestError("choice must be a non-empty list of non-empty strings", param="response_format")

    def to_dict(self) -> dict:
        """msgpack-able fields (a hand-over carries them); from_dict reverses it."""
        return {"json_schema": self.json_schema, "json_object": self.json_object, "regex": self.regex,
                "grammar": self.grammar, "choice": list(self.choice) if self.choice is not None else None,
                "structural_tag": self.structural_tag, "compact": self.compact}

    @staticmethod
    def from_dict(fields: dict) -> "StructuredOutput":
        unknown = set(fields) - {*_KINDS, "json_object", "compact"}
        if unknown:
            raise InvalidRequestError(f"unknown structured output field(s) {sorted(unknown)}", param="response_format")
        return StructuredOutput(**fields)

    @property
    def kind(self) -> str:
        for name in _KINDS:
            if getattr(self, name) is not None:
                return name
        return "json_object"

    @property
    def param(self) -> str:
        """The request parameter a bad grammar of this kind is blamed on (HTTP 400)."""
        return "tools" if self.kind == "structural_tag" else "response_format"

    def canonical_source(self) -> str:
        if self.json_schema is not None:
            schema = _parsed(self.json_schema, "json_schema", "response_format")
            # Key order is kept: properties are generated in the order the schema declares them.
            return json.dumps(schema, separators=(",", ":"))
        if self.choice is not None:
            return json.dumps(list(self.choice))
        if self.structural_tag is not None:
            tag = _parsed(self.structural_tag, "structural_tag", "tools")
            if not isinstance(tag, dict):
                raise InvalidRequestError("a structural tag is a JSON object", param="tools")
            return json.dumps(tag, separators=(",", ":"))
        return {"json_object": "", "regex": self.regex, "grammar": self.grammar}[self.kind]

    @property
    def is_lark(self) -> bool:
        """A grammar in Lark's syntax: GBNF's rules are written `name ::= ...`, Lark's never are."""
        return self.grammar is not None and "::=" not in self.grammar

    @property
    def is_compact_json(self) -> bool:
        return self.compact and self.kind in ("json_schema", "json_object")

    @cached_property
    def plan(self) -> GrammarPlan:
        """xgrammar, unless this is a JSON schema with a keyword xgrammar would not enforce (after the
        exact rewrites of structured.schema.rewrite): then llguidance, when installed (computed once)."""
        if self.is_lark:
            return GrammarPlan(llg.BACKEND if llg.available() else XGRAMMAR, LARK_REFUSAL)
        if self.kind != "json_schema":
            return GrammarPlan(XGRAMMAR)
        found = first_unenforceable(rewrite(json.loads(self.canonical_source())))
        if found is None:
            return GrammarPlan(XGRAMMAR)
        # llguidance is set up for compact JSON only (its options mirror xgrammar's compact grammar)
        llguidance = llg.available() and self.compact
        return GrammarPlan(llg.BACKEND if llguidance else XGRAMMAR, refusal_message(found))

    def key(self) -> str:
        """Content hash of backend and source: the cache key here and on the decode side of a hand-over."""
        text = f"{self.plan.backend}\0{self.kind}\0{int(self.compact)}\0{self.canonical_source()}"
        return hashlib.sha256(text.encode()).hexdigest()


def structural_tag_schemas(tag) -> list:
    """The JSON schemas inside a structural tag (its `json_schema` formats), in document order."""
    found = []

    def walk(node) -> None:
        if isinstance(node, dict):
            if node.get("type") == "json_schema" and "json_schema" in node:
                found.append(node["json_schema"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(tag)
    return found


def check_structured_enforceable(structured: StructuredOutput) -> None:
    """Enforce or refuse: InvalidRequestError naming the first schema keyword the grammar would not enforce.
    A schema planned for llguidance passes here: whether llguidance enforces it is decided by its
    compile (in the time-limited compile process), which raises the refusal if it cannot."""
    if structured.kind == "json_schema":
        if structured.plan.refusal is not None and structured.plan.backend == XGRAMMAR:
            raise InvalidRequestError(structured.plan.refusal, param="response_format")
    elif structured.kind == "structural_tag":
        for schema in structural_tag_schemas(json.loads(structured.canonical_source())):
            try:
                check_enforceable(rewrite(schema))
            except InvalidRequestError as e:
                raise InvalidRequestError(e.message, param="tools") from None


def _parsed(value, field: str, param: str):
    """A JSON value given as text or already parsed; InvalidRequestError (on `param`) for bad text."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as e:
        raise InvalidRequestError(f"{field} is not valid JSON: {e}", param=param) from e

