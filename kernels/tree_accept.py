"""A verified draft tree's accepted path made a chain, in one kernel (engine/speculative/tree_step.py): the target's KV
of the path's nodes moved to the positions after the root (every layer), and the step's rows permuted so that the
head drafts the next tree from the path as from a chain's accepted drafts.

Why a kernel: in torch this is some twenty-five small ops (clips, gathers and index-selects of rows and KV slots, the
KV's index-copy, the permutation's scatter, the emitted tokens' where and scatter), each a node of the captured decode
step that costs a GPU's launch whatever its work; at batch 1 a 135M model's step is launch-bound
(bench/results/tree_ops_triton_cpu.md). Here it is one launch (after an arange and a copy of the next tokens): a
grid of requests by chunks of the KV's per-slot rows, the bookkeeping in each request's first program.

Inputs: kv_cache [L, P, blocks, block_size, ...] (contiguous; P planes: K and V, or one latent plane); slot_mapping [T]
int64 each row's KV slot (-1: a graph's padding request, which writes nothing); verify_rows [B, N+1] int64 each
request's rows (the root, then its nodes in depth order); path [B, k+1] int64 the accepted nodes from the root,
repeating the last past them (kernels/tree_walk.py); accepted [B] int64; next_tokens [T] int64 the token after each row
as the step's input had it; tokens [B, k+1] int64 the tokens verification emitted; samples [B] bool the request
samples (its token after each kept row is the emitted one; a greedy request's is its row's own).
Column c <= accepted of a request is its row verify_rows[c], which takes node path[c]'s KV and row.
Outputs: perm [T] int64 (row i of the chain takes row perm[i] of the step: identity off the paths), next_tokens [T],
out_rows [B] int64 each request's last kept row. A node's index is at least its depth, so a column never reads a row
another column writes: the moves need no order.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels._dispatch import next_pow2, use_triton
from kernels._launch import launch


class Accepted(NamedTuple):
    perm: torch.Tensor  # [T] int64
    next_tokens: torch.Tensor  # [T] int64
    out_rows: torch.Tensor  # [B] int64


def _to_scratch(slot_mapping: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
    """A graph's padding requests (KV slot -1) take the first slot of the cache's last block instead: the scratch block
    no request holds (ModelRunner.scratch_blocks), so their copies of it onto itself touch no request's KV, not even
    one a hand-over is writing meanwhile."""
    return torch.where(slot_mapping < 0, (kv_cache.shape[2] - 1) * kv_cache.shape[3], slot_mapping)


def accept_path_ref(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, verify_rows: torch.Tensor, path: torch.Tensor,
                    accepted: torch.Tensor, next_tokens: torch.Tensor, tokens: torch.Tensor,
                    samples: torch.Tensor) -> Accepted:
    vr = verify_rows
    B = vr.shape[0]
    # columns past the accepted repeat the last one's move, so duplicate destinations always receive equal values
    c = torch.minimum(torch.arange(path.shape[1], device=path.device)[None, :], accepted[:, None])
    dst_rows = vr.gather(1, c).reshape(-1)
    src_rows = vr.gather(1, path.gather(1, c)).reshape(-1)
    slots = _to_scratch(slot_mapping, kv_cache)
    L, P = kv_cache.shape[:2]
    flat = kv_cache.view(L, P, -1, *kv_cache.shape[4:])
    flat.index_copy_(2, slots.index_select(0, dst_rows), flat.index_select(2, slots.index_select(0, src_rows)))
    perm = torch.arange(slot_mapping.shape[0], device=vr.device).scatter(0, dst_rows, src_rows)
    after = next_tokens.index_select(0, dst_rows).view(B, -1)
    emitted = torch.where(samples[:, None], tokens.gather(1, c), after)
    return Accepted(perm, next_tokens.scatter(0, dst_rows, emitted.reshape(-1)), vr.gather(1, accepted[:, None])[:, 0])


@triton.jit(do_not_specialize=["vr_stride", "C", "row", "plane_stride", "planes"])
def _accept_path_kernel(kv_ptr, slot_ptr, vr_ptr, path_ptr, acc_ptr, next_in, tok_ptr, samp_ptr,
                        perm_ptr, next_out, out_rows_ptr, vr_stride, C, row, plane_stride, planes,
                        BLOCK_C: tl.constexpr, BLOCK_E: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1).to(tl.int64)
    a = tl.load(acc_ptr + b)
    if chunk == 0:  # the rows' bookkeeping, once per request
        c = tl.arange(0, BLOCK_C)
        col = tl.minimum(c.to(tl.int64), a)
        live = c < C
        dst = tl.load(vr_ptr + b * vr_stride + col, mask=live, other=0)
        src = tl.load(vr_ptr + b * vr_stride + tl.load(path_ptr + b * C + col, mask=live, other=0), mask=live, other=0)
        tl.store(perm_ptr + dst, src, mask=live)
        after = tl.load(next_in + dst, mask=live, other=0)
        token = tl.load(tok_ptr + b * C + col, mask=live, other=0)
        tl.store(next_out + dst, tl.where(tl.load(samp_ptr + b) != 0, token, after), mask=live)
        tl.store(out_rows_ptr + b, tl.load(vr_ptr + b * vr_stride + a))
    # this program's part of each moved row: elements chunk * BLOCK_E .. of the planes * row a slot holds
    e = chunk * BLOCK_E + tl.arange(0, BLOCK_E)
    base = (e // row) * plane_stride + e % row
    for c in range(1, C):
        node = tl.load(path_ptr + b * C + c)
        src = tl.load(slot_ptr + tl.load(vr_ptr + b * vr_stride + node))
        dst = tl.load(slot_ptr + tl.load(vr_ptr + b * vr_stride + c))
        # a kept column whose node moves, both slots real: its elements, else none (an int factor, not a scalar
        # bool and'ed onto the vector, which the interpreter turns into an int mask its loads refuse)
        ok = (a >= c).to(tl.int64) * (node != c).to(tl.int64) * (src >= 0).to(tl.int64) * (dst >= 0).to(tl.int64)
        move = e < planes * row * ok
        tl.store(kv_ptr + base + dst * row, tl.load(kv_ptr + base + src * row, mask=move), mask=move)


_RAW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # the cache moved as integers of its width
# elements of a slot's rows one program moves: fixed (a model's layers x heads x dims would each compile a kernel)
BLOCK_E = 1024


def accept_path_triton(kv_cache, slot_mapping, verify_rows, path, accepted, next_tokens, tokens,
                       samples) -> Accepted:
    B, C = path.shape
    T = slot_mapping.shape[0]
    assert kv_cache.is_contiguous() and verify_rows.stride(1) == 1
    raw = kv_cache.view(_RAW[kv_cache.element_size()])
    L, P, blocks, block_size = raw.shape[:4]
    row = math.prod(raw.shape[4:])  # elements a slot holds per plane
    planes = L * P
    out = Accepted(torch.arange(T, device=path.device), next_tokens.clone(),
                   torch.empty(B, dtype=torch.int64, device=path.device))
    launch(_accept_path_kernel, (B, triton.cdiv(planes * row, BLOCK_E)), raw, slot_mapping.contiguous(),
           verify_rows, path.contiguous(), accepted.contiguous(), next_tokens.contiguous(), tokens.contiguous(),
           samples.contiguous(), *out, verify_rows.stride(0), C, row, blocks * block_size * row, planes,
           BLOCK_C=max(next_pow2(C), 2), BLOCK_E=BLOCK_E, num_warps=4)
    return out


def accept_path(kv_cache, slot_mapping, verify_rows, path, accepted, next_tokens, tokens, samples) -> Accepted:
    """The accepted path's KV moved into place and the rows' permutation (the module's docstring): Triton on a GPU,
    the torch reference on a CPU."""
    fn = accept_path_triton if use_triton(path) and path.shape[0] > 0 else accept_path_ref
    return fn(kv_cache, slot_mapping, verify_rows, path, accepted, next_tokens, tokens, samples)
