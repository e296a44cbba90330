"""The engine's side of verification: logits processed exactly as the sampler does, then the draft check.

The target's logits at the k+1 positions of each chain go through the sampler's own processing
(logit bias, grammar mask, penalties counted over the output plus the drafts before each position, then
temperature, top-k, top-p, min-p), so p is the distribution a run without speculation samples from.
Requests may carry fewer drafts than k (prompt lookup misses, the end of max_tokens); acceptance is cut
at their count and the token after it is drawn from p, as the bonus would be.

Two ways to check a sampled draft, chosen per request:
  - coupled (a request with its own seed): the target's token at each chain position P is the plain
    sampler's draw at P (the STREAM_SAMPLE race over p); a draft is accepted iff it equals that draw, the
    first mismatch emits the draw, and with every draft accepted the bonus is the draw at P+k. The output is
    then bit for bit the output without speculation, whatever the drafting schedule (k, batch, preemption,
    resumption): the seed's promise. Drafters draw with the same numbers (engine/speculative/proposer.py),
    so a draft whose q is near p lands on the same token (the Gumbel coupling);
  - rejection sampling (kernels/verify.py; requests whose seed the engine drew): lossless in
    distribution, with the optimal single-draft acceptance 1 - TV(p, q), but the token at a position depends
    on whether it was checked as a draft, drawn as a residual or drawn plainly.
Both run on the whole batch and rows pick theirs: fixed shapes, no host sync. bench/spec_coupling.py
measures the acceptance of each.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch

from engine.sample.sampler import (SamplingBatch, apply_logit_bias, apply_penalties, block_early_stops,
                                   processed_logits, race, sample)
from kernels.verify import verify_greedy, verify_rejection


@dataclass(frozen=True, slots=True)
class Verified:
    tokens: torch.Tensor  # [B, k+1] int64: accepted drafts, the bonus/corrected token, then -1
    num_accepted: torch.Tensor  # [B] int64 accepted drafts (emitted tokens = num_accepted + 1)
    logprobs: torch.Tensor | None  # [B, k+1] f32 raw-model logprob of each emitted token
    top_ids: torch.Tensor | None  # [B, k+1, n] int64
    top_logprobs: torch.Tensor | None  # [B, k+1, n] f32


def per_position(b: SamplingBatch, drafts: torch.Tensor) -> SamplingBatch:
    """[B] rows -> [B * (k+1)] rows, one per chain position: positions advance by one and penalty
    counts include the drafts before each position."""
    B, k = drafts.shape
    k1 = k + 1
    rep = lambda t: t.repeat_interleave(k1, dim=0)  # noqa: E731
    offsets = torch.arange(k1, device=drafts.device)
    fields = dict(temperature=rep(b.temperature), top_k=rep(b.top_k), top_p=rep(b.top_p), min_p=rep(b.min_p),
                  seeds=rep(b.seeds), positions=(b.positions[:, None] + offsets).reshape(-1))
    if b.coupled is not None:
        fields.update(coupled=rep(b.coupled))
    if b.logit_bias is not None:
        fields.update(logit_bias=rep(b.logit_bias))
    if b.early_stop_block is not None:  # each position one output token further
        fields.update(early_stop_block=rep(b.early_stop_block),
                      min_tokens_left=rep(b.min_tokens_left) - offsets.repeat(B))
    if b.repetition is not None:
        V = b.output_counts.shape[-1]
        one_hot = torch.zeros(B, k, V, device=drafts.device).scatter_(2, drafts[..., None], 1.0)
        before = torch.cat([one_hot.new_zeros(B, 1, V), one_hot.cumsum(1)], 1)  # [B, k+1, V]
        counts = b.output_counts[:, None] + before
        fields.update(repetition=rep(b.repetition), presence=rep(b.presence), frequency=rep(b.frequency),
                      output_counts=counts.reshape(B * k1, V),
                      seen_mask=(b.seen_mask[:, None] | (before > 0)).reshape(B * k1, V))
    return replace(b, **fields)


def verify(logits: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor, draft_probs: torch.Tensor | None,
           b: SamplingBatch, full_drafts: bool, mask: Callable[[torch.Tensor], None] | None = None) -> Verified:
    """logits [B, k+1, V] f32 at each chain's positions; drafts [B, k] int64 (any id past num_drafts);
    num_drafts [B] int64; draft_probs [B, k, V] (None: drafts are deterministic, q one-hot);
    b: the requests' sampling with `positions` = the position of each chain's first new token;
    full_drafts: host fact that every request has k drafts (skips the separate bonus draw);
    mask: constrains [B * (k+1), V] logits in place (a LogitsMasker's), after the raw logprobs.
    With k = 0 this is the sampler itself: verifying no drafts is sampling one token."""
    B, k1, V = logits.shape
    flat = logits.reshape(B * k1, V)
    if k1 == 1:
        s = sample(flat, b, mask)
        column = lambda t: None if t is None else t[:, None]  # noqa: E731  [B, ...] -> [B, 1, ...]
        return Verified(s.token_ids[:, None], torch.zeros_like(s.token_ids), column(s.logprobs),
                        column(s.top_ids), column(s.top_logprobs))
    raw_logprobs = flat.log_softmax(-1) if b.max_logprobs is not None else None
    flat = apply_logit_bias(flat, None if b.logit_bias is None else b.logit_bias.repeat_interleave(k1, dim=0))
    if b.early_stop_block is not None:
        chain = replace(b, early_stop_block=b.early_stop_block.repeat_interleave(k1, dim=0),
                        min_tokens_left=b.min_tokens_left.repeat_interleave(k1, dim=0))
        flat = block_early_stops(flat, chain, torch.arange(k1, device=flat.device).repeat(B))
    if mask is not None:
        mask(flat)
    # Per-position rows exist for penalties and sampling; a greedy batch without penalties needs neither.
    pb = per_position(b, drafts) if b.repetition is not None or not b.all_greedy else b
    flat = apply_penalties(flat, pb)
    if b.all_greedy:
        out, accepted = verify_greedy(flat.view(B, k1, V), drafts)
        dist = flat.view(B, k1, V)
    else:
        greedy = flat.argmax(-1)  # [B * (k+1)] the sampler's token for greedy rows
        flat = processed_logits(flat, pb)
        # Processing is done: the kernel keeps greedy rows greedy and samples the rest from softmax(flat).
        temperature = (b.temperature > 0).to(torch.float32)
        out, accepted = verify_rejection(flat.view(B, k1, V), drafts, draft_probs, temperature,
                                         torch.zeros_like(b.top_k), torch.ones_like(b.top_p), b.seeds, b.positions,
                                         has_filters=False)
        if b.coupled is not None:
            draws = torch.where(pb.temperature > 0, race(flat.softmax(-1), pb.seeds, pb.positions), greedy)
            coupled_out, coupled_accepted = verify_coupled(draws.view(B, k1), drafts)
            out = torch.where(b.coupled[:, None], coupled_out, out)
            accepted = torch.where(b.coupled, coupled_accepted.to(accepted.dtype), accepted)
        dist = flat.view(B, k1, V)
    accepted = accepted.to(torch.int64)
    if not full_drafts:
        accepted, out = _cut_at_num_drafts(out, accepted, drafts, num_drafts, dist, b)
    tokens = out
    if raw_logprobs is None:
        return Verified(tokens, accepted, None, None, None)
    lp = raw_logprobs.view(B, k1, V)
    token_lp = lp.gather(-1, tokens.clamp(min=0)[..., None])[..., 0]
    if b.max_logprobs > 0:
        top_lp, top_ids = lp.topk(b.max_logprobs, dim=-1)
        return Verified(tokens, accepted, token_lp, top_ids, top_lp)
    return Verified(tokens, accepted, token_lp, None, None)


def verify_coupled(draws: torch.Tensor, drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """draws [B, k+1] int64: the target's own token at each chain position (the sampler's draw there, the
    argmax for greedy rows); drafts [B, k]. -> (tokens [B, k+1]: the drafts equal to the draws, then the
    draw at the first mismatch, or the bonus draw, then -1; accepted [B] int64)."""
    accepted = (draws[:, :-1] == drafts).to(torch.int64).cumprod(1).sum(1)
    return _emit(drafts, accepted, draws.gather(1, accepted[:, None])[:, 0]), accepted


def _emit(drafts: torch.Tensor, accepted: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """[B, k+1]: drafts [B, k] before accepted [B], last [B] at it, -1 after."""
    B, k = drafts.shape
    j = torch.arange(k + 1, device=drafts.device)[None, :]
    padded = torch.cat([drafts, drafts.new_full((B, 1), -1)], 1)
    a = accepted[:, None]
    return torch.where(j < a, padded, torch.where(j == a, last[:, None], -1))


def _cut_at_num_drafts(out, accepted, drafts, num_drafts, dist, b: SamplingBatch):
    """Acceptance past a request's own drafts does not count; the token after its last draft is then a
    draw from p at that position (greedy: the argmax; else the STREAM_SAMPLE race, as the sampler)."""
    B, k1, V = dist.shape
    n = num_drafts.to(torch.int64)
    cut = accepted >= n
    accepted = torch.minimum(accepted, n)
    at_n = dist.gather(1, n[:, None, None].expand(B, 1, V))[:, 0]  # [B, V]
    bonus = at_n.argmax(-1)
    if not b.all_greedy:
        bonus = torch.where(b.temperature > 0, race(at_n.softmax(-1), b.seeds, b.positions + n), bonus)
    last = torch.where(cut, bonus, out.gather(1, accepted[:, None])[:, 0])
    return accepted, _emit(drafts, accepted, last)
