"""GuidedRequests: the engine's structured-output state. It owns the engine's logits masker (one given
to the engine, or the GrammarMasker made on the first guided request), the one GrammarCompiler (made
on first use, from any thread), and the compiles still running: a guided request's grammar compiles
while its prompt runs, and only the step that samples its first token waits for it.

Tensor-parallel ranks (without attention data parallelism) each run the whole batch and schedule it alike, so a
grammar must become ready in the same step on every rank: each compiles on its own thread and finishes at its own
time, and a rank that samples the request a step before the others runs another batch than theirs (a collective
mismatch). `agree` makes "ready" the group's decision: a compile counts as done once it is done on every rank.
"""
from __future__ import annotations

import concurrent.futures
import logging
import threading
from concurrent.futures import Future
from typing import Callable

from engine.core.request import Request
from engine.errors import InvalidRequestError
from engine.masking.grammar import GrammarMasker
from engine.masking.masker import LogitsMasker
from structured.compiler import GrammarCompiler
from structured.forced import ForcedTokenizer
from structured.request import SerializedGrammar, StructuredOutput

log = logging.getLogger(__name__)


class GuidedRequests:
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: frozenset[int], masker: LogitsMasker | None,
                 forced_drafts: bool = False):
        """masker: a logits masker of the engine's own (then structured outputs are refused);
        forced_drafts: speculation drafts the tokens grammars force (SpecConfig.forced_drafts)."""
        self._forced_drafts = forced_drafts
        # done flags of the compiles in flight, in the order they started -> the group's (every rank's AND); None:
        # this engine decides alone (one rank, or ADP ranks, each with its own requests)
        self.agree: Callable[[list[bool]], list[bool]] | None = None
        self.masker = masker  # what the engine's steps are masked by (None: no request is constrained)
        self.grammar: GrammarMasker | None = None  # made on the first guided request
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos_token_ids = eos_token_ids
        self._compiler: GrammarCompiler | None = None
        self._compiler_lock = threading.Lock()
        self._compiling: dict[str, Future] = {}  # request id -> its grammar's compile (GrammarMasker.start)

    @property
    def compiling(self) -> bool:
        return bool(self._compiling)

    def start(self, request_id: str, structured: StructuredOutput) -> None:
        """Start compiling a new request's grammar (InvalidRequestError for a refused schema)."""
        self._compiling[request_id] = self._grammar_masker().start(request_id, structured)

    def add(self, req: Request, compiled: SerializedGrammar | None = None) -> None:
        """A guided request's matcher, after the tokens it already has (a hand-over's); InvalidRequestError
        for a bad grammar."""
        structured = req.params.structured_output
        if structured is not None:
            self._grammar_masker().add(req.request_id, structured, req.output_token_ids, compiled)

    def _grammar_masker(self) -> GrammarMasker:
        if self.grammar is None:
            if self.masker is not None:
                raise InvalidRequestError("this engine runs a logits masker of its own; structured outputs need "
                                          "the built-in one", param="structured_output")
            forced = ForcedTokenizer(self._tokenizer) if self._forced_drafts else None
            self.grammar = self.masker = GrammarMasker(self.compiler(), forced)
        return self.grammar

    def compiler(self) -> GrammarCompiler:
        """The engine's one GrammarCompiler, made on first use (from any thread: warm's too)."""
        with self._compiler_lock:
            if self._compiler is None:
                if self._tokenizer is None:
                    raise InvalidRequestError("structured outputs need the model's tokenizer",
                                              param="structured_output")
                self._compiler = GrammarCompiler(self._tokenizer, self._vocab_size, sorted(self._eos_token_ids))
            return self._compiler

    def warm(self, structured, compiled: SerializedGrammar | None) -> None:
        """Load a hand-over's compiled grammar into the compiler's cache now, on the caller's thread (the
        decode rank's channel thread, as the header lands), so that `reserve` on the step thread finds it
        there: for llguidance the load builds the lexer and parser from the grammar text, up to seconds
        for a large schema (structured/llguidance.py), a stall of every running request's step.
        A grammar that does not load is left for `reserve` to refuse, with the request's error."""
        if structured is None or compiled is None:
            return
        try:
            self.compiler().adopt(structured, compiled)
        except InvalidRequestError as e:
            log.info("hand-over grammar did not load ahead of its reserve: %s", e)

    def install(self, requests: dict[str, Request], wait: bool) -> list[Request]:
        """Matchers for the requests whose grammar finished compiling; -> the requests whose compile failed
        (their `error` set: the engine finishes them). `wait`: nothing else can run, so wait (briefly)
        for a compile."""
        if wait:
            concurrent.futures.wait(list(self._compiling.values()), timeout=0.05,
                                    return_when=concurrent.futures.FIRST_COMPLETED)
        failed = []
        pending = list(self._compiling.items())  # the same requests in the same order on every tp rank
        done = [fut.done() for _, fut in pending]
        if self.agree is not None:
            done = self.agree(done)
        for (request_id, fut), ready in zip(pending, done):
            if not ready:
                continue
            del self._compiling[request_id]
            req = requests.get(request_id)
            if req is None or req.status.finished:
                continue
            try:
                self.grammar.install(request_id, req.params.structured_output, fut.result(), req.output_token_ids)
            except Exception as e:  # noqa: BLE001 - the request's own error, reported in its output
                req.error = e if isinstance(e, InvalidRequestError) else InvalidRequestError(
                    f"the grammar did not compile: {e}", param=req.params.structured_output.param)
                failed.append(req)
                continue
            req.grammar_ready = True
        return failed

    def terminated(self, request_id: str) -> bool:
        """The request's grammar is complete (its output must end)."""
        return self.grammar is not None and self.grammar.terminated(request_id)

    def forced_drafts(self, req: Request) -> Callable[[int], list[int]] | None:
        """For a guided request: limit -> the tokens its grammar forces next, up to limit (GrammarMasker's
        forced_drafts); None for an unguided one or without forced drafts."""
        if self.grammar is None or not self._forced_drafts or req.params.structured_output is None:
            return None
        return lambda limit: self.grammar.forced_drafts(req.request_id, limit)

    def forced_steps(self, req: Request) -> int:
        """The draft steps of the step just read in which the draft network drafted a token `req`'s grammar
        forced (bit j: draft j; GrammarMasker.forced_steps)."""
        return self.grammar.forced_steps.get(req.request_id, 0) if self.grammar is not None else 0

    def accept(self, request_id: str, token: int) -> None:
        if self.masker is not None:
            self.masker.accept(request_id, [token])

    def release(self, request_id: str) -> None:
        """The request finished, was aborted or handed over."""
        self._compiling.pop(request_id, None)
        if self.masker is not None:
            self.masker.release(request_id)

    def serialized(self, structured: StructuredOutput) -> SerializedGrammar:
        """A guided request's compiled grammar, for its hand-over."""
        return self.grammar.compiler.serialized(structured)

    def stats(self) -> dict:
        return {"grammar": dict(self.grammar.compiler.stats)} if self.grammar is not None else {}
