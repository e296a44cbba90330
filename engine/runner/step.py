"""The engine's step as one function (docs/architecture.md, "The decode step"); no speculation is k = 0 of it:

1. target forward over every row (prompt chunks and [last token + k drafts] chains), capturing the
   hidden states the draft head reads;
2. logits at each chain's k+1 columns, masked by the LogitsMasker when one runs;
3. verification of each chain (greedy; a request with its own seed by coupling: each position's token is
   the plain sampler's own draw, a draft accepted iff equal, so the schedule never changes its output;
   the others by lossless rejection sampling against the draft distributions kept from the previous
   step; engine/sample/verify.py); with k = 0 that is plain sampling;
4. the draft: its KV over all rows, then k drafts from each request's last verified row, each draft
   step masked too (a head's KV over decoding rows waits while no step drafts: engine/speculative/deferred_kv.py).

No host syncs and no data-dependent shapes: everything that depends on how many drafts were
accepted (rows, positions, slots) is a gather on the device. Rejected drafts need no cleanup: the
KV past a request's verified length is overwritten before anything reads it.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial

import torch

from engine.layers.attention import attention_context
from engine.masking.masker import LogitsMasker, StepMasks
from engine.models.llama import LlamaForCausalLM
from engine.runner.batch import StepBatch
from engine.sample.verify import Verified, verify
from engine.speculative.deferred_kv import stash_rows
from engine.speculative.proposer import ProposeInputs, Proposer


@dataclass(frozen=True, slots=True)
class StepOutput:
    tokens: torch.Tensor  # [B, k+1] int64 emitted tokens, -1 after the last
    num_accepted: torch.Tensor  # [B] int64 accepted drafts
    drafts: torch.Tensor | None  # [B, k] int64 next step's drafts (None: no draft network ran)
    logprobs: torch.Tensor | None  # [B, k+1] f32
    top_ids: torch.Tensor | None  # [B, k+1, n] int64
    top_logprobs: torch.Tensor | None  # [B, k+1, n] f32
    # [B] int64 draft trees: bit j set where the next tree's node j is one its grammar forced (a chain's host knows
    # its forced drafts from the grammar's fills: GuidedRequests.forced_steps); None for chains
    forced: torch.Tensor | None = None


def _widened(v: Verified, k1: int) -> Verified:
    """A verification of fewer columns laid out as k+1 (tokens -1 past the last, as verify leaves them)."""
    pad = k1 - v.tokens.shape[1]
    if pad == 0:
        return v

    def widen(t: torch.Tensor | None, fill) -> torch.Tensor | None:
        if t is None:
            return None
        return torch.cat([t, t.new_full((t.shape[0], pad, *t.shape[2:]), fill)], 1)

    return replace(v, tokens=widen(v.tokens, -1), logprobs=widen(v.logprobs, 0.0), top_ids=widen(v.top_ids, 0),
                   top_logprobs=widen(v.top_logprobs, 0.0))


def model_step(target: LlamaForCausalLM, proposer: Proposer | None, batch: StepBatch,
               draft_probs: torch.Tensor | None, masker: LogitsMasker | None = None,
               draft_masks: bool = True) -> StepOutput:
    """draft_probs: the draft distributions buffer [slots, k, V] (None while every request is greedy);
    read at the requests' slots for verification, overwritten there with the new drafts'.
    masker: fills the batch's bitmasks (its host snapshot of the step was taken before launch);
    draft_masks: it masks the draft steps too, not only the verification rows."""
    capture = proposer.capture_layers if proposer is not None else ()
    with attention_context(batch.attn):
        final, captured = target(batch.input_ids, batch.positions, tuple(sorted(set(capture))))
    B, k1 = batch.verify_rows.shape
    w = batch.verify_width  # columns with a draft or the bonus: no logits past them (a short chain's LM head rows)
    rows = batch.verify_rows if w == k1 else batch.verify_rows[:, :w]
    logits = target.compute_logits(final.index_select(0, rows.reshape(-1))).view(B, w, -1)  # [B, w, V]
    masks = StepMasks(masker, batch) if masker is not None else None
    use_probs = proposer is not None and draft_probs is not None and not batch.sampling.all_greedy
    q = draft_probs[batch.slots, : w - 1] if use_probs else None  # [B, w-1, V]
    mask = None if masks is None else masks.verify if w == k1 else partial(masks.verify, width=w)
    v = _widened(verify(logits, batch.drafts[:, : w - 1], batch.num_drafts, q, batch.sampling, batch.full_drafts, mask),
                 k1)
    if proposer is None:
        return StepOutput(v.tokens, v.num_accepted, None, v.logprobs, v.top_ids, v.top_logprobs)

    a = v.num_accepted[:, None]
    out_rows = batch.verify_rows.gather(1, a)[:, 0]  # [B] last verified row
    bonus = v.tokens.gather(1, a)[:, 0]  # [B] the token after it
    after = batch.next_tokens.index_select(0, out_rows)
    next_tokens = batch.next_tokens.index_copy(0, out_rows, torch.where(batch.samples, bonus, after))
    hidden = proposer.first_hidden(final, captured)  # [T, H_in] or None
    input_ids, positions, attn = batch.input_ids, batch.positions, batch.attn
    if proposer.stash is not None:  # the head's KV may be deferred (engine/speculative/deferred_kv.py)
        stash_rows(proposer.stash, batch.attn.slot_mapping, hidden)
        if batch.draft_passes == 0:  # no drafts this step: the head's pass runs over prompt rows only, if any
            fill = batch.draft_fill
            if fill is None:
                return StepOutput(v.tokens, v.num_accepted, None, v.logprobs, v.top_ids, v.top_logprobs)
            hidden, next_tokens = hidden.index_select(0, fill.rows), next_tokens.index_select(0, fill.rows)
            input_ids, positions, attn = input_ids.index_select(0, fill.rows), positions.index_select(0, fill.rows), \
                fill.attn
    drafts, probs = proposer.propose(ProposeInputs(
        hidden=hidden, input_ids=input_ids, next_tokens=next_tokens, positions=positions,
        attn=attn, out_rows=out_rows, slot_limit=batch.slot_limit, max_seq_len=batch.chain_max_seq_len,
        chain=batch.propose and batch.draft_passes > 0, sampling=batch.sampling, passes=batch.draft_passes,
        mask=masks.draft_step(v.tokens, v.num_accepted) if masks is not None and draft_masks else None))
    if use_probs and probs is not None:
        if probs.shape[1] == draft_probs.shape[1]:
            draft_probs.index_copy_(0, batch.slots, probs.to(draft_probs.dtype))
        else:  # a shorter chain (adaptive k): the columns past it are never read
            draft_probs[batch.slots, : probs.shape[1]] = probs.to(draft_probs.dtype)
    return StepOutput(v.tokens, v.num_accepted, drafts, v.logprobs, v.top_ids, v.top_logprobs)
