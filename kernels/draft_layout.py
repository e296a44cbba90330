"""Where a draft pass's rows live, for every pass of a step at once, in one kernel: the KV slots, positions and lengths
of a draft chain's passes (engine/speculative/proposer.py `chain_metadata`) and of a draft tree's frontier passes
(engine/speculative/tree.py `FrontierLayout`), which are the same layout at widths 1 and topk.

Why a kernel: the layout is a dozen-odd small index ops (aranges, a block-table gather, divisions, a where, casts),
each a node of the captured decode step that costs a GPU's launch whatever its work; at batch 1 a 135M model's step is
launch-bound (bench/results/tree_ops_triton_cpu.md). Here it is one launch, one program per request.

Inputs: tables [B, M] int32 block tables; first [B] int64 the KV position of each request's first draft row; slot_limit
[B] int64 the KV slots the request holds (a row at or past it writes nothing: slot -1); block_size; passes P; width W
(rows per request and pass: 1 for a chain, topk for a tree's frontier).
Row g of request b in pass p sits at KV position first + p * W + g, at model position first + p (a frontier's rows are
siblings, one depth apart per pass), and the pass attends up to KV length first + (p + 1) * W.
Outputs: slots [P, B * W] int64, seq_lens [P, B] int32, positions [P, B * W] int64, query_start_loc [B + 1] int32 (W
rows per request).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels._dispatch import next_pow2, use_triton
from kernels._launch import launch


class DraftLayout(NamedTuple):
    slots: torch.Tensor  # [P, B * W] int64 (-1: dropped)
    seq_lens: torch.Tensor  # [P, B] int32
    positions: torch.Tensor  # [P, B * W] int64
    query_start_loc: torch.Tensor  # [B + 1] int32


def draft_layout_ref(tables: torch.Tensor, first: torch.Tensor, slot_limit: torch.Tensor, block_size: int,
                     passes: int, width: int) -> DraftLayout:
    B, M = tables.shape
    dev = first.device
    p = torch.arange(passes, device=dev)
    pos = first[None, :, None] + (p * width)[:, None, None] + torch.arange(width, device=dev)  # [P, B, W]
    slot = tables[None].expand(passes, B, M).gather(2, (pos // block_size).clamp(max=M - 1)).to(torch.int64)
    slots = torch.where(pos < slot_limit[None, :, None], slot * block_size + pos % block_size, -1)
    seq_lens = (first[None, :] + (p[:, None] + 1) * width).to(torch.int32)
    positions = (first[None, :] + p[:, None]).repeat_interleave(width, 1)
    query_start_loc = torch.arange(0, (B + 1) * width, width, dtype=torch.int32, device=dev)
    return DraftLayout(slots.view(passes, B * width), seq_lens, positions, query_start_loc)


# the pass count and the table's width change with the step; each value would compile another kernel if specialized
@triton.jit(do_not_specialize=["B", "M", "table_stride", "block_size", "passes", "width"])
def _draft_layout_kernel(tables_ptr, first_ptr, limit_ptr, slots_ptr, lens_ptr, pos_ptr, qsl_ptr,
                         B, M, table_stride, block_size, passes, width, BLOCK_W: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, BLOCK_W)
    lane = g < width
    first = tl.load(first_ptr + b)
    limit = tl.load(limit_ptr + b)
    rows = B * width
    for p in range(passes):
        pos = first + p * width + g
        blk = tl.minimum(pos // block_size, M - 1)
        slot = tl.load(tables_ptr + b * table_stride + blk, mask=lane, other=0).to(tl.int64)
        out = tl.where(pos < limit, slot * block_size + pos % block_size, -1)
        tl.store(slots_ptr + p * rows + b * width + g, out, mask=lane)
        tl.store(pos_ptr + p * rows + b * width + g, tl.zeros([BLOCK_W], tl.int64) + first + p, mask=lane)
        tl.store(lens_ptr + p * B + b, (first + (p + 1) * width).to(tl.int32))
    tl.store(qsl_ptr + b + 1, ((b + 1) * width).to(tl.int32))
    tl.store(qsl_ptr + b * 0, tl.zeros([], tl.int32), mask=b == 0)


def draft_layout_triton(tables: torch.Tensor, first: torch.Tensor, slot_limit: torch.Tensor, block_size: int,
                        passes: int, width: int) -> DraftLayout:
    B, M = tables.shape
    dev = first.device
    out = DraftLayout(torch.empty((passes, B * width), dtype=torch.int64, device=dev),
                      torch.empty((passes, B), dtype=torch.int32, device=dev),
                      torch.empty((passes, B * width), dtype=torch.int64, device=dev),
                      torch.empty(B + 1, dtype=torch.int32, device=dev))
    assert tables.stride(1) == 1, "block tables must have contiguous rows"
    launch(_draft_layout_kernel, (B,), tables, first.contiguous(), slot_limit.contiguous(), *out, B, M,
           tables.stride(0), block_size, passes, width, BLOCK_W=max(next_pow2(width), 2), num_warps=1)
    return out


def draft_layout(tables: torch.Tensor, first: torch.Tensor, slot_limit: torch.Tensor, block_size: int, passes: int,
                 width: int) -> DraftLayout:
    """The rows of `passes` draft passes of `width` rows per request (the module's docstring): Triton on a GPU, the
    torch reference on a CPU."""
    fn = draft_layout_triton if use_triton(first) and first.shape[0] > 0 else draft_layout_ref
    return fn(tables, first, slot_limit, block_size, passes, width)
