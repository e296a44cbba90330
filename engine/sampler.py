"""Sampling from a batch of logits with per-request parameters, without host syncs.

Randomness is counter-based (kernels/rng.py): the token at sequence position P of a request with
seed S is sampled with noise that depends only on (S, P), never on the batch it shares; that is what
makes seeded sampling batch-invariant and lets speculation reproduce the same draws.
Order of processing: penalties -> temperature -> top-k -> top-p -> min-p -> exponential race.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import rng


@dataclass(frozen=True, slots=True)
class SamplingBatch:
    temperature: torch.Tensor  # [N] f32, 0 = greedy
    top_k: torch.Tensor  # [N] int64, 0 = off
    top_p: torch.Tensor  # [N] f32, 1 = off
    min_p: torch.Tensor  # [N] f32, 0 = off
    seeds: torch.Tensor  # [N] int64
    positions: torch.Tensor  # [N] int64 sequence position of the token being sampled
    # host-side facts about the batch, decided when it is built (no syncs at sampling time)
    all_greedy: bool
    use_top_k: bool
    use_top_p: bool
    use_min_p: bool
    max_logprobs: int | None  # None: nobody asked; else the largest top-n requested
    # penalties (None when no request uses them)
    repetition: torch.Tensor | None = None  # [N] f32
    presence: torch.Tensor | None = None  # [N] f32
    frequency: torch.Tensor | None = None  # [N] f32
    output_counts: torch.Tensor | None = None  # [N, V] f32 counts of each id among output tokens
    seen_mask: torch.Tensor | None = None  # [N, V] bool: id occurs in prompt or output


@dataclass(frozen=True, slots=True)
class SamplerOutput:
    token_ids: torch.Tensor  # [N] int64
    logprobs: torch.Tensor | None  # [N] f32 logprob of the sampled token under the raw model distribution
    top_ids: torch.Tensor | None  # [N, n] int64
    top_logprobs: torch.Tensor | None  # [N, n] f32


def apply_penalties(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    if b.repetition is None:
        return logits
    rep = b.repetition[:, None]
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(b.seen_mask, penalized, logits)
    logits = logits - b.frequency[:, None] * b.output_counts
    return logits - b.presence[:, None] * (b.output_counts > 0).to(logits.dtype)


def processed_logits(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p applied; masked entries are -inf. Rows with temperature 0
    are scaled by 1 (their token is the argmax anyway)."""
    temp = torch.where(b.temperature > 0, b.temperature, torch.ones_like(b.temperature))
    logits = logits / temp[:, None]
    if b.use_top_k or b.use_top_p:
        logits = _top_k_top_p(logits, b)
    if b.use_min_p:
        probs = logits.softmax(dim=-1)
        threshold = b.min_p[:, None] * probs.amax(dim=-1, keepdim=True)
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


def _top_k_top_p(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    rank = torch.arange(vocab, device=logits.device)[None, :]
    remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if b.use_top_k:
        k = torch.where(b.top_k > 0, b.top_k, torch.full_like(b.top_k, vocab))
        remove |= rank >= k[:, None]
    if b.use_top_p:
        probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        # Keep the smallest prefix whose mass reaches top_p; the first token always stays.
        remove |= (mass_before >= b.top_p[:, None]) & (rank > 0)
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def sample(logits: torch.Tensor, b: SamplingBatch) -> SamplerOutput:
    """logits [N, V] fp32 -> one token per row."""
    raw_logprobs = logits.log_softmax(dim=-1) if b.max_logprobs is not None else None
    logits = apply_penalties(logits, b)
    greedy = logits.argmax(dim=-1)
    if b.all_greedy:
        tokens = greedy
    else:
        probs = processed_logits(logits, b).softmax(dim=-1)
        noise = rng.exponential(b.seeds, b.positions, logits.shape[-1], rng.STREAM_SAMPLE)
        sampled = (probs / noise).argmax(dim=-1)
        tokens = torch.where(b.temperature > 0, sampled, greedy)
    if raw_logprobs is None:
        return SamplerOutput(tokens, None, None, None)
    token_lp = raw_logprobs.gather(-1, tokens[:, None]).squeeze(-1)
    top_lp, top_ids = (raw_logprobs.topk(b.max_logprobs, dim=-1) if b.max_logprobs > 0 else (None, None))
    return SamplerOutput(tokens, token_lp, top_ids, top_lp)
