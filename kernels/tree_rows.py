"""A draft tree's verification rows in one kernel (engine/speculative/tree_step.py `tree_layout`): each request's tree
read from its draft-state slot, its nodes' positions (start + depth) and their tree masks (kernels/tree_mask.py).
Below, `store_trees`: the next trees written to their slots (TreeSlots.write), one launch where torch takes four.

Why a kernel: the torch layout is some twenty small ops (four table reads, a clip, gathers, the mask's shifts, two
scatters), each a node of the captured decode step that costs a GPU's launch whatever its work; at batch 1 a 135M
model's step is launch-bound (bench/results/tree_ops_triton_cpu.md). Here it is one launch, one program per request,
after a copy of the positions and a fill of the masks.

Inputs: verify_rows [B, N+1] int64 each request's rows (the root, then its nodes in depth order; a request with fewer
nodes repeats its last row); num_drafts [B] int64 nodes each request has; slots [B] int64 its draft-state slot; the
trees by slot (engine/speculative/tree.py TreeSlots): parents [S, N], depth [S, N+1], ancestors [S, N+1] (bit i: node
i is the node or an ancestor), cells [S, N] int64; positions [T] int64 the step's rows' positions (each request's rows
laid out as a chain's: the root at start); seq_lens [B] int32 each request's KV length in the step.
Outputs: the trees read (parents, depth, ancestors, cells, each [B, ...]), the positions with each node at start +
its depth, and masks [T] int64: a node's window over its ancestors among the root.. positions and every prefix
position before them (`window_bits` over the span root .. seq_len); -1 (plain causal) for the root and every row that
is not a node.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels._dispatch import next_pow2, use_triton
from kernels._launch import launch
from kernels.tree_mask import WINDOW, window_bits


class TreeRows(NamedTuple):
    parents: torch.Tensor  # [B, N] int64
    depth: torch.Tensor  # [B, N+1] int64
    ancestors: torch.Tensor  # [B, N+1] int64
    cells: torch.Tensor  # [B, N] int64
    positions: torch.Tensor  # [T] int64
    masks: torch.Tensor  # [T] int64


def tree_rows_ref(verify_rows: torch.Tensor, num_drafts: torch.Tensor, slots: torch.Tensor, parents: torch.Tensor,
                  depth: torch.Tensor, ancestors: torch.Tensor, cells: torch.Tensor, positions: torch.Tensor,
                  seq_lens: torch.Tensor) -> TreeRows:
    vr = verify_rows
    B, n1 = vr.shape
    parents, depth, ancestors, cells = (t.index_select(0, slots) for t in (parents, depth, ancestors, cells))
    # column j of a request with fewer nodes repeats its last row: clip so that repeats write equal values
    col = torch.minimum(torch.arange(n1, device=vr.device)[None, :], num_drafts[:, None])
    root = positions.index_select(0, vr[:, 0])
    placed = positions.scatter(0, vr.reshape(-1), (root[:, None] + depth.gather(1, col)).reshape(-1))
    # the nodes' ancestor bits are over positions root .. root + num_drafts; the window ends at the request's KV
    # length, which a graph's padded layout (N + 1 rows per request, also past its nodes) puts further out
    span = seq_lens.to(torch.int64) - root
    bits = window_bits(ancestors.gather(1, col), span[:, None])
    bits = torch.where(col == 0, -1, bits)  # the root: plain causal
    masks = torch.full_like(positions, -1).scatter(0, vr.reshape(-1), bits.reshape(-1))
    return TreeRows(parents, depth, ancestors, cells, placed, masks)


@triton.jit
def _move_row(dst_ptr, dst_row, src_ptr, src_row, width, j):
    """Row src_row of a [*, width] table into row dst_row of another (lanes j < width): a tree's read from its slot
    and its store there."""
    m = j < width
    tl.store(dst_ptr + dst_row * width + j, tl.load(src_ptr + src_row * width + j, mask=m), mask=m)


@triton.jit(do_not_specialize=["N", "vr_stride"])
def _tree_rows_kernel(vr_ptr, num_ptr, slots_ptr, par_tab, dep_tab, anc_tab, cell_tab, pos_ptr, lens_ptr,
                      par_out, dep_out, anc_out, cell_out, placed_ptr, masks_ptr, N, vr_stride,
                      WINDOW: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK)
    row = j < N + 1
    slot = tl.load(slots_ptr + b)
    # the trees at the batch's slots
    _move_row(par_out, b, par_tab, slot, N, j)
    _move_row(cell_out, b, cell_tab, slot, N, j)
    _move_row(dep_out, b, dep_tab, slot, N + 1, j)
    _move_row(anc_out, b, anc_tab, slot, N + 1, j)
    # each row's node, clipped to the request's last (the rows past it repeat that row)
    col = tl.minimum(j.to(tl.int64), tl.load(num_ptr + b))
    depth = tl.load(dep_tab + slot * (N + 1) + col, mask=row, other=0)
    anc = tl.load(anc_tab + slot * (N + 1) + col, mask=row, other=0)
    rows = tl.load(vr_ptr + b * vr_stride + j, mask=row, other=0)
    root = tl.load(pos_ptr + tl.load(vr_ptr + b * vr_stride))
    tl.store(placed_ptr + rows, root + depth, mask=row)
    below = WINDOW - (tl.load(lens_ptr + b).to(tl.int64) - root)  # prefix positions inside the window
    below = tl.minimum(tl.maximum(below, 0), WINDOW - 1)  # a padding request's empty span: no shift past the word
    one = tl.full([BLOCK], 1, tl.int64)
    bits = (anc << below) | ((one << below) - 1)  # (1 << 63) - 1 wraps to the intended all-but-the-top bits
    tl.store(masks_ptr + rows, tl.where(col == 0, -1, bits), mask=row)


def tree_rows_triton(verify_rows, num_drafts, slots, parents, depth, ancestors, cells, positions,
                     seq_lens) -> TreeRows:
    B, n1 = verify_rows.shape
    N = n1 - 1
    dev = verify_rows.device
    for t in (parents, depth, ancestors, cells):
        assert t.is_contiguous(), "the tree tables must be contiguous"
    assert verify_rows.stride(1) == 1, "verify rows must have contiguous rows"
    def empty(n: int) -> torch.Tensor:
        return torch.empty((B, n), dtype=torch.int64, device=dev)

    out = TreeRows(empty(N), empty(n1), empty(n1), empty(N), positions.clone(), torch.full_like(positions, -1))
    launch(_tree_rows_kernel, (B,), verify_rows, num_drafts.contiguous(), slots.contiguous(), parents, depth,
           ancestors, cells, positions.contiguous(), seq_lens.contiguous(), *out, N, verify_rows.stride(0),
           WINDOW=WINDOW, BLOCK=max(next_pow2(n1), 2), num_warps=1)
    return out


def tree_rows(verify_rows, num_drafts, slots, parents, depth, ancestors, cells, positions, seq_lens) -> TreeRows:
    """The trees at `slots` and their verification rows' positions and masks (the module's docstring): Triton on a
    GPU, the torch reference on a CPU."""
    fn = tree_rows_triton if use_triton(verify_rows) and verify_rows.shape[0] > 0 else tree_rows_ref
    return fn(verify_rows, num_drafts, slots, parents, depth, ancestors, cells, positions, seq_lens)


# ------------------------------------------------------------------------------------- the trees kept by slot


def store_trees_ref(slots: torch.Tensor, parents: torch.Tensor, depth: torch.Tensor, ancestors: torch.Tensor,
                    cells: torch.Tensor | None, tab_parents: torch.Tensor, tab_depth: torch.Tensor,
                    tab_ancestors: torch.Tensor, tab_cells: torch.Tensor) -> None:
    """The trees [B, ...] into the tables [S, ...] at rows `slots` [B] (cells None: -1, not scored)."""
    tab_parents.index_copy_(0, slots, parents)
    tab_depth.index_copy_(0, slots, depth)
    tab_ancestors.index_copy_(0, slots, ancestors)
    tab_cells.index_copy_(0, slots, cells if cells is not None else torch.full_like(parents, -1))


@triton.jit(do_not_specialize=["N"])
def _store_trees_kernel(slots_ptr, par_ptr, dep_ptr, anc_ptr, cell_ptr, par_tab, dep_tab, anc_tab, cell_tab, N,
                        HAS_CELLS: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK)
    slot = tl.load(slots_ptr + b)
    _move_row(par_tab, slot, par_ptr, b, N, j)
    _move_row(dep_tab, slot, dep_ptr, b, N + 1, j)
    _move_row(anc_tab, slot, anc_ptr, b, N + 1, j)
    if HAS_CELLS:
        _move_row(cell_tab, slot, cell_ptr, b, N, j)
    else:
        tl.store(cell_tab + slot * N + j, tl.full([BLOCK], -1, tl.int64), mask=j < N)


def store_trees_triton(slots, parents, depth, ancestors, cells, tab_parents, tab_depth, tab_ancestors,
                       tab_cells) -> None:
    B, N = parents.shape
    for t in (tab_parents, tab_depth, tab_ancestors, tab_cells):
        assert t.is_contiguous(), "the tree tables must be contiguous"
    launch(_store_trees_kernel, (B,), slots.contiguous(), parents.contiguous(), depth.contiguous(),
           ancestors.contiguous(), cells.contiguous() if cells is not None else parents, tab_parents, tab_depth,
           tab_ancestors, tab_cells, N, HAS_CELLS=cells is not None, BLOCK=max(next_pow2(N + 1), 2), num_warps=1)


def store_trees(slots, parents, depth, ancestors, cells, tab_parents, tab_depth, tab_ancestors, tab_cells) -> None:
    """Each request's tree into its draft-state slot's rows of the tables (engine/speculative/tree.py TreeSlots; the
    inverse of `tree_rows`' read), one launch on a GPU where the reference takes four copies."""
    fn = store_trees_triton if use_triton(parents) and parents.shape[0] > 0 else store_trees_ref
    fn(slots, parents, depth, ancestors, cells, tab_parents, tab_depth, tab_ancestors, tab_cells)
