"""GrammarCompiler: compiles and caches grammars for one tokenizer and vocabulary, with two backends.

xgrammar compiles everything except Lark grammars and the JSON schemas it would not enforce, which
llguidance compiles (StructuredOutput.plan; structured/llguidance.py). Both go the same way: a content-addressed cache
(the key includes the backend) of futures, a compile thread so a prompt runs while its grammar
compiles, the compile itself in a child process that is killed past the time limit (neither library
can be stopped otherwise), a serialized form for the prefill -> decode hand-over (`SerializedGrammar`)
that the decode side loads without compiling, and per-backend counters for /metrics.
"""
from __future__ import annotations

import json
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from engine.errors import InvalidRequestError
from structured import llguidance as llg
from structured.cache import DEFAULT_MAX_CACHE_BYTES, DEFAULT_MAX_CACHED, GrammarCache
from structured.compile_worker import CompileWorker, WorkerFailed, WorkerTimeout
from structured.request import XGRAMMAR, SerializedGrammar, StructuredOutput, check_structured_enforceable
from structured.schema.presence import rewrite_presence
from structured.schema.rewrite import rewrite
from structured.schema.siblings import without_absent_properties
from structured.state import GrammarState, XGrammarState

if TYPE_CHECKING:
    import torch

# torch and xgrammar (which imports torch) load with the first compiler, not with this module: the
# router and the prefill loop import structured/ without them.

DEFAULT_COMPILE_TIMEOUT_S = 5.0
log = logging.getLogger(__name__)
_EVENTS = ("compiles", "cache_hits", "deserializations")


class _WorkerCompilers:
    """A compile process's state: an xgrammar compiler for the parent's tokenizer, and llguidance's
    tokenizer, built on the first llguidance compile (most processes never need it)."""

    def __init__(self, tokenizer_info_json: str, max_threads: int, llg_tokenizer: tuple | None):
        import xgrammar as xgr

        self.xgrammar = xgr.GrammarCompiler(xgr.TokenizerInfo.deserialize_json(tokenizer_info_json),
                                            max_threads=max_threads)
        self._llg_args, self._lltokenizer = llg_tokenizer, None

    def lltokenizer(self):
        if self._lltokenizer is None:
            self._lltokenizer = llg.tokenizer_of(*self._llg_args)
        return self._lltokenizer


def _compile_xgrammar(compilers: _WorkerCompilers, fields: dict) -> str:
    return compile_structured(compilers.xgrammar, StructuredOutput.from_dict(fields)).serialize_json()


def _validate_llguidance(compilers: _WorkerCompilers, text: str, refusal: str) -> str:
    return llg.validated(text, compilers.lltokenizer(), refusal)


class _NoWorker(Exception):
    """The compile process did not start: compile in this process, without the time limit."""


class GrammarCompiler:
    """Compiles and caches grammars for one tokenizer and one model vocabulary size."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int] | None = None,
                 max_threads: int = 2, max_cached: int = DEFAULT_MAX_CACHED,
                 compile_timeout_s: float | None = DEFAULT_COMPILE_TIMEOUT_S,
                 max_cache_bytes: int = DEFAULT_MAX_CACHE_BYTES):
        """`compile_timeout_s`: a compile past it is ended (it runs in a child process) and the request
        gets a 400; None compiles in this process without a limit. The cache keeps at most `max_cached`
        compiled grammars and `max_cache_bytes` bytes of them (xgrammar's memory_size_bytes, an estimate
        for llguidance), least recently used out first."""
        try:
            import xgrammar as xgr
        except ImportError as e:  # pragma: no cover - a hard dependency; this keeps the error readable
            raise RuntimeError("xgrammar is not installed; structured output needs it (pip install xgrammar)") from e
        self.vocab_size = vocab_size
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                                 stop_token_ids=stop_token_ids)
        # llguidance stops on exactly the tokens xgrammar does (the engine's EOS set, else the tokenizer's)
        self.stop_token_ids = frozenset(int(t) for t in self.tokenizer_info.stop_token_ids)
        self._llg_args = None  # (tokenizer JSON, vocab size, stop ids): llguidance's tokenizer, lazily built
        if llg.available() and getattr(tokenizer, "backend_tokenizer", None) is not None:
            self._llg_args = (llg.hf_tokenizer_json(tokenizer), vocab_size, sorted(self.stop_token_ids))
        self._lltokenizer = None
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=max_threads)
        self.compile_timeout_s = compile_timeout_s
        self._worker = CompileWorker(_WorkerCompilers, (self.tokenizer_info.serialize_json(), max_threads,
                                                        self._llg_args))
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
        self.cache = GrammarCache(max_cached, max_cache_bytes)
        # what /metrics reports per side: a decode engine fed by hand-overs should show no compiles.
        # The totals count both backends; the llguidance_* keys are llguidance's share.
        self.stats = {**{e: 0 for e in _EVENTS}, **{f"{llg.BACKEND}_{e}": 0 for e in _EVENTS}}
        self._no_control_chars = self._control_free_mask()

    def _count(self, event: str, backend: str) -> None:
        self.stats[event] += 1
        if backend != XGRAMMAR:
            self.stats[f"{backend}_{event}"] += 1

    def _control_free_mask(self) -> torch.Tensor:
        """[ceil(V/32)] int32 with the bits of tokens that contain a byte 0x00-0x1F cleared.

        xgrammar's JSON string rule admits raw control characters, which JSON forbids; in compact
        JSON they cannot occur anywhere (no newlines between tokens, escapes inside strings), so
        these tokens are masked out of compact JSON grammars."""
        import torch

        allowed = torch.ones(((self.vocab_size + 31) // 32) * 32, dtype=torch.bool)
        for token_id, piece in enumerate(self.tokenizer_info.decoded_vocab[: self.vocab_size]):
            if any(b < 0x20 for b in piece) and token_id not in self.tokenizer_info.stop_token_ids:
                allowed[token_id] = False
        bits = allowed.view(-1, 32).to(torch.int64) << torch.arange(32, dtype=torch.int64)
        packed = bits.sum(dim=1)
        return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)

    def lltokenizer(self):
        """llguidance's tokenizer (built on first use: about a second for a large vocabulary)."""
        if self._lltokenizer is None:
            if self._llg_args is None:
                raise InvalidRequestError("schemas served by llguidance need llguidance and a fast (Rust) "
                                          "tokenizer", param="response_format")
            self._lltokenizer = llg.tokenizer_of(*self._llg_args)
        return self._lltokenizer

    # ------------------------------------------------------------------ compiling
    def compile_async(self, structured: StructuredOutput) -> Future:
        """A future of the compiled grammar; the same source compiles once. A failed compilation leaves
        the cache as soon as it fails, so a later request with the same source is compiled again."""
        key = structured.key()
        backend = structured.plan.backend
        with self.cache.lock:
            fut = self.cache.get(key)
            if fut is not None:
                self._count("cache_hits", backend)
                return fut
            self._count("compiles", backend)
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
        if structured.plan.backend == llg.BACKEND:
            return self._compile_llguidance(structured)
        try:
            text = self._in_worker(structured, _compile_xgrammar, structured.to_dict())
        except _NoWorker:
            return compile_structured(self._compiler, structured)
        return self.deserialize(SerializedGrammar(XGRAMMAR, text))

    def _compile_llguidance(self, structured: StructuredOutput):
        """Validate in the compile process (time-limited), then build the template matcher here: its
        build costs about what the validation did (structured/llguidance.py)."""
        refusal = structured.plan.refusal
        if structured.is_lark:
            text = structured.grammar  # llguidance reads Lark as it is
        else:
            schema = llguidance_schema(structured)
            llg.check_gaps(schema, refusal)
            text = llg.grammar_text(schema)
        if self._llg_args is None:
            raise InvalidRequestError(f"{refusal}; llguidance, which could, needs a fast (Rust) tokenizer",
                                      param="response_format")
        try:
            self._in_worker(structured, _validate_llguidance, text, refusal)
        except _NoWorker:
            llg.validated(text, self.lltokenizer(), refusal)
        return llg.load(text, self.lltokenizer())

    def _in_worker(self, structured: StructuredOutput, fn, *args):
        """fn(worker state, *args) in the compile process under the time limit; InvalidRequestError
        for a bad grammar or an over-time compile; _NoWorker where there is no such process."""
        if self.compile_timeout_s is None:
            raise _NoWorker()
        try:
            return self._worker.call(fn, *args, timeout=self.compile_timeout_s)
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
            raise _NoWorker() from e

    # ------------------------------------------------------------------ the hand-over
    def serialize(self, compiled) -> SerializedGrammar:
        if isinstance(compiled, llg.LLGuidanceGrammar):
            return SerializedGrammar(llg.BACKEND, compiled.text)
        return SerializedGrammar(XGRAMMAR, compiled.serialize_json())

    def deserialize(self, serialized: SerializedGrammar):
        """The compiled grammar again: xgrammar loads its serialized form; llguidance builds its template
        matcher from the grammar text (no schema compile, but the lexer/parser build: see
        structured/llguidance.py for what that costs)."""
        if serialized.backend == llg.BACKEND:
            return llg.load(serialized.text, self.lltokenizer())
        import xgrammar as xgr

        return xgr.CompiledGrammar.deserialize_json(serialized.text, self.tokenizer_info)

    def serialized(self, structured: StructuredOutput) -> SerializedGrammar | None:
        """The compiled form of a grammar this compiler holds (for a hand-over), or None."""
        with self.cache.lock:
            fut = self.cache.peek(structured.key())
        if fut is None or not fut.done() or fut.exception() is not None:
            return None
        return self.serialize(fut.result())

    def adopt(self, structured: StructuredOutput, serialized: SerializedGrammar):
        """The compiled grammar of a grammar compiled elsewhere (the prefill side): the one held under its
        content key (a cache hit: not deserialized again), else `serialized` loaded and cached. Never
        compiles, even when the cache cannot keep it (larger than its byte bound)."""
        backend = structured.plan.backend
        if serialized.backend != backend:
            raise InvalidRequestError(f"the hand-over's grammar is {serialized.backend}'s but this side plans "
                                      f"{backend} for it (prefill and decode run different versions)",
                                      param="handover")
        key = structured.key()
        with self.cache.lock:
            held = self.cache.get(key)
            if held is not None and held.done():
                self._count("cache_hits", backend)
                return held.result()
        try:
            compiled = self.deserialize(serialized)
        except (RuntimeError, ValueError) as e:  # InvalidRequestError (llguidance) is a ValueError too
            raise InvalidRequestError(f"the handed-over compiled grammar does not load: {e}", param="handover") from e
        fut: Future = Future()
        fut.set_result(compiled)
        with self.cache.lock:
            self._count("deserializations", backend)
            self.cache.put(key, fut)
        return compiled

    # ------------------------------------------------------------------ matchers
    def new_state(self, compiled, structured: StructuredOutput | None = None) -> GrammarState:
        extra = self._no_control_chars if structured is not None and structured.is_compact_json else None
        if isinstance(compiled, llg.LLGuidanceGrammar):
            return llg.LLGuidanceState(compiled.template.deep_copy(), self.stop_token_ids, extra)
        import xgrammar as xgr

        return XGrammarState(xgr.GrammarMatcher(compiled), extra)

    def allocate_bitmask(self, rows: int) -> torch.Tensor:
        """[rows, ceil(V/32)] int32, all bits set (everything allowed)."""
        import torch

        return torch.full((rows, (self.vocab_size + 31) // 32), -1, dtype=torch.int32)


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
    rewrites of structured.schema.rewrite (the cache key stays the user's own text)."""
    schema = without_absent_properties(rewrite(json.loads(structured.canonical_source())))
    return json.dumps(schema, separators=(",", ":"))


def llguidance_schema(structured: StructuredOutput) -> dict:
    """The schema llguidance compiles for a json_schema request: the xgrammar rewrites, then the exact
    key-presence rewrites llguidance can enforce (structured.schema.presence)."""
    return rewrite_presence(rewrite(json.loads(structured.canonical_source())))


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
        schema = without_absent_properties(rewrite(node["json_schema"]))
        import xgrammar as xgr

        grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False,
                                               separators=separators)
        return {"type": "grammar", "grammar": str(grammar)}
    return {k: _compact_json(v, separators) for k, v in node.items()}
