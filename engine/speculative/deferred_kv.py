"""A draft head's KV deferred while no step drafts, and caught up before the next step that does.

Why: a step at k = 0 (adaptive k decided no draft pays) still ran the head's first pass over the step's rows, only
so that its KV stays whole for a later step that drafts. At batch 16 on a 2-core CPU that pass was ~7% of a step
(77 against 72 ms; bench/results/real_spec_kernels_b16_cpu.md), and adaptive k, settled at k = 0 there, ran at
~0.93x of no speculation for it.

How: a one-layer head (MTP, EAGLE-3) writes the KV of a position from that row's input alone (its hidden state from
the target and the next token): its attention over earlier positions changes the row's output, never its K and V.
So the pass can run any time later from those inputs. Every step stores each row's head input by KV slot (the
stash: [slots, H_in], written inside the step and its CUDA graph, like the KV); a step at k = 0 skips the pass for
its decoding requests and marks where each request's holes start (Request.draft_holes_from); a step that drafts
first runs one pass over every hole (`catch_up`: positions, slots and next tokens from the host, hidden states from
the stash), then its own pass as always. Rows of prompts always fill the head's KV (a prompt's blocks go to the
prefix cache and a hand-over ships them), so only decoding rows are ever deferred.

Where the holes stay visible: the prefix cache registers a block only below a request's holes (prefix_cache.py),
and a request with holes is never carried into an overlapped step (overlap.py: its catch-up reads host tokens).
Not deferred: draft models (their layers above the first do read earlier positions), draft trees, attention data
parallelism (a head pass of rows one rank alone has would break the group's collectives around each MLP).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.core.block_manager import BlockManager, kv_slots
from engine.core.scheduler import ScheduledRequest
from engine.layers.attention import AttentionMetadata
from engine.runner.staging import to_device
from engine.speculative.proposer import HeadProposer, ProposeInputs, Proposer


@dataclass(frozen=True, slots=True)
class DraftFill:
    """The rows of a k = 0 step whose head KV is written now (prompt rows): the rest are deferred."""

    rows: torch.Tensor  # [R] int64 rows of the step
    attn: AttentionMetadata  # the step's metadata cut to those rows' requests


@dataclass(frozen=True, slots=True)
class CatchUp:
    """The deferred positions of the requests a drafting step fills, as one ragged pass before the step."""

    positions: torch.Tensor  # [C] int64
    # [C] int64 the token after each position, read from cat(tokens, step's input ids): the last hole of a
    # request is followed by its first row's input this step
    next_index: torch.Tensor
    tokens: torch.Tensor  # [C] int64 host-known tokens after the positions
    attn: AttentionMetadata  # the holes' rows over the requests' block tables (slot_mapping: the holes' slots)
    num_rows: int  # host: C


def deferrable(proposer: Proposer | None, tree: bool, adp: bool, enabled: bool) -> bool:
    """Whether this engine defers its head's KV at k = 0 steps (see the module's docstring)."""
    return enabled and isinstance(proposer, HeadProposer) and not tree and not adp


def stash_width(proposer: HeadProposer, hidden_size: int, device: torch.device) -> int:
    """H_in: the width of the head's input per row (the target's hidden, or EAGLE-3's captured layers side by side)."""
    zeros = torch.zeros(1, hidden_size, device=device)
    return proposer.first_hidden(zeros, [zeros for _ in proposer.capture_layers]).shape[-1]


def make_stash(num_slots: int, width: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The head inputs by KV slot, plus one scratch row where padding rows (slot -1) write."""
    return torch.zeros((num_slots + 1, width), dtype=dtype, device=device)


def stash_rows(stash: torch.Tensor, slot_mapping: torch.Tensor, hidden: torch.Tensor) -> None:
    """Store each row's head input at its KV slot (inside the step: capturable)."""
    scratch = stash.shape[0] - 1
    stash.index_copy_(0, torch.where(slot_mapping >= 0, slot_mapping, scratch), hidden.to(stash.dtype))


def decoding(s: ScheduledRequest) -> bool:
    """A step of `s` that runs only its last token and drafts (no prompt row): its head KV may wait."""
    req = s.request
    return s.sample and not req.prefill_only and s.start >= max(s.num_tokens - 1, req.num_prompt_tokens)


def plan(scheduled: list[ScheduledRequest], attn: AttentionMetadata, row_counts: list[int], drafting: bool,
         blocks: BlockManager, device: torch.device) -> tuple[DraftFill | None, CatchUp | None]:
    """Host plan of a step's head KV: which rows fill it now (None: every row when drafting, none otherwise) and the
    holes caught up before the step (None: none). Updates each request's draft_holes_from for after the step."""
    fill_rows, fill_reqs, holes = [], [], []
    t = 0
    for b, s in enumerate(scheduled):
        req, n = s.request, row_counts[b]
        h = req.draft_holes_from  # None again after a preemption (Scheduler._preempt): its rows are prompt rows
        if drafting or not decoding(s):
            if h is not None:
                holes.append((b, h, s.start, t))
            req.draft_holes_from = None
            if not drafting:
                fill_rows.extend(range(t, t + n))
                fill_reqs.append((b, n))
        elif h is None:
            # its verified length before this step: below the step's first position while a step planned ahead
            # is in flight (overlap.py), and the stash holds every position computed, so catching up from here is
            # never short
            req.draft_holes_from = req.num_computed_tokens
        t += n
    fill = _fill(attn, fill_rows, fill_reqs, device) if fill_rows else None
    return fill, (_catch_up(scheduled, attn, holes, blocks, device) if holes else None)


def _fill(attn: AttentionMetadata, rows: list[int], reqs: list[tuple[int, int]], device) -> DraftFill:
    counts = [n for _, n in reqs]
    idx, qsl, r = to_device([np.array([b for b, _ in reqs], dtype=np.int64),
                             np.concatenate([[0], np.cumsum(counts)]).astype(np.int32),
                             np.array(rows, dtype=np.int64)], device).tensors
    sub = AttentionMetadata(kv_cache=attn.kv_cache, slot_mapping=attn.slot_mapping.index_select(0, r),
                            block_tables=attn.block_tables.index_select(0, idx),
                            seq_lens=attn.seq_lens.index_select(0, idx), query_start_loc=qsl, max_q_len=max(counts),
                            max_seq_len=attn.max_seq_len)
    return DraftFill(r, sub)


def _catch_up(scheduled: list[ScheduledRequest], attn: AttentionMetadata, holes: list[tuple[int, int, int, int]],
              blocks: BlockManager, device) -> CatchUp:
    """holes: (request index, first hole, this step's first position, its first row) of each request."""
    C = sum(end - h for _, h, end, _ in holes)
    positions = np.zeros(C, dtype=np.int64)
    slots = np.zeros(C, dtype=np.int64)
    tokens = np.zeros(C, dtype=np.int64)
    next_index = np.zeros(C, dtype=np.int64)
    qsl, seq_lens, reqs = [0], [], []
    c = 0
    for b, h, end, first_row in holes:
        m = end - h
        pos = np.arange(h, end, dtype=np.int64)
        positions[c : c + m] = pos
        table = np.asarray([blocks.table(scheduled[b].request.request_id)], dtype=np.int64)
        slots[c : c + m] = kv_slots(table, 0, pos, blocks.block_size)
        after = scheduled[b].request.token_ids[h + 1 : end]  # known on the host: positions before this step's
        tokens[c : c + len(after)] = after
        next_index[c : c + m] = np.arange(c, c + m)
        next_index[c + m - 1] = C + first_row  # the token at `end` is this step's first input
        c += m
        qsl.append(c)
        seq_lens.append(end)
        reqs.append(b)
    # the host arrays in one copy (engine/runner/staging.py)
    positions, next_index, tokens, slots, reqs, seq_lens_dev, qsl = to_device(
        [positions, next_index, tokens, slots, np.array(reqs, dtype=np.int64), np.array(seq_lens, dtype=np.int32),
         np.array(qsl, dtype=np.int32)], device).tensors
    meta = AttentionMetadata(kv_cache=attn.kv_cache, slot_mapping=slots,
                             block_tables=attn.block_tables.index_select(0, reqs), seq_lens=seq_lens_dev,
                             query_start_loc=qsl, max_q_len=max(e - h for _, h, e, _ in holes),
                             max_seq_len=max(seq_lens))
    return CatchUp(positions, next_index, tokens, meta, C)


def catch_up(proposer: HeadProposer, c: CatchUp, input_ids: torch.Tensor, sampling) -> None:
    """Write the head's KV at the deferred positions (before the step whose rows attend to them).
    input_ids: the step's input ids ([T]); sampling: its SamplingBatch (not read without a chain)."""
    hidden = proposer.stash.index_select(0, c.attn.slot_mapping)
    next_tokens = torch.cat([c.tokens, input_ids]).index_select(0, c.next_index)
    none = torch.zeros(0, dtype=torch.int64, device=next_tokens.device)
    proposer.propose(ProposeInputs(hidden=hidden, input_ids=next_tokens, next_tokens=next_tokens,
                                   positions=c.positions, attn=c.attn, out_rows=none, slot_limit=none,
                                   max_seq_len=c.attn.max_seq_len, chain=False, sampling=sampling))
