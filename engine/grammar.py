"""Structured output: grammars compiled by xgrammar, one matcher per request, token masks per step.

`StructuredOutput` is what a user asks for (a JSON Schema, any JSON object, a regex, an EBNF grammar,
a choice of strings, or an xgrammar structural tag: free text with tagged, schema-constrained regions,
which is how tool calls are constrained). `GrammarCompiler` turns it into an xgrammar CompiledGrammar,
cached by a hash of its canonical source (engine/grammar_cache.py, bounded by count and by bytes), off
the critical path (a thread pool) so a request's prompt can run while its grammar compiles; compiled
grammars serialize for the prefill -> decode hand-over.
`GrammarState` is one request's matcher: it fills the request's bitmask row, accepts sampled tokens
and rolls back rejected drafts (speculation).
"""
from __future__ import annotations

import hashlib
import json
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from engine.errors import InvalidRequestError
from engine.compile_worker import CompileWorker, WorkerFailed, WorkerTimeout
from engine.grammar_cache import DEFAULT_MAX_CACHE_BYTES, DEFAULT_MAX_CACHED, GrammarCache
from engine.schema_rewrite import rewrite
from engine.schema_support import check_enforceable

try:
    import xgrammar as xgr
except ImportError:  # pragma: no cover - xgrammar is a hard dependency; this keeps the error readable
    xgr = None

DEFAULT_COMPILE_TIMEOUT_S = 5.0
log = logging.getLogger(__name__)
_KINDS = ("json_schema", "regex", "grammar", "choice", "structural_tag")


@dataclass(frozen=True)
class StructuredOutput:
    """Exactly one of the fields is set."""

    json_schema: dict | str | None = None
    json_object: bool = False  # any JSON object (OpenAI's response_format json_object)
    regex: str | None = None
    grammar: str | None = None  # EBNF in xgrammar's dialect (GBNF-like)
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
    def is_compact_json(self) -> bool:
        return self.compact and self.kind in ("json_schema", "json_object")

    def key(self) -> str:
        """Content hash: the cache key here and on the decode side of a hand-over."""
        text = f"{self.kind}\0{int(self.compact)}\0{self.canonical_source()}"
        return hashlib.sha256(text.encode()).hexdigest()


def compile_structured(compiler, structured: StructuredOutput):
    """The xgrammar CompiledGrammar of `structured` on `compiler` (an xgr.GrammarCompiler), no checks:
    compact JSON is one line with ", " and ": " separators (StructuredOutput.compact)."""
    sep = (", ", ": ")
    try:
        if structured.kind == "json_schema":
            return compiler.compile_json_schema(compiled_schema_source(structured), any_whitespace=not structured.compact,
                                                separators=sep if structured.compact else None)
        if structured.kind == "json_object":
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=not structured.compact,
                                                separators=sep if structured.compact else None)
        if structured.kind == "regex":
            return compiler.compile_regex(structured.regex)
        if structured.kind == "choice":
            alternatives = " | ".join(json.dumps(c) for c in structured.choice)
            return compiler.compile_grammar(f"root ::= {alternatives}")
        if structured.kind == "structural_tag":
            tag = json.loads(structured.canonical_source())
            return compiler.compile_structural_tag(_compact_json(tag, sep) if structured.compact else tag)
        return compiler.compile_grammar(structured.grammar)
    except (RuntimeError, ValueError) as e:  # pydantic's ValidationError (a bad structural tag) is a ValueError
        raise InvalidRequestError(f"cannot compile the {structured.kind.replace('_', ' ')}: {e}",
                                  param=structured.param) from e


def compiled_schema_source(structured: StructuredOutput) -> str:
    """The JSON text xgrammar compiles for a json_schema request: the user's schema after the exact
    rewrites of engine.schema_rewrite (the cache key stays the user's own text)."""
    return json.dumps(rewrite(json.loads(structured.canonical_source())), separators=(",", ":"))


def _compact_json(node, separators: tuple[str, str]):
    """A structural tag whose plain JSON-schema regions are compact JSON, as compact json_schema outputs
    are: xgrammar's json_schema format allows free whitespace (a small model loops on it) and has no
    separators option, so each such region becomes the EBNF of the compact grammar of its schema."""
    if isinstance(node, list):
        return [_compact_json(v, separators) for v in node]
    if not isinstance(node, dict):
        return node
    if (node.get("type") == "json_schema" and isinstance(node.get("json_schema"), dict)
            and set(node) <= {"type", "json_schema", "style"} and node.get("style", "json") == "json"):
        grammar = xgr.Grammar.from_json_schema(json.dumps(rewrite(node["json_schema"])), any_whitespace=False,
                                               separators=separators)
        return {"type": "grammar", "grammar": str(grammar)}
    return {k: _compact_json(v, separators) for k, v in node.items()}


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
    """Enforce or refuse: InvalidRequestError naming the first schema keyword the grammar would not enforce."""
    if structured.kind == "json_schema":
        check_enforceable(rewrite(json.loads(structured.canonical_source())))
    elif structured.kind == "structural_tag":
        for schema in structural_tag_schemas(json.loads(structured.canonical_source())):
            try:
                check_enforceable(rewrite(schema))
            except InvalidRequestError as e:
                raise InvalidRequestError(e.message, param="tools") from None


def _worker_compiler(tokenizer_info_json: str, max_threads: int):
    """A compile process's state: an xgrammar compiler for the parent's tokenizer."""
    return xgr.GrammarCompiler(xgr.TokenizerInfo.deserialize_json(tokenizer_info_json), max_threads=max_threads)


def _compile_serialized(compiler, fields: dict) -> str:
    return compile_structured(compiler, StructuredOutput.from_dict(fields)).serialize_json()


def _parsed(value, field: str, param: str):
    """A JSON value given as text or already parsed; InvalidRequestError (on `param`) for bad text."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as e:
        raise InvalidRequestError(f"{field} is not valid JSON: {e}", param=param) from e


class GrammarCompiler:
    """Compiles and caches grammars for one tokenizer and one model vocabulary size."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int] | None = None,
                 max_threads: int = 2, max_cached: int = DEFAULT_MAX_CACHED,
                 compile_timeout_s: float | None = DEFAULT_COMPILE_TIMEOUT_S,
                 max_cache_bytes: int = DEFAULT_MAX_CACHE_BYTES):
        """`compile_timeout_s`: a compile past it is ended (it runs in a child process) and the request
        gets a 400; None compiles in this process without a limit. The cache keeps at most `max_cached`
        compiled grammars and `max_cache_bytes` bytes of them (xgrammar's memory_size_bytes), least
        recently used out first."""
        if xgr is None:
            raise RuntimeError("xgrammar is not installed; structured output needs it (pip install xgrammar)")
        self.vocab_size = vocab_size
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                                 stop_token_ids=stop_token_ids)
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=max_threads)
        self.compile_timeout_s = compile_timeout_s
        self._worker = CompileWorker(_worker_compiler, (self.tokenizer_info.serialize_json(), max_threads))
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
        self.cache = GrammarCache(max_cached, max_cache_bytes)
        # what /metrics reports per side: a decode engine fed by hand-overs should show no compiles
        self.stats = {"compiles": 0, "cache_hits": 0, "deserializations": 0}
        self._no_control_chars = self._control_free_mask()

    def _control_free_mask(self) -> torch.Tensor:
        """[ceil(V/32)] int32 with the bits of tokens that contain a byte 0x00-0x1F cleared.

        xgrammar's JSON string rule admits raw control characters, which JSON forbids; in compact
        JSON they cannot occur anywhere (no newlines between tokens, escapes inside strings), so
        these tokens are masked out of compact JSON grammars."""
        allowed = torch.ones(((self.vocab_size + 31) // 32) * 32, dtype=torch.bool)
        for token_id, piece in enumerate(self.tokenizer_info.decoded_vocab[: self.vocab_size]):
            if any(b < 0x20 for b in piece) and token_id not in self.tokenizer_info.stop_token_ids:
                allowed[token_id] = False
        bits = allowed.view(-1, 32).to(torch.int64) << torch.arange(32, dtype=torch.int64)
        packed = bits.sum(dim=1)
        return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)

    def compile_async(self, structured: StructuredOutput) -> Future:
        """A future of the CompiledGrammar; the same source compiles once. A failed compilation leaves
        the cache as soon as it fails, so a later request with the same source is compiled again."""
        key = structured.key()
        with self.cache.lock:
            fut = self.cache.get(key)
            if fut is not None:
                self.stats["cache_hits"] += 1
                return fut
            self.stats["compiles"] += 1
            fut: Future = Future()
            self.cache.put(key, fut)
        self._pool.submit(self._compile_into, key, structured, fut)
        return fut

    def _compile_into(self, key: str, structured: StructuredOutput, fut: Future) -> None:
        """Compile, size the cache entry, then wake the waiters (in this order: no waiter sees the cache
        before its bounds hold)."""
        try:
            compiled = self._compile(structured)
        except BaseException as e:  # noqa: BLE001 - the request's error, raised to whoever waits on fut
            with self.cache.lock:
                self.cache.settle(key, fut, None)
            fut.set_exception(e)
            return
        with self.cache.lock:
            self.cache.settle(key, fut, compiled)
        fut.set_result(compiled)

    def compile(self, structured: StructuredOutput):
        return self.compile_async(structured).result()

    def _compile(self, structured: StructuredOutput):
        check_structured_enforceable(structured)
        if self.compile_timeout_s is None:
            return compile_structured(self._compiler, structured)
        try:
            text = self._worker.call(_compile_serialized, structured.to_dict(), timeout=self.compile_timeout_s)
        except WorkerTimeout as e:
            raise InvalidRequestError(f"the {structured.kind.replace('_', ' ')} did not compile within the "
                                      f"{self.compile_timeout_s:g} s compile time limit; simplify it",
                                      param=structured.param) from e
        except WorkerFailed as e:
            if e.kind == "InvalidRequestError":
                raise InvalidRequestError(str(e), param=structured.param) from e
            if e.kind != "WorkerStartup":
                raise RuntimeError(f"grammar compile process failed: {e.kind}: {e}") from e
            # A process that cannot spawn children (a __main__ read from stdin, a sandbox) still serves
            # structured outputs, without the time limit.
            log.warning("the grammar compile process did not start (%s); compiling in this process, with no "
                        "compile time limit", e)
            self.compile_timeout_s = None
            return compile_structured(self._compiler, structured)
        return self.deserialize(text)

    def serialize(self, compiled) -> str:
        return compiled.serialize_json()

    def deserialize(self, text: str):
        return xgr.CompiledGrammar.deserialize_json(text, self.tokenizer_info)

    def serialized(self, structured: StructuredOutput) -> str | None:
        """The compiled form of a grammar this compiler holds (for a hand-over), or None."""
        with self.cache.lock:
            fut = self.cache.peek(structured.key())
        if fut is None or not fut.done() or fut.exception() is not None:
            return None
        return self.serialize(fut.result())

    def adopt(self, structured: StructuredOutput, serialized: str):
        """The CompiledGrammar of a grammar compiled elsewhere (the prefill side): the one held under its
        content key (a cache hit: not deserialized again), else `serialized` loaded and cached. Never
        compiles, even when the cache cannot keep it (larger than its byte bound)."""
        key = structured.key()
        with self.cache.lock:
            held = self.cache.get(key)
            if held is not None and held.done():
                self.stats["cache_hits"] += 1
                return held.result()
        try:
            compiled = self.deserialize(serialized)
        except (RuntimeError, ValueError) as e:
            raise InvalidRequestError(f"the handed-over compiled grammar does not load: {e}", param="handover") from e
        fut: Future = Future()
        fut.set_result(compiled)
        with self.cache.lock:
            self.stats["deserializations"] += 1
            self.cache.put(key, fut)
        return compiled

    def new_state(self, compiled, structured: StructuredOutput | None = None) -> "GrammarState":
        extra = self._no_control_chars if structured is not None and structured.is_compact_json else None
        return GrammarState(xgr.GrammarMatcher(compiled), extra)

    def allocate_bitmask(self, rows: int) -> torch.Tensor:
        """[rows, ceil(V/32)] int32, all bits set (everything allowed)."""
        return torch.full((rows, (self.vocab_size + 31) // 32), -1, dtype=torch.int32)


class GrammarState:
    """One request's position in its grammar."""

    def __init__(self, matcher, extra_mask: torch.Tensor | None = None):
        self.matcher = matcher
        self.extra_mask = extra_mask  # [ceil(V/32)] int32 ANDed into every row this state fills

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)
        if self.extra_mask is not None:
            bitmask[row] &= self.extra_mask

    def accept(self, token_id: int) -> bool:
        return self.matcher.accept_token(token_id)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self.matcher.rollback(num_tokens)

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()
