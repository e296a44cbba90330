"""GrammarMasker: structured outputs in the step, a LogitsMasker over grammar matchers (xgrammar's or
llguidance's, behind structured/state.py's GrammarState).

Each guided request has a matcher (structured/request.py, GrammarState) that has accepted exactly the
request's emitted output tokens. Per step (docs/architecture.md, "Grammar with speculation"):
  verification rows: row 0 is the matcher's own mask; the matcher then advances through the drafts
    to fill rows 1..k and is rolled back. Rows after the first draft the grammar rejects stay
    unflagged: that draft is rejected anyway, so nothing after it is ever emitted;
  draft steps: the matcher advances through the tokens verification emitted and the drafts so far,
    fills the next draft's row, and is rolled back;
  after the step: the engine hands back the tokens it kept (accept) and the matcher advances for good.
A request whose matcher has terminated (the grammar's end, with its stop token) finishes with "stop".
A refused keyword is an InvalidRequestError from add_request at once; the compile itself runs on
the compiler's thread (start/install) while the prompt runs, and its failure finishes the request
with that error (LLMEngine). The compiled grammar is cached by content (GrammarCompiler).

This is the CPU sibling: fills run inline in the step. On CUDA the same fills are to become host
functions captured in the step's graph; until then a guided step runs eagerly.
"""
from __future__ import annotations

import logging
from concurrent.futures import Future

import torch

from engine.masking.masker import LogitsMasker, MaskRow
from structured.compiler import GrammarCompiler
from structured.request import SerializedGrammar, StructuredOutput, check_structured_enforceable
from structured.state import GrammarState

log = logging.getLogger(__name__)


class GrammarMasker(LogitsMasker):
    def __init__(self, compiler: GrammarCompiler):
        self.compiler = compiler
        self.states: dict[str, GrammarState] = {}
        self._rows: list[tuple[int, GrammarState, MaskRow]] = []  # (batch row, state, snapshot) this step
        self._cpu_rows: torch.Tensor | None = None  # [k+1, W] host scratch when the step's device is not the CPU

    # ------------------------------------------------------------------ requests
    def add(self, request_id: str, structured: StructuredOutput, output_token_ids: list[int] = (),
            compiled: SerializedGrammar | None = None) -> None:
        """Compile (or find in the cache) and start a matcher; raises InvalidRequestError on a bad grammar.
        `output_token_ids`: tokens already emitted (a hand-over's first token), accepted first;
        `compiled`: the grammar serialized by the side that compiled it (a hand-over): never recompiled."""
        grammar = (self.compiler.adopt(structured, compiled) if compiled is not None
                   else self.compiler.compile(structured))
        self.install(request_id, structured, grammar, output_token_ids)

    def start(self, request_id: str, structured: StructuredOutput) -> Future:
        """Begin compiling (or find in the cache) without waiting: a future of the CompiledGrammar, whose
        exception is the request's InvalidRequestError. The refusal of keywords the grammar cannot
        enforce is decided here, at once (it needs no compile)."""
        check_structured_enforceable(structured)
        return self.compiler.compile_async(structured)

    def install(self, request_id: str, structured: StructuredOutput, grammar, output_token_ids: list[int] = ()) -> None:
        """Start a request's matcher on a compiled grammar, after the tokens it already emitted."""
        state = self.compiler.new_state(grammar, structured)
        for t in output_token_ids:
            state.accept(t)
        self.states[request_id] = state

    def terminated(self, request_id: str) -> bool:
        state = self.states.get(request_id)
        return state is not None and state.terminated

    def accept(self, request_id: str, token_ids: list[int]) -> None:
        state = self.states.get(request_id)
        if state is None:
            return
        for t in token_ids:
            if state.terminated:
                break
            if not state.accept(t):  # the mask allowed it: a matcher and its mask disagree
                log.error("grammar of %s rejected emitted token %d", request_id, t)
                break

    def release(self, request_id: str) -> None:
        self.states.pop(request_id, None)

    # ------------------------------------------------------------------ the step
    def begin_step(self, rows: tuple[MaskRow, ...]) -> bool:
        self._rows = [(b, self.states[r.request_id], r) for b, r in enumerate(rows)
                      if r.samples and r.request_id in self.states and not self.states[r.request_id].terminated]
        return bool(self._rows)

    def end_step(self) -> None:
        self._rows = []

    def fill_verify(self, bitmask: torch.Tensor, flags: torch.Tensor) -> None:
        for b, state, row in self._rows:
            on_cpu = bitmask.device.type == "cpu"
            target = bitmask[b] if on_cpu else self._scratch(bitmask.shape[1:])
            state.fill_bitmask(target, 0)
            filled, advanced = 1, 0
            for j, draft in enumerate(row.drafts):
                if not state.accept(draft):
                    break
                advanced += 1
                if state.terminated:  # the grammar ended: the request finishes on this draft
                    break
                state.fill_bitmask(target, j + 1)
                filled = j + 2
            state.rollback(advanced)
            if not on_cpu:
                bitmask[b, :filled].copy_(target[:filled])
            flags[b, :filled] = True

    def fill_draft(self, step: int, emitted: torch.Tensor, num_accepted: torch.Tensor, drafts: list[torch.Tensor],
                   bitmask: torch.Tensor, flags: torch.Tensor) -> None:
        if not self._rows:
            return
        # One host read per draft step (on CUDA this is where a host function will wait for the tokens).
        emitted_rows = emitted.tolist()
        accepted = num_accepted.tolist()
        draft_rows = torch.stack(drafts, 1).tolist() if drafts else None
        for b, state, _ in self._rows:
            path = emitted_rows[b][: accepted[b] + 1] + (draft_rows[b] if draft_rows is not None else [])
            n = 0
            for t in path:
                if state.terminated or not state.accept(t):
                    break
                n += 1
            if n == len(path) and not state.terminated:
                on_cpu = bitmask.device.type == "cpu"
                target = bitmask if on_cpu else self._scratch(bitmask.shape)
                state.fill_bitmask(target, b)
                if not on_cpu:
                    bitmask[b].copy_(target[b])
                flags[b] = True
            state.rollback(n)

    def _scratch(self, shape) -> torch.Tensor:
        if self._cpu_rows is None or tuple(self._cpu_rows.shape) != tuple(shape):
            self._cpu_rows = torch.zeros(tuple(shape), dtype=torch.int32)
        return self._cpu_rows
