"""Verification of draft trees (engine/speculative/tree.py): the target's token at every node, then the longest
path of drafts the target agrees with.

Each node's logits go through the sampler's own processing (logit bias, min_tokens, the grammar mask, penalties
counted over the output plus the node's ancestors, temperature, top-k/p, min-p), and the target's token there is
the plain sampler's draw at the node's position: the argmax for a greedy row, else the exponential race on the
STREAM_SAMPLE numbers of (seed, position) (kernels/rng.py). From the root, the child whose token equals the
target's token is accepted and the walk goes on from it; where no child matches, the target's token is emitted
and the step ends.

Why this is lossless: along the accepted path every node's prefix is the real output, so the token emitted at
each position is exactly the one the sampler without speculation draws there; a seeded request's output is bit
for bit the output without speculation, and any request's tokens have the target's distribution. It is the
recursive rejection over siblings (multi-candidate speculative sampling) for drafts that are not sampled but
chosen (top-k): each child's q is one-hot, so "accept child x with probability p(x), else go on with p
renormalized without x" accepts one of the children with probability sum p(children), the same as this draw,
and the token emitted after a rejection of all is a draw from p restricted to the rest, the same law too.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch

from engine.sample.sampler import (SamplingBatch, apply_logit_bias, apply_penalties, block_early_stops,
                                   processed_logits, race)
from kernels.tree_walk import walk  # the path down a verified tree: one launch on a GPU


@dataclass(frozen=True, slots=True)
class TreeVerified:
    tokens: torch.Tensor  # [B, k+1] int64 emitted: the accepted path's drafts, the target's token after, then -1
    num_accepted: torch.Tensor  # [B] int64 accepted drafts
    path: torch.Tensor  # [B, k+1] int64 node of each emitted column (0: the root); past the last, the last
    logprobs: torch.Tensor | None  # [B, k+1] f32 raw-model logprob of each emitted token
    top_ids: torch.Tensor | None  # [B, k+1, n] int64
    top_logprobs: torch.Tensor | None  # [B, k+1, n] f32


def strict_ancestors(ancestors: torch.Tensor) -> torch.Tensor:
    """ancestors [B, N+1] int64 bit sets (bit i: node i, itself included) -> [B, N+1, N] bool: node j+1 is a
    proper ancestor of node i (the root, node 0, is left out: its token is not a draft)."""
    n = ancestors.shape[1] - 1
    j = torch.arange(1, n + 1, device=ancestors.device)
    inside = ((ancestors[:, :, None] >> j) & 1).bool()
    return inside & (j[None, None, :] != torch.arange(n + 1, device=ancestors.device)[None, :, None])


def per_node(b: SamplingBatch, drafts: torch.Tensor, depth: torch.Tensor, ancestors: torch.Tensor) -> SamplingBatch:
    """[B] rows -> [B * (N+1)] rows, one per node: a node at depth d samples position positions + d, is d
    tokens further into min_tokens, and its penalties count its ancestors' drafts. An all-greedy batch keeps its [B]
    temperatures, filters, seeds and positions: nothing reads them (each op here is a launch on a GPU)."""
    B, n1 = depth.shape
    rep = lambda t: t.repeat_interleave(n1, dim=0)  # noqa: E731
    fields = {}
    if not b.all_greedy:  # what sampling reads (target_tokens); an all-greedy step takes the argmax and skips them
        fields.update(temperature=rep(b.temperature), top_k=rep(b.top_k), top_p=rep(b.top_p), min_p=rep(b.min_p),
                      seeds=rep(b.seeds), positions=(b.positions[:, None] + depth).reshape(-1))
    if b.coupled is not None:
        fields.update(coupled=rep(b.coupled))
    if b.logit_bias is not None:
        fields.update(logit_bias=rep(b.logit_bias))
    if b.early_stop_block is not None:
        fields.update(early_stop_block=rep(b.early_stop_block),
                      min_tokens_left=rep(b.min_tokens_left) - depth.reshape(-1))
    if b.repetition is not None:
        V = b.output_counts.shape[-1]
        one_hot = torch.zeros(B, drafts.shape[1], V, device=drafts.device).scatter_(2, drafts[..., None], 1.0)
        before = strict_ancestors(ancestors).to(one_hot.dtype) @ one_hot  # [B, N+1, V]
        counts = b.output_counts[:, None] + before
        fields.update(repetition=rep(b.repetition), presence=rep(b.presence), frequency=rep(b.frequency),
                      output_counts=counts.reshape(B * n1, V),
                      seen_mask=(b.seen_mask[:, None] | (before > 0)).reshape(B * n1, V))
    return replace(b, **fields)


def target_tokens(logits: torch.Tensor, pb: SamplingBatch, all_greedy: bool,
                  mask: Callable[[torch.Tensor], None] | None) -> torch.Tensor:
    """logits [R, V] f32 of R nodes, pb their per-node sampling -> [R] int64 the sampler's token at each."""
    flat = apply_logit_bias(logits, pb.logit_bias)
    flat = block_early_stops(flat, pb)
    if mask is not None:
        mask(flat)
    flat = apply_penalties(flat, pb)
    greedy = flat.argmax(-1)
    if all_greedy:
        return greedy
    drawn = race(processed_logits(flat, pb).softmax(-1), pb.seeds, pb.positions)
    return torch.where(pb.temperature > 0, drawn, greedy)


def verify_tree(logits: torch.Tensor, drafts: torch.Tensor, parents: torch.Tensor, depth: torch.Tensor,
                ancestors: torch.Tensor, num_drafts: torch.Tensor, b: SamplingBatch, max_depth: int,
                mask: Callable[[torch.Tensor], None] | None = None) -> TreeVerified:
    """logits [B, N+1, V] f32 at each node (node 0: the root, the request's last verified token); drafts [B, N]
    int64 node tokens; parents [B, N] (node j+1's parent, 0 = root); depth, ancestors [B, N+1] (tree.py);
    num_drafts [B]; b: the requests' sampling with `positions` = the root's next position; max_depth: k;
    mask: constrains [B * (N+1), V] logits in place (a LogitsMasker's), after the raw logprobs."""
    B, n1, V = logits.shape
    flat = logits.reshape(B * n1, V)
    raw_logprobs = flat.log_softmax(-1) if b.max_logprobs is not None else None
    pb = per_node(b, drafts, depth, ancestors)
    target = target_tokens(flat, pb, b.all_greedy, mask).view(B, n1)
    path, accepted, tokens = walk(target, drafts, parents, num_drafts, max_depth)  # tokens: -1 past the accepted
    if raw_logprobs is None:
        return TreeVerified(tokens, accepted, path, None, None, None)
    lp = raw_logprobs.view(B, n1, V).gather(1, path[..., None].expand(B, max_depth + 1, V))  # [B, k+1, V]
    token_lp = lp.gather(-1, tokens.clamp(min=0)[..., None])[..., 0]
    if b.max_logprobs > 0:
        top_lp, top_ids = lp.topk(b.max_logprobs, dim=-1)
        return TreeVerified(tokens, accepted, path, token_lp, top_ids, top_lp)
    return TreeVerified(tokens, accepted, path, token_lp, None, None)
