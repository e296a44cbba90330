"""The Triton kernel behind kernels/tree_expand.py: one program per request scores its R * K candidates (at most
MAX_TOPK**2 = 64), ranks them against each other in registers (a candidate's rank is how many score above it, or
equal at a lower index: the order of a stable descending sort, with no sort) and scatters the K best into the next
frontier's slots. Nothing leaves the device and no shape depends on the data, so the captured step can hold it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._dispatch import next_pow2
from kernels._launch import launch
from kernels.tree_mask import WINDOW


# R and the path's length change with the depth; each value would compile another kernel if specialized.
@triton.jit(do_not_specialize=["R", "D", "offset", "own_shift", "below", "out_stride", "out_col"])
def _expand_depth_kernel(
    lp_ptr, ids_ptr, pscore_ptr, pcand_ptr, masked_ptr, sampled_ptr, rate_ptr, remap_ptr, path_ptr, lineage_ptr,
    child_ptr, score_ptr, cell_ptr, forced_ptr, tok_ptr, parent_ptr,
    best_ptr, cand_ptr, lane_ptr, next_ptr, npath_ptr, nlin_ptr, nmask_ptr,
    R, D, offset, own_shift, below, out_stride, out_col,
    K: tl.constexpr, NUM_BUCKETS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_PARENT: tl.constexpr, HAS_TABLE: tl.constexpr, HAS_REMAP: tl.constexpr, HAS_LINEAGE: tl.constexpr,
    HAS_CHILD: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    M = R * K
    m = tl.arange(0, BLOCK_M)
    valid = m < M
    row = m // K
    base = b * M + m
    lp = tl.load(lp_ptr + base, mask=valid, other=float("-inf")).to(tl.float32)
    masked = tl.load(masked_ptr + b * R + row, mask=valid, other=0).to(tl.int32)
    if HAS_CHILD:  # a grammar-forced child: the row's first candidate, of log-probability 0, the others -inf
        child = tl.load(child_ptr + b * R + row, mask=valid, other=-1)
        first = (m % K) == 0
        lp = tl.where(child >= 0, tl.where(first, 0.0, float("-inf")), lp)
    special = (lp == 0.0) | (lp == float("-inf"))
    if HAS_TABLE:
        sampled = tl.load(sampled_ptr + b).to(tl.int32)
        bucket = tl.minimum(tl.maximum((tl.exp(lp) * NUM_BUCKETS).to(tl.int32), 0), NUM_BUCKETS - 1)
        cell = ((sampled * 2 + masked) * K + m % K) * NUM_BUCKETS + bucket
        est = tl.load(rate_ptr + cell, mask=valid & (special == 0), other=0.0).to(tl.float32)
        score = tl.where(special, lp, est)
        cell = tl.where(special, -1, cell).to(tl.int64)
    else:
        score = lp
        cell = tl.full([BLOCK_M], -1, tl.int64)
    if HAS_PARENT:
        score += tl.load(pscore_ptr + b * R + row, mask=valid, other=0.0).to(tl.float32)
        parent = tl.load(pcand_ptr + b * R + row, mask=valid, other=-1)
    else:
        parent = tl.full([BLOCK_M], -1, tl.int64)
    ids = tl.load(ids_ptr + base, mask=valid, other=0)
    if HAS_REMAP:
        tok = tl.load(remap_ptr + ids, mask=valid, other=0)
    else:
        tok = ids
    if HAS_CHILD:
        tok = tl.where((child >= 0) & first, child, tok)
    # the candidates' fields at columns out_col.. of rows out_stride long (the whole expansion's, or this depth's)
    obase = b * out_stride + out_col + m
    tl.store(score_ptr + obase, score, mask=valid)
    tl.store(cell_ptr + obase, cell, mask=valid)
    tl.store(forced_ptr + obase, (lp == 0.0) & (masked != 0), mask=valid)
    tl.store(tok_ptr + obase, tok, mask=valid)
    tl.store(parent_ptr + obase, parent, mask=valid)

    # rank[i] = #{j : s_j > s_i, or s_j == s_i and j < i}: the position in a stable descending sort
    ahead = (score[None, :] > score[:, None]) | ((score[None, :] == score[:, None]) & (m[None, :] < m[:, None]))
    rank = tl.sum((ahead & valid[None, :]).to(tl.int32), axis=1)
    chosen = valid & (rank < K)
    slot = b * K + rank
    tl.store(best_ptr + slot, score, mask=chosen)
    tl.store(cand_ptr + slot, offset + m.to(tl.int64), mask=chosen)
    tl.store(lane_ptr + slot, row.to(tl.int64), mask=chosen)
    tl.store(next_ptr + slot, tok, mask=chosen)
    if HAS_LINEAGE:
        lin = tl.load(lineage_ptr + b * R + row, mask=valid, other=0)
    else:
        lin = tl.zeros([BLOCK_M], tl.int64)
    one = tl.full([BLOCK_M], 1, tl.int64)
    lin = lin | (one << (own_shift + rank).to(tl.int64))  # the row's own bit in the next frontier
    tl.store(nlin_ptr + slot, lin, mask=chosen)
    # its head pass's tree mask (kernels/tree_mask.py window_bits): the ancestors moved to the window's top, every
    # position before the span admitted; (1 << 63) - 1 wraps to the intended all-but-the-top bits
    low = (tl.full([BLOCK_M], 1, tl.int64) << below) - 1
    tl.store(nmask_ptr + slot, (lin << below) | low, mask=chosen)
    # the chosen candidates' paths: the parent row's D tokens, then the candidate's own
    t = tl.arange(0, BLOCK_D)
    old = tl.load(path_ptr + (b * R + row)[:, None] * D + t[None, :], mask=valid[:, None] & (t[None, :] < D), other=0)
    new = tl.where(t[None, :] == D, tok[:, None], old)
    tl.store(npath_ptr + slot[:, None] * (D + 1) + t[None, :], new, mask=chosen[:, None] & (t[None, :] <= D))


def expand_depth(log_probs, draft_ids, parent_score, parent_candidate, masked, sampled, log_rate, num_buckets, remap,
                 path, lineage, offset: int, own_shift: int, span: int, out=None, forced_child=None):
    B, R, K = log_probs.shape
    dev = log_probs.device
    D = path.shape[2] if path is not None else 0
    M = R * K
    if out is None:
        out = (torch.empty((B, M), dtype=torch.float32, device=dev), torch.empty((B, M), dtype=torch.int64, device=dev),
               torch.empty((B, M), dtype=torch.bool, device=dev), torch.empty((B, M), dtype=torch.int64, device=dev),
               torch.empty((B, M), dtype=torch.int64, device=dev))
        col = 0
    else:
        col = offset
    scores, cells, forced, tokens, parents = out
    assert all(t.is_contiguous() and t.shape[1] == scores.shape[1] for t in out)
    best = torch.empty((B, K), dtype=torch.float32, device=dev)
    candidate = torch.empty((B, K), dtype=torch.int64, device=dev)
    lane = torch.empty((B, K), dtype=torch.int64, device=dev)
    next_tokens = torch.empty((B, K), dtype=torch.int64, device=dev)
    new_path = torch.empty((B, K, D + 1), dtype=torch.int64, device=dev)
    new_lineage = torch.empty((B, K), dtype=torch.int64, device=dev)
    new_mask = torch.empty((B, K), dtype=torch.int64, device=dev)
    # absent inputs: any tensor stands in for the pointer; the constexprs keep the kernel from reading it
    log_probs, draft_ids = log_probs.contiguous(), draft_ids.contiguous()
    dummy = draft_ids
    launch(_expand_depth_kernel, (B,),
           log_probs, draft_ids,
           parent_score.contiguous() if parent_score is not None else log_probs,
           parent_candidate.contiguous() if parent_candidate is not None else dummy,
           masked.contiguous(), sampled.contiguous(),
           log_rate if log_rate is not None else log_probs,
           remap if remap is not None else dummy,
           path.contiguous() if D else dummy,
           lineage.contiguous() if lineage is not None else dummy,
           forced_child.contiguous() if forced_child is not None else dummy,
           scores, cells, forced, tokens, parents, best, candidate, lane, next_tokens, new_path, new_lineage, new_mask,
           R, D, offset, own_shift, WINDOW - span, scores.shape[1], col,
           K=K, NUM_BUCKETS=num_buckets, BLOCK_M=max(next_pow2(M), 2),
           # one path width for every depth up to MAX_K = 8 (paths of at most 8 tokens): one specialization, not three
           BLOCK_D=max(next_pow2(D + 1), 8),
           HAS_PARENT=parent_score is not None, HAS_TABLE=log_rate is not None, HAS_REMAP=remap is not None,
           HAS_LINEAGE=lineage is not None, HAS_CHILD=forced_child is not None, num_warps=4 if M > 16 else 1)
    mine = [t[:, col: col + M] for t in out]  # this depth's columns (views)
    return (*mine, best, candidate, lane, next_tokens, new_path, new_lineage, new_mask)


# ------------------------------------------------------------------------------------- the n best nodes


@triton.jit(do_not_specialize=["C", "n", "max_depth"])
def _choose_kernel(
    tok_ptr, score_ptr, parent_ptr, depths_ptr, cell_ptr, forced_ptr, rank_ptr,
    out_tok_ptr, out_parent_ptr, out_depth_ptr, out_anc_ptr, out_cell_ptr, out_forced_ptr, out_word_ptr,
    C, n, max_depth,
    BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, HAS_CELLS: tl.constexpr, HAS_FORCED: tl.constexpr,
    HAS_DEPTHS: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    row = b * C
    # 1. chosen[i] = rank[i] < n, rank as in a stable descending sort (scratch: rank_ptr, one int32 per candidate)
    for i0 in range(0, C, BLOCK):
        i = i0 + tl.arange(0, BLOCK)
        si = tl.load(score_ptr + row + i, mask=i < C, other=float("-inf"))
        rank = tl.zeros([BLOCK], tl.int32)
        for j0 in range(0, C, BLOCK):
            j = j0 + tl.arange(0, BLOCK)
            sj = tl.load(score_ptr + row + j, mask=j < C, other=float("-inf"))
            ahead = (sj[None, :] > si[:, None]) | ((sj[None, :] == si[:, None]) & (j[None, :] < i[:, None]))
            rank += tl.sum((ahead & (j[None, :] < C)).to(tl.int32), axis=1)
        tl.store(rank_ptr + row + i, (rank < n).to(tl.int32), mask=i < C)
    tl.debug_barrier()
    # 2. each chosen candidate's node index (1 + chosen before it) and its parent's, then its fields in place
    out = b * n
    word = tl.zeros([], tl.int64)  # bit j: node j + 1 was forced
    for i0 in range(0, C, BLOCK):
        i = i0 + tl.arange(0, BLOCK)
        chosen = tl.load(rank_ptr + row + i, mask=i < C, other=0) != 0
        parent = tl.load(parent_ptr + row + i, mask=chosen, other=-1)
        pos = tl.zeros([BLOCK], tl.int32)
        node_parent = tl.zeros([BLOCK], tl.int32)
        for j0 in range(0, C, BLOCK):
            j = j0 + tl.arange(0, BLOCK)
            cj = tl.load(rank_ptr + row + j, mask=j < C, other=0)
            pos += tl.sum(cj[None, :] * (j[None, :] < i[:, None]).to(tl.int32), axis=1)
            node_parent += tl.sum(cj[None, :] * (j[None, :] < parent[:, None]).to(tl.int32), axis=1)
        node_parent = tl.where(parent < 0, 0, node_parent + 1)
        dst = out + pos
        tl.store(out_tok_ptr + dst, tl.load(tok_ptr + row + i, mask=chosen, other=0), mask=chosen)
        tl.store(out_parent_ptr + dst, node_parent.to(tl.int64), mask=chosen)
        if HAS_DEPTHS:
            tl.store(out_depth_ptr + b * (n + 1) + 1 + pos, tl.load(depths_ptr + i, mask=chosen, other=0),
                     mask=chosen)
        if HAS_CELLS:
            tl.store(out_cell_ptr + dst, tl.load(cell_ptr + row + i, mask=chosen, other=-1), mask=chosen)
        if HAS_FORCED:
            f = tl.load(forced_ptr + row + i, mask=chosen, other=0)
            tl.store(out_forced_ptr + dst, f, mask=chosen)
            one = tl.full([BLOCK], 1, tl.int64)
            word += tl.sum(tl.where(chosen & (f != 0), one << pos.to(tl.int64), 0), axis=0)
    if HAS_FORCED:
        tl.store(out_word_ptr + b, word)
    tl.debug_barrier()
    # 3. ancestor sets: each node follows its parents up to the root (bit 0, in every set)
    v = tl.arange(0, BLOCK_N)
    live = v <= n
    anc = (tl.full([BLOCK_N], 1, tl.int64) << v.to(tl.int64)) | 1
    cur = v
    depth = tl.zeros([BLOCK_N], tl.int64)  # hops to the root: the node's depth (without a depths table)
    for _ in range(max_depth):
        up = tl.load(out_parent_ptr + out + cur - 1, mask=live & (cur > 0), other=0).to(tl.int32)
        depth += (cur > 0).to(tl.int64)
        cur = tl.where(cur > 0, up, 0)
        anc = anc | (tl.full([BLOCK_N], 1, tl.int64) << cur.to(tl.int64))
    tl.store(out_anc_ptr + b * (n + 1) + v, anc, mask=live)
    if HAS_DEPTHS:
        tl.store(out_depth_ptr + b * (n + 1) + v, tl.zeros([BLOCK_N], tl.int64), mask=v == 0)
    else:
        tl.store(out_depth_ptr + b * (n + 1) + v, depth, mask=live)


def choose(tokens, scores, parents, depths, n: int, cells, forced, max_depth):
    B, C = scores.shape
    dev = scores.device
    out_tokens = torch.empty((B, n), dtype=torch.int64, device=dev)
    out_parents = torch.empty((B, n), dtype=torch.int64, device=dev)
    out_depth = torch.empty((B, n + 1), dtype=torch.int64, device=dev)
    out_anc = torch.empty((B, n + 1), dtype=torch.int64, device=dev)
    out_cells = torch.empty((B, n), dtype=torch.int64, device=dev) if cells is not None else None
    out_forced = torch.empty((B, n), dtype=torch.bool, device=dev) if forced is not None else None
    out_word = torch.empty(B, dtype=torch.int64, device=dev) if forced is not None else None
    chosen = torch.empty((B, C), dtype=torch.int32, device=dev)  # scratch between the kernel's passes
    tokens, scores, parents = tokens.contiguous(), scores.contiguous(), parents.contiguous()
    launch(_choose_kernel, (B,),
           tokens, scores, parents, depths.contiguous() if depths is not None else tokens,
           cells.contiguous() if cells is not None else tokens, forced.contiguous() if forced is not None else tokens,
           chosen, out_tokens, out_parents, out_depth, out_anc,
           out_cells if cells is not None else out_tokens, out_forced if forced is not None else out_tokens,
           out_word if forced is not None else out_tokens,
           C, n, n if max_depth is None else min(max_depth, n),
           BLOCK=64, BLOCK_N=max(next_pow2(n + 1), 2), HAS_CELLS=cells is not None, HAS_FORCED=forced is not None,
           HAS_DEPTHS=depths is not None, num_warps=4)
    return out_tokens, out_parents, out_depth, out_anc, out_cells, out_forced, out_word
