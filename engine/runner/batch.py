"""Host-side inputs of one step: the varlen target rows plus, per request, the chain layout.

There is one batch builder for every step: without speculation k = 0 and each chain is one column.
A request's rows this step are its not-yet-computed tokens: prompt chunks, or [last token, drafts]
for a decoding request. Column j of a request's chain is the row whose logits predict the token at
position `num_tokens + j` (j = 0 for a prompt's last chunk). With `pad` (CUDA graphs; every request
decoding), every request gets exactly k+1 rows, the batch is padded with idle requests to a captured
size and block tables to a fixed width, so every shape depends on the padded batch size alone.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.config import chain_margin
from engine.core.block_manager import BlockManager, kv_slots
from engine.core.scheduler import ScheduledRequest
from engine.layers.attention import AttentionMetadata
from engine.runner.staging import to_device
from engine.sample.sampler import SamplingBatch, build_sampling, sampling_columns

if TYPE_CHECKING:
    from engine.speculative.deferred_kv import DraftFill


@dataclass(frozen=True, slots=True)
class StepBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    attn: AttentionMetadata  # target metadata over the T rows
    verify_rows: torch.Tensor  # [B, k+1] int64 row whose logits give chain column j (padding repeats)
    drafts: torch.Tensor  # [B, k] int64 drafts in target ids, 0 past num_drafts
    num_drafts: torch.Tensor  # [B] int64
    next_tokens: torch.Tensor  # [T] int64 token after each row where the host knows it (else 0)
    samples: torch.Tensor  # [B] bool request emits tokens this step
    slots: torch.Tensor  # [B] int64 row of the draft-state buffers
    slot_limit: torch.Tensor  # [B] int64 KV slots held; draft-chain writes at or past it are dropped
    sampling: SamplingBatch  # [B] rows, positions = each chain's first new position
    # Logits row (b, j) is request b's chain column j, predicting position sampling.positions[b] + j.
    # Room for a LogitsMasker (engine/masking/masker.py) to write into during the step; None when no
    # masker runs. A row whose flag is False is left as it is.
    verify_bitmask: torch.Tensor | None  # [B, k+1, ceil(V/32)] int32, xgrammar's packed layout
    verify_mask_flags: torch.Tensor | None  # [B, k+1] bool
    draft_bitmask: torch.Tensor | None  # [B, ceil(V/32)] int32, reused by each draft step
    draft_mask_flags: torch.Tensor | None  # [B] bool
    draft_forced: torch.Tensor | None  # [B] int64 the token a grammar forces as the next draft, -1 none
    full_drafts: bool  # host: every request has k drafts
    propose: bool  # host: some request needs new drafts (a sampling one that is not prefill-only)
    chain_max_seq_len: int  # host bound on draft-chain KV lengths
    draft_passes: int  # host: the draft chain's passes this step, <= k (adaptive k; graphs are captured per count)
    # host: the chain columns the step computes logits for and verifies: k+1, or in an eager step of one rank
    # (build_batch's `trim`) 1 + the most drafts any request has (a short chain: prompt lookup without a match,
    # adaptive or dynamic k below k); the columns past it are padding that verifies nothing
    verify_width: int
    # host copies for the update
    host_num_drafts: list[int]
    host_samples: list[bool]
    # the packed buffer the host-built tensors above are views of, and its layout (engine/runner/staging.py):
    # a graph replay copies it in one go
    staged: torch.Tensor
    staged_layout: tuple[int, ...]
    # where a head's KV is deferred (engine/speculative/deferred_kv.py), the rows a step without drafts fills it over
    # (its prompt rows); None: none
    draft_fill: DraftFill | None = None


@dataclass(frozen=True, slots=True)
class Padding:
    """Graph-mode layout: k+1 rows per request, `batch_size` requests, `table_width` blocks each;
    idle requests use draft-state row `scratch_slot` and write nothing."""

    batch_size: int
    table_width: int
    scratch_slot: int
    max_seq_len: int  # fixed bound on KV lengths (target rows and draft chains)


class NoBlocks:
    """The block manager of a batch of idle requests only (graph capture inputs, the cost probe's steps)."""

    def __init__(self, block_size: int):
        self.block_size = block_size


def build_batch(scheduled: list[ScheduledRequest], blocks: BlockManager, kv_cache: torch.Tensor,
                device: torch.device, vocab_size: int, k: int, slots: list[int] | None,
                pad: Padding | None = None, masked: bool = False, draft_passes: int | None = None,
                trim: bool = False) -> StepBatch:
    """slots: each request's row of the draft-state buffers (None: no draft network keeps state);
    masked: leave room for a LogitsMasker's bitmasks; draft_passes: how many drafts the chain makes for the
    next step (None: k; the padded layout always makes k, as its graph was captured with); trim: verify only the
    columns some request has a draft for (StepBatch.verify_width; an eager step whose logits no other rank's
    collective waits on)."""
    bs = blocks.block_size
    k1 = k + 1
    B = pad.batch_size if pad is not None else len(scheduled)
    rows = [k1 if pad is not None else s.num_new_tokens for s in scheduled] + [k1] * (B - len(scheduled))
    T = sum(rows)
    input_ids = np.zeros(T, dtype=np.int64)
    positions = np.zeros(T, dtype=np.int64)
    slot_mapping = np.full(T, -1, dtype=np.int64)
    next_tokens = np.zeros(T, dtype=np.int64)
    qsl = np.zeros(B + 1, dtype=np.int32)
    seq_lens = np.zeros(B, dtype=np.int32)
    max_blocks = pad.table_width if pad is not None else max(len(blocks.table(s.request.request_id)) for s in scheduled)
    tables = np.zeros((B, max_blocks), dtype=np.int32)
    verify_rows = np.zeros((B, k1), dtype=np.int64)
    drafts = np.zeros((B, k), dtype=np.int64)
    num_drafts = np.zeros(B, dtype=np.int64)
    samples = np.zeros(B, dtype=bool)
    slot_limit = np.zeros(B, dtype=np.int64)
    first_pos = np.zeros(B, dtype=np.int64)
    slot_ids = np.zeros(B, dtype=np.int64)
    if slots is not None:
        slot_ids[:] = list(slots) + [pad.scratch_slot if pad else 0] * (B - len(scheduled))
    propose = False

    t = 0
    for b, s in enumerate(scheduled):
        req, n = s.request, s.num_new_tokens
        start, held, num_tokens = s.start, blocks.num_slots[req.request_id], s.num_tokens
        table = blocks.table(req.request_id)
        tables[b, : len(table)] = table
        # this step's inputs and the token after; a carried request's come from the running step (overlap.py)
        window = [0] * (n + 1) if s.carried else _tokens(req, start, start + min(n, rows[b]) + 1)
        m = rows[b]
        pos = np.arange(start, start + m, dtype=np.int64)
        real = min(n, m)
        input_ids[t : t + real] = window[:real]
        positions[t : t + m] = pos
        ok = pos < held
        slot_mapping[t : t + m] = np.where(ok, kv_slots(tables, b, pos, bs), -1)
        after = window[1:]
        next_tokens[t : t + len(after)] = after
        samples[b] = s.sample
        slot_limit[b] = held
        if s.sample:
            nd = start + n - num_tokens
            num_drafts[b] = nd
            if not s.carried:
                drafts[b, :nd] = req.spec_token_ids[:nd]
            first = t + num_tokens - 1 - start  # row of the last verified token
            verify_rows[b] = first + np.minimum(np.arange(k1), nd)
            propose = True  # a prefill-only request's first drafts travel with its hand-over (engine/handover.py)
        else:
            verify_rows[b] = t + real - 1
        first_pos[b] = num_tokens
        t += m
        qsl[b + 1] = t
        seq_lens[b] = start + m
    for b in range(len(scheduled), B):  # idle requests: k+1 rows over nothing, writing nothing
        positions[t : t + k1] = np.arange(k1)
        verify_rows[b] = t + np.arange(k1)
        t += k1
        qsl[b + 1] = t
        seq_lens[b] = k1

    # every array of the step and its sampling columns in one host-to-device copy (engine/runner/staging.py)
    host = dict(input_ids=input_ids, positions=positions, slot_mapping=slot_mapping, tables=tables,
                seq_lens=seq_lens, qsl=qsl, verify_rows=verify_rows, drafts=drafts, num_drafts=num_drafts,
                next_tokens=next_tokens, samples=samples, slot_ids=slot_ids, slot_limit=slot_limit)
    columns = sampling_columns([s.request for s in scheduled], first_pos, B)
    staged = to_device([*host.values(), *columns.values()], device)
    sent = staged.tensors
    on_dev, columns = dict(zip(host, sent)), dict(zip(columns, sent[len(host):]))
    dev = on_dev.__getitem__
    max_seq_len = pad.max_seq_len if pad is not None else int(seq_lens.max())
    attn = AttentionMetadata(kv_cache=kv_cache, slot_mapping=dev("slot_mapping"), block_tables=dev("tables"),
                             seq_lens=dev("seq_lens"), query_start_loc=dev("qsl"), max_q_len=max(rows),
                             max_seq_len=max_seq_len)
    sampling = build_sampling([s.request for s in scheduled], first_pos, B, device, vocab_size,
                              columns=columns)
    n = len(scheduled)
    words = -(-vocab_size // 32)
    masks = dict(verify_bitmask=None, verify_mask_flags=None, draft_bitmask=None, draft_mask_flags=None,
                 draft_forced=None)
    if masked:
        masks = dict(verify_bitmask=torch.zeros((B, k1, words), dtype=torch.int32, device=device),
                     verify_mask_flags=torch.zeros((B, k1), dtype=torch.bool, device=device),
                     draft_bitmask=torch.zeros((B, words), dtype=torch.int32, device=device),
                     draft_mask_flags=torch.zeros(B, dtype=torch.bool, device=device),
                     draft_forced=torch.full((B,), -1, dtype=torch.int64, device=device))
    return StepBatch(
        input_ids=dev("input_ids"), positions=dev("positions"), attn=attn, verify_rows=dev("verify_rows"),
        drafts=dev("drafts"), num_drafts=dev("num_drafts"), next_tokens=dev("next_tokens"), samples=dev("samples"),
        slots=dev("slot_ids"), slot_limit=dev("slot_limit"), sampling=sampling, **masks,
        full_drafts=pad is None and bool((num_drafts[samples] == k).all()), propose=propose or pad is not None,
        chain_max_seq_len=max_seq_len + chain_margin(k),
        draft_passes=k if draft_passes is None else draft_passes,
        verify_width=int(num_drafts[samples].max(initial=0)) + 1 if trim and pad is None else k1,
        host_num_drafts=num_drafts[:n].tolist(), host_samples=samples[:n].tolist(), staged=staged.buffer,
        staged_layout=staged.layout)


def _tokens(req, lo: int, hi: int) -> list[int]:
    """Tokens lo..hi-1 of the request's tokens followed by its drafts (without copying all of them)."""
    n = len(req.token_ids)
    if hi <= n:
        return req.token_ids[lo:hi]
    return req.token_ids[lo:] + req.spec_token_ids[max(0, lo - n) : hi - n]
