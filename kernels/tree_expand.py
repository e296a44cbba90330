"""A draft tree's expansion in fused kernels (engine/speculative/tree.py `expand`): per depth one launch scores the
frontier's candidates and keeps the best as the next frontier (`expand_depth`); one more chooses the N best nodes of
the whole expansion (`choose`, below).

Why a kernel: on a GPU at batch 1 the decode step of a small model is launch-bound (each kernel a node of the
captured graph, a few microseconds whatever its work), and the expansion's bookkeeping per depth (bucketing,
the acceptance-table lookup, cumulative scores, the forced flags, the draft-to-target map, the top-k of the
frontier, and the gathers of the chosen nodes' tokens, paths and lineage) was about fifty small torch ops: a tree
step launched more kernels than a chain step verifying as many rows, and ran slower than it
(bench/results/tree_vs_chain_cuda.md, bench/results/tree_ops_triton_cpu.md). Here it is one launch, one program per
request.

Inputs, for B requests whose frontier has R rows, each proposing its K best draft tokens (R = 1 at the root):
  log_probs [B, R, K] float: the candidates' draft log-probabilities, each row's in descending order (a top-k);
  draft_ids [B, R, K] int64: their draft-vocabulary ids (remap [Vd] int64 maps them to target ids; None: same);
  parent_score [B, R] float and parent_candidate [B, R] int64: each row's cumulative score and candidate index
  (None at the root: score 0, parent -1);
  masked [B, R] bool: a grammar masked the row; sampled [B] bool: the request samples;
  log_rate [CLASSES * K * num_buckets] float or None: the acceptance table's log estimates
  (engine/speculative/tree_score.py: cell ((2 * sampled + masked) * K + rank) * num_buckets + bucket, bucket the
  draft probability's); None scores a candidate by its log-probability;
  path [B, R, D] int64 (D >= 0) and lineage [B, R] int64: each row's path of tokens and ancestor bits (bit i: the
  frontier row at KV offset i after the root, kernels/tree_mask.py); own_shift: the offset of the next frontier's
  first row (its row of rank r sits at own_shift + r); span: the frontier rows' positions the next head pass sees;
  forced_child [B, R] int64 or None: a row's grammar-forced child (target id; -1 none), which becomes its first
  candidate, of log-probability 0, its others -inf: what a one-token mask makes of a child inside the draft
  vocabulary, and here of one outside it too (whose masked row admits nothing; engine/masking/grammar.py).
Outputs: per candidate m = r * K + j (in that order) its cumulative score, table cell (-1: not scored), forced flag
(probability 1 in a masked row), target token and parent candidate, all [B, R * K]; and the next frontier, the K
best candidates by cumulative score (ties to the lower index, as a stable sort), best first: score [B, K],
candidate index (offset + m) [B, K], row (its parent's lane) [B, K], token [B, K], path [B, K, D + 1] (the parent's
path, then the token), lineage [B, K] (the parent row's, and its own bit own_shift + rank) and the tree mask of its
head pass [B, K] (kernels/tree_mask.py `window_bits` of the lineage over the last `span` positions). A forced or
refused (-inf) candidate keeps its log-probability as its score: 0 and -inf, never a table estimate.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from kernels._dispatch import use_triton
from kernels.tree_mask import ancestor_bits, window_bits


class Depth(NamedTuple):
    scores: torch.Tensor  # [B, R*K] float32 cumulative
    cells: torch.Tensor  # [B, R*K] int64
    forced: torch.Tensor  # [B, R*K] bool
    tokens: torch.Tensor  # [B, R*K] int64 target ids
    parents: torch.Tensor  # [B, R*K] int64 parent candidate (-1: the root)
    best: torch.Tensor  # [B, K] float32
    candidate: torch.Tensor  # [B, K] int64 offset + index
    lane: torch.Tensor  # [B, K] int64 the parent's row
    next_tokens: torch.Tensor  # [B, K] int64
    path: torch.Tensor  # [B, K, D+1] int64
    lineage: torch.Tensor  # [B, K] int64
    tree_mask: torch.Tensor  # [B, K] int64


def table_cells(log_probs: torch.Tensor, rank: torch.Tensor, sampled: torch.Tensor, masked: torch.Tensor, topk: int,
                num_buckets: int) -> torch.Tensor:
    """The acceptance table's cell of each candidate (engine/speculative/tree_score.py, the kernel's rule): log_probs
    [B, ...], rank broadcastable to it (0: a parent's best), sampled [B] bool, masked bool broadcastable to it -> flat
    cell indices; -1 for a forced candidate (probability 1) or a refused one (-inf): neither is estimated."""
    bucket = (log_probs.exp() * num_buckets).long().clamp(0, num_buckets - 1)
    cls = sampled.long().view(-1, *([1] * (log_probs.dim() - 1))) * 2 + masked.long()
    cells = (cls * topk + rank) * num_buckets + bucket
    return torch.where((log_probs == 0) | torch.isneginf(log_probs), -1, cells)


def table_scores(log_probs: torch.Tensor, cells: torch.Tensor, log_rate: torch.Tensor) -> torch.Tensor:
    """Each candidate's log estimated acceptance, looked up at its cell in log_rate; a candidate without a cell keeps
    its log-probability (0 forced, -inf refused)."""
    est = log_rate.gather(0, cells.clamp(min=0).flatten()).view_as(log_probs)
    return torch.where(cells < 0, log_probs, est)


def expand_depth_ref(log_probs: torch.Tensor, draft_ids: torch.Tensor, parent_score: torch.Tensor | None,
                     parent_candidate: torch.Tensor | None, masked: torch.Tensor, sampled: torch.Tensor,
                     log_rate: torch.Tensor | None, num_buckets: int, remap: torch.Tensor | None,
                     path: torch.Tensor | None, lineage: torch.Tensor | None, offset: int, own_shift: int,
                     span: int, out: tuple[torch.Tensor, ...] | None = None,
                     forced_child: torch.Tensor | None = None) -> Depth:
    B, R, K = log_probs.shape
    dev = log_probs.device
    lp = log_probs.float()
    if forced_child is not None:
        on, first = forced_child[:, :, None] >= 0, torch.arange(K, device=dev) == 0
        lp = torch.where(on, torch.where(first, 0.0, float("-inf")), lp)
    if log_rate is not None:
        cells = table_cells(lp, torch.arange(K, device=dev), sampled, masked[:, :, None], K, num_buckets)
        score = table_scores(lp, cells, log_rate.float())
    else:
        cells = torch.full_like(draft_ids, -1)
        score = lp
    if parent_score is not None:
        score = score + parent_score.float()[:, :, None]
    forced = (lp == 0) & masked[:, :, None]
    tokens = draft_ids if remap is None else remap[draft_ids]
    if forced_child is not None:
        tokens = torch.where(on & first, forced_child[:, :, None], tokens)
    parents = (parent_candidate[:, :, None].expand(B, R, K) if parent_candidate is not None
               else torch.full_like(draft_ids, -1))
    score, tokens = score.reshape(B, R * K), tokens.reshape(B, R * K)
    pick = torch.sort(score, dim=1, descending=True, stable=True).indices[:, :K]
    lane = pick // K
    next_tokens = tokens.gather(1, pick)
    D = path.shape[2] if path is not None else 0
    old = path.gather(1, lane[:, :, None].expand(B, K, D)) if D else tokens.new_zeros((B, K, 0))
    own = torch.bitwise_left_shift(torch.ones_like(lane), own_shift + torch.arange(K, device=dev))
    lineage = (lineage.gather(1, lane) if lineage is not None else torch.zeros_like(lane)) | own
    fields = [score, cells.reshape(B, R * K), forced.reshape(B, R * K), tokens, parents.reshape(B, R * K)]
    if out is not None:  # into the whole expansion's columns offset.. (as the kernel writes them)
        for buf, value in zip(out, fields):
            buf[:, offset: offset + R * K].copy_(value)
        fields = [buf[:, offset: offset + R * K] for buf in out]
    return Depth(*fields, score.gather(1, pick), offset + pick, lane, next_tokens,
                 torch.cat([old, next_tokens[:, :, None]], 2), lineage, window_bits(lineage, span))


def expand_depth_triton(*args, **kwargs) -> Depth:
    from kernels import _tree_expand_triton

    return Depth(*_tree_expand_triton.expand_depth(*args, **kwargs))


def expand_depth(log_probs, draft_ids, parent_score, parent_candidate, masked, sampled, log_rate, num_buckets, remap,
                 path, lineage, offset: int, own_shift: int, span: int, out=None, forced_child=None) -> Depth:
    """One depth of the expansion (the module's docstring): Triton on a GPU, the torch reference on the CPU.
    out: the whole expansion's (scores, cells, forced, tokens, parents) [B, C], this depth's candidates written at
    columns offset.. (what `choose` reads, with no concatenation); None: this depth's own."""
    fn = expand_depth_triton if use_triton(log_probs) else expand_depth_ref
    return fn(log_probs, draft_ids, parent_score, parent_candidate, masked, sampled, log_rate, num_buckets, remap,
              path, lineage, offset, own_shift, span, out, forced_child)


# ------------------------------------------------------------------------------------- the n best nodes


class Chosen(NamedTuple):
    tokens: torch.Tensor  # [B, n] int64 node tokens, in candidate (depth) order
    parents: torch.Tensor  # [B, n] int64 node j+1's parent among nodes 0..j (0: the root)
    depth: torch.Tensor  # [B, n+1] int64 (the root 0)
    ancestors: torch.Tensor  # [B, n+1] int64 bit i: node i is the node or one of its ancestors
    cells: torch.Tensor | None  # [B, n] int64
    forced: torch.Tensor | None  # [B, n] bool
    forced_word: torch.Tensor | None  # [B] int64 bit j: node j + 1 was forced (n <= 63), what the host counts


def forced_word(forced: torch.Tensor) -> torch.Tensor:
    """[B, n] bool -> [B] int64 with bit j set where node j + 1 is forced."""
    return (forced.long() << torch.arange(forced.shape[1], device=forced.device)).sum(1)


def depth_of(ancestors: torch.Tensor) -> torch.Tensor:
    """[B, n+1] int64 ancestor sets -> [B, n+1] int64 depths: the ancestors a node has besides the root (its set
    holds the root, its proper ancestors and itself)."""
    bits = (ancestors[..., None] >> torch.arange(64, device=ancestors.device)) & 1
    return bits.sum(-1) - 1


def choose_ref(tokens: torch.Tensor, scores: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor, n: int,
               cells: torch.Tensor | None, forced: torch.Tensor | None, max_depth: int | None) -> Chosen:
    B, C = scores.shape
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :n]
    chosen = order.sort(dim=1).values  # [B, n] candidate indices in depth order
    node_of = torch.zeros((B, C), dtype=torch.int64, device=scores.device)
    node_of.scatter_(1, chosen, torch.arange(1, n + 1, device=scores.device).expand(B, n))
    parent = parents.gather(1, chosen)
    node_parents = torch.where(parent < 0, 0, node_of.gather(1, parent.clamp(min=0)))
    ancestors = ancestor_bits(node_parents, max_depth)
    if depths is not None:
        depth = torch.cat([torch.zeros((B, 1), dtype=torch.int64, device=scores.device), depths[chosen]], 1)
    else:
        depth = depth_of(ancestors)
    node_forced = forced.gather(1, chosen) if forced is not None else None
    return Chosen(tokens.gather(1, chosen), node_parents, depth, ancestors,
                  cells.gather(1, chosen) if cells is not None else None, node_forced,
                  forced_word(node_forced) if node_forced is not None else None)


def choose_triton(*args) -> Chosen:
    from kernels import _tree_expand_triton

    return Chosen(*_tree_expand_triton.choose(*args))


def choose(tokens, scores, parents, depths, n: int, cells=None, forced=None, max_depth: int | None = None) -> Chosen:
    """Candidates [B, C] in depth order (scores: cumulative; parents: a candidate index, -1 for the root; depths
    [C], or None: each node's depth from its parents; cells, forced: carried along, and the forced flags also as a
    word per request) -> the tree of the n best by score, ties to the lower index (a stable sort),
    its nodes in candidate order. A child never scores above its parent and comes after it, so the n best hold
    every chosen node's parent and each node comes after its parent. max_depth: a bound on the depths (default n).
    One launch on a GPU (a rank per candidate by comparing scores, positions by counting, ancestors by following
    parents), where the reference takes two sorts, a scatter, gathers and pointer doubling."""
    fn = choose_triton if use_triton(scores) else choose_ref
    return fn(tokens, scores, parents, depths, n, cells, forced, max_depth)
