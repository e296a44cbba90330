"""The walk down a verified draft tree in one kernel (engine/speculative/tree_verify.py): from the root, take the
child whose draft equals the target's token at the current node, until none does or the tree's depth is reached.

Why a kernel: the torch walk is about ten small ops per depth (a gather, the comparisons, an any, an argmax, a
where), so a depth-8 tree's verification launched some eighty kernels for a few dozen integers: on a GPU at batch 1,
where each launch costs microseconds whatever its work, that was a tenth of a tree step
(bench/results/tree_ops_triton_cpu.md). Here it is one launch, one program per request, the depth loop in registers.

Inputs: target [B, N+1] int64 the target's token at each node (node 0: the root); drafts, parents [B, N] int64 node
j+1's token and its parent (0: the root); num_drafts [B] int64 nodes the request really has (past them nothing
was verified); depth: the tree's depth bound. Outputs: path [B, depth+1] int64 the accepted nodes from the root,
repeating the last past them; num_accepted [B] int64; tokens [B, depth+1] int64 the target's token at each node of
the path, -1 past the accepted ones (what the step emits: the accepted drafts and the bonus token; four more ops of
verification in the kernel's loop). Siblings hold different tokens, so at most one child matches.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._dispatch import next_pow2, use_triton
from kernels._launch import launch


def walk_ref(target: torch.Tensor, drafts: torch.Tensor, parents: torch.Tensor, num_drafts: torch.Tensor,
             depth: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    B, N = drafts.shape
    valid = torch.arange(1, N + 1, device=drafts.device)[None, :] <= num_drafts[:, None]
    cur = torch.zeros(B, dtype=torch.int64, device=drafts.device)
    alive = torch.ones(B, dtype=torch.bool, device=drafts.device)
    path = [cur]
    for _ in range(depth):
        want = target.gather(1, cur[:, None])
        match = (parents == cur[:, None]) & (drafts == want) & valid  # [B, N]
        alive = alive & match.any(1)
        cur = torch.where(alive, match.to(torch.int8).argmax(1) + 1, cur)
        path.append(cur)
    path = torch.stack(path, 1)
    accepted = (path[:, 1:] != path[:, :-1]).sum(1)
    column = torch.arange(depth + 1, device=drafts.device)[None, :]
    return path, accepted, torch.where(column <= accepted[:, None], target.gather(1, path), -1)


@triton.jit(do_not_specialize=["N", "depth"])
def _walk_kernel(target_ptr, drafts_ptr, parents_ptr, num_ptr, path_ptr, accepted_ptr, tokens_ptr, N, depth,
                 BLOCK_N: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK_N)
    valid = j < tl.load(num_ptr + b)  # node j + 1 is in the request's tree
    drafts = tl.load(drafts_ptr + b * N + j, mask=j < N, other=-1)
    parents = tl.load(parents_ptr + b * N + j, mask=j < N, other=-1)
    cur = tl.zeros([], tl.int64)
    alive = tl.full([], 1, tl.int1)
    accepted = tl.zeros([], tl.int64)
    tl.store(path_ptr + b * (depth + 1), cur)
    want = tl.load(target_ptr + b * (N + 1))  # the target's token at the root: always emitted
    tl.store(tokens_ptr + b * (depth + 1), want)
    for step in range(depth):
        match = (parents == cur) & (drafts == want) & valid
        found = tl.max(match.to(tl.int32), 0) > 0
        child = tl.min(tl.where(match, j, BLOCK_N), 0).to(tl.int64) + 1  # the first match (there is at most one)
        alive = alive & found
        cur = tl.where(alive, child, cur)
        accepted += alive.to(tl.int64)
        tl.store(path_ptr + b * (depth + 1) + 1 + step, cur)
        want = tl.load(target_ptr + b * (N + 1) + cur)  # the next depth's wanted token, emitted if cur was accepted
        tl.store(tokens_ptr + b * (depth + 1) + 1 + step, tl.where(alive, want, -1))
    tl.store(accepted_ptr + b, accepted)


def walk_triton(target, drafts, parents, num_drafts, depth: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    B, N = drafts.shape
    path = torch.empty((B, depth + 1), dtype=torch.int64, device=drafts.device)
    accepted = torch.empty(B, dtype=torch.int64, device=drafts.device)
    tokens = torch.empty((B, depth + 1), dtype=torch.int64, device=drafts.device)
    launch(_walk_kernel, (B,), target.contiguous(), drafts.contiguous(), parents.contiguous(),
           num_drafts.contiguous(), path, accepted, tokens, N, depth, BLOCK_N=max(next_pow2(N), 2), num_warps=1)
    return path, accepted, tokens


def walk(target, drafts, parents, num_drafts, depth: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The accepted path down each request's tree (the module's docstring): Triton on a GPU, the reference on a CPU."""
    fn = walk_triton if use_triton(drafts) else walk_ref
    return fn(target, drafts, parents, num_drafts, depth)
