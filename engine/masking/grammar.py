"""GrammarMasker: structured outputs in the step, a LogitsMasker over grammar matchers (xgrammar's or
llguidance's, behind structured/state.py's GrammarState).

Each guided request has a matcher (structured/request.py, GrammarState) that has accepted exactly the
request's emitted output tokens. Per step (docs/architecture.md, "Grammar with speculation"):
  verification rows: row 0 is the matcher's own mask; the matcher then advances through the drafts
    to fill rows 1..k and is rolled back. Rows after the first draft the grammar rejects stay
    unflagged: that draft is rejected anyway, so nothing after it is ever emitted;
  draft steps: the matcher advances through the tokens verification emitted and the drafts so far,
    fills the next draft's row, and is rolled back. With forced drafts (structured/forced.py), a draft
    step outside a forced run also finds the tokens the grammar forces from there (its jump-forward
    string, retokenized canonically), and each draft step they cover gets a row that admits that one token:
    the draft network drafts them, feeds them through its own chain like accepted tokens, and drafts
    on after them (mask rows, not a second path, so the captured step is unchanged);
  draft trees: the same per node, along the node's path (fill_draft_tree); a node the grammar forces from
    gets the one-token row of its run's next token, so its only child is that token, of probability 1, and
    the run goes on as a single-child stretch while the tree has depth left (engine/speculative/tree.py);
  after the step: the engine hands back the tokens it kept (accept) and the matcher advances for good.
A request whose matcher has terminated (the grammar's end, with its stop token) finishes with "stop".
A refused keyword is an InvalidRequestError from add_request at once; the compile itself runs on
the compiler's thread (start/install) while the prompt runs, and its failure finishes the request
with that error (LLMEngine). The compiled grammar is cached by content (GrammarCompiler).

Fills read the step's device tensors on the host (.tolist()): inline in an eager step; in a captured one
they run in host functions on host copies (engine/masking/graph.py, StagedMasker), chains and trees alike.
"""
from __future__ import annotations

import logging
from concurrent.futures import Future

import torch

from engine.masking.masker import LogitsMasker, MaskRow
from structured.compiler import GrammarCompiler
from structured.forced import CONTEXT_TOKENS, ForcedTokenizer, forced_run
from structured.request import SerializedGrammar, StructuredOutput, check_structured_enforceable
from structured.state import GrammarState

log = logging.getLogger(__name__)


class GrammarMasker(LogitsMasker):
    def __init__(self, compiler: GrammarCompiler, forced: ForcedTokenizer | None = None):
        """forced: retokenizes forced strings (None: no forced drafts). A forced draft is handed to the step as
        its token (fill_draft's and fill_draft_tree's `forced`), so a draft network drafts it even outside a
        reduced draft vocabulary."""
        self.compiler = compiler
        self.forced = forced
        self.states: dict[str, GrammarState] = {}
        self._tails: dict[str, tuple[int, ...]] = {}  # each request's last emitted tokens (retokenization context)
        self._rows: list[tuple[int, GrammarState, MaskRow]] = []  # (batch row, state, snapshot) this step
        self._step_tails: dict[int, tuple[int, ...]] = {}  # batch row -> its tail, snapshotted by begin_step
        self._runs: dict[int, tuple[int, list[int]]] = {}  # batch row -> (first draft step, forced run) this step
        # (batch row, a draft tree node's path) -> the forced run after it, this expansion (fill_draft_tree)
        self._tree_runs: dict[tuple[int, tuple[int, ...]], list[int]] = {}
        self._cpu_rows: torch.Tensor | None = None  # [k+1, W] host scratch when the step's device is not the CPU
        self._one_row: torch.Tensor | None = None  # [1, W] host scratch of forced runs' single-token checks
        self._forced_bits: dict[int, int] = {}  # batch row -> draft steps (bit j: draft j) given a forced token
        # request id -> its draft steps of the step last read that drafted a forced token (bit j: draft j), what
        # the engine counts as forced drafts (SpecUsage.forced_tokens); kept past end_step, replaced by the next
        self.forced_steps: dict[str, int] = {}

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
        self._tails[request_id] = tuple(output_token_ids[-CONTEXT_TOKENS:])

    def terminated(self, request_id: str) -> bool:
        state = self.states.get(request_id)
        return state is not None and state.terminated

    def accept(self, request_id: str, token_ids: list[int]) -> None:
        state = self.states.get(request_id)
        if state is None:
            return
        self._tails[request_id] = (self._tails.get(request_id, ()) + tuple(token_ids))[-CONTEXT_TOKENS:]
        for t in token_ids:
            if state.terminated:
                break
            if not state.accept(t):  # the mask allowed it: a matcher and its mask disagree
                log.error("grammar of %s rejected emitted token %d", request_id, t)
                break

    def release(self, request_id: str) -> None:
        self.states.pop(request_id, None)
        self._tails.pop(request_id, None)

    def forced_drafts(self, request_id: str, limit: int) -> list[int]:
        """Host, between steps: up to `limit` tokens the request's grammar forces next (its jump-forward
        string's canonical tokens and single admissible tokens), for drafters without a draft network
        (prompt lookup, or none) to verify as leading drafts. [] for an unconstrained request."""
        state = self.states.get(request_id)
        if self.forced is None or state is None or limit <= 0 or state.terminated:
            return []
        if self._one_row is None:
            self._one_row = self.compiler.allocate_bitmask(1)
        return forced_run(state, self.forced, limit, self._tails.get(request_id, ()), self._one_row)

    # ------------------------------------------------------------------ the step
    def begin_step(self, rows: tuple[MaskRow, ...]) -> bool:
        self._rows = [(b, self.states[r.request_id], r) for b, r in enumerate(rows)
                      if r.samples and r.request_id in self.states and not self.states[r.request_id].terminated]
        self._step_tails = {b: self._tails.get(r.request_id, ()) for b, _, r in self._rows}
        self._forced_bits = {}
        self.forced_steps = {}
        return bool(self._rows)

    def end_step(self) -> None:
        self.forced_steps = {r.request_id: self._forced_bits[b] for b, _, r in self._rows if b in self._forced_bits}
        self._forced_bits = {}
        self._rows = []
        self._step_tails = {}
        self._runs = {}
        self._tree_runs = {}

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
                   bitmask: torch.Tensor, flags: torch.Tensor, forced: torch.Tensor) -> None:
        if not self._rows:
            return
        # One host read per draft step (on CUDA this is where a host function will wait for the tokens).
        emitted_rows = emitted.tolist()
        accepted = num_accepted.tolist()
        draft_rows = torch.stack(drafts, 1).tolist() if drafts else None
        if step == 0:
            self._runs = {}
        k = emitted.shape[1] - 1
        drafted: dict[int, int] = {}  # batch row -> the token its grammar forces as this draft
        for b, state, _ in self._rows:
            new = emitted_rows[b][: accepted[b] + 1]
            so_far = draft_rows[b] if draft_rows is not None else []
            start, run = self._runs.get(b, (0, []))
            if start < step < start + len(run) and so_far[start:] == run[: step - start]:
                # inside a forced run: no matcher work
                self._write_row(bitmask, b, lambda target, row, t=run[step - start]: _only(target, row, t))
                flags[b] = True
                drafted[b] = run[step - start]
                self._forced_bits[b] = self._forced_bits.get(b, 0) | 1 << step
                continue
            path = new + so_far
            n = 0
            for t in path:
                if state.terminated or not state.accept(t):
                    break
                n += 1
            if n == len(path) and not state.terminated:
                run = []
                if self.forced is not None:  # a run may start at any draft step (after a drafted `",` say)
                    run = self._forced_after(b, state, path, k - step)
                    self._runs[b] = (step, run)
                if run:
                    self._write_row(bitmask, b, lambda target, row, t=run[0]: _only(target, row, t))
                    drafted[b] = run[0]
                    self._forced_bits[b] = self._forced_bits.get(b, 0) | 1 << step
                else:
                    self._write_row(bitmask, b, state.fill_bitmask)
                flags[b] = True
            state.rollback(n)
        _copy_forced(forced, drafted)

    # ------------------------------------------------------------------ draft trees (engine/speculative/tree.py)
    def fill_verify_tree(self, bitmask: torch.Tensor, flags: torch.Tensor, parents: torch.Tensor) -> None:
        if not self._rows:
            return
        parents = parents.tolist()  # one host read (a captured step's host function hands a host copy)
        for b, state, row in self._rows:
            on_cpu = bitmask.device.type == "cpu"
            target = bitmask[b] if on_cpu else self._scratch(bitmask.shape[1:])
            state.fill_bitmask(target, 0)
            filled = [0]
            for j in range(1, len(row.drafts) + 1):
                path, i = [], j
                while i:  # the node's path from the root, read back through its parents
                    path.append(row.drafts[i - 1])
                    i = parents[b][i - 1]
                advanced, goes_on = _advance(state, path[::-1])
                if goes_on:
                    state.fill_bitmask(target, j)
                    filled.append(j)
                state.rollback(advanced)
            if not on_cpu:
                bitmask[b, : len(row.drafts) + 1].copy_(target[: len(row.drafts) + 1])
            flags[b, filled] = True

    def fill_draft_tree(self, emitted: torch.Tensor, num_accepted: torch.Tensor, paths: torch.Tensor,
                        bitmask: torch.Tensor, flags: torch.Tensor, forced: torch.Tensor) -> None:
        if not self._rows:
            return
        emitted_rows = emitted.tolist()
        accepted = num_accepted.tolist()
        depth = paths.shape[2]
        paths = paths.tolist()
        B, L, W = bitmask.shape
        rows = bitmask.view(B * L, W)
        on_cpu = bitmask.device.type == "cpu"
        if depth == 0:  # the root: a new expansion
            self._tree_runs = {}
        left = emitted.shape[1] - 1 - depth  # depths of the tree below these lanes (emitted: [B, k+1])
        drafted: dict[int, int] = {}  # lane row (b * L + lane) -> its forced child
        for b, state, _ in self._rows:
            new = emitted_rows[b][: accepted[b] + 1]
            target = rows if on_cpu else self._scratch((B * L, W))
            for lane, path in enumerate(paths[b]):
                row = b * L + lane
                # A node whose parent was forced to it continues its parent's run: no matcher work.
                run = self._tree_runs.get((b, tuple(path[:-1]))) if path else None
                if run is not None and len(run) > 1 and run[0] == path[-1]:
                    self._tree_runs[(b, tuple(path))] = run[1:]
                    _only(target, row, run[1])
                    drafted[row] = run[1]
                    flags[b, lane] = True
                    continue
                advanced, goes_on = _advance(state, new + path)
                if goes_on:
                    run = self._forced_after(b, state, new + path, left) if self.forced is not None else []
                    self._tree_runs[(b, tuple(path))] = run
                    if run:  # a forced child: the only one, of probability 1 (tree.py)
                        _only(target, row, run[0])
                        drafted[row] = run[0]
                    else:
                        state.fill_bitmask(target, row)
                    flags[b, lane] = True
                state.rollback(advanced)
            if not on_cpu:
                rows[b * L : (b + 1) * L].copy_(target[b * L : (b + 1) * L])
        _copy_forced(forced.view(-1), drafted)

    def _forced_after(self, b: int, state: GrammarState, path: list[int], limit: int) -> list[int]:
        """The tokens (up to `limit`) the grammar forces after `path` (the step's emitted tokens and drafts, which
        `state` has just accepted), retokenized after batch row b's tail."""
        return forced_run(state, self.forced, limit, self._step_tails.get(b, ()) + tuple(path))

    def _write_row(self, bitmask: torch.Tensor, b: int, fill) -> None:
        """fill(target, row) writes a CPU bitmask row; copied into bitmask[b] when that is on a device."""
        on_cpu = bitmask.device.type == "cpu"
        target = bitmask if on_cpu else self._scratch(bitmask.shape)
        fill(target, b)
        if not on_cpu:
            bitmask[b].copy_(target[b])

    def _scratch(self, shape) -> torch.Tensor:
        if self._cpu_rows is None or tuple(self._cpu_rows.shape) != tuple(shape):
            self._cpu_rows = torch.zeros(tuple(shape), dtype=torch.int32)
        return self._cpu_rows


def _advance(state: GrammarState, tokens: list[int]) -> tuple[int, bool]:
    """Advance a matcher through `tokens` -> (tokens it accepted, for the caller to roll back; whether it accepted
    all and the grammar goes on after them: a terminated grammar has no next token to mask)."""
    for n, t in enumerate(tokens):
        if state.terminated or not state.accept(t):
            return n, False
    return len(tokens), not state.terminated


def _copy_forced(forced: torch.Tensor, drafted: dict[int, int]) -> None:
    """forced [R] int64 (-1 on entry, on the step's device): row r := drafted[r], in one copy."""
    if drafted:
        ids = torch.full((forced.shape[0],), -1, dtype=torch.int64)
        ids[list(drafted)] = torch.tensor(list(drafted.values()), dtype=torch.int64)
        forced.copy_(ids)


def _only(bitmask: torch.Tensor, row: int, token_id: int) -> None:
    """Row `row` of a CPU bitmask := only `token_id` allowed."""
    bitmask[row].zero_()
    bit = 1 << (token_id % 32)
    bitmask[row, token_id // 32] = bit - (1 << 32) if bit >= 1 << 31 else bit
