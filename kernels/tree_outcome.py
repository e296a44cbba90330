"""What a draft tree's verification says about its nodes, and the acceptance table's update from it, in two kernels
(engine/speculative/tree_score.py `outcome` and AcceptanceTable.observe).

Why kernels: the torch versions are some twenty small ops per step (a scatter of the path, gathers, comparisons, two
index-adds, the decay's division and products), each a node of the captured decode step that costs a GPU's launch
whatever its work; at batch 1 a 135M model's step is launch-bound (bench/results/tree_ops_triton_cpu.md). Here they
are two launches: `outcome` one program per request, `observe` one program for the whole table (its decay must see
every request's counts, and under attention data parallelism the outcomes of every rank are gathered in between,
engine/speculative/tree_step.py group_outcomes).

outcome: path [B, k+1] int64 the accepted nodes from the root (repeating the last past them, kernels/tree_walk.py),
parents [B, N] int64 node j+1's parent (0: the root), num_drafts [B] int64 nodes each request has -> reached [B, N]
bool (the node's parent was accepted: the node was a trial) and accepted [B, N] bool; nodes past num_drafts neither.
observe: cells [...] int64 (-1: not scored), reached, accepted [...] bool; the table's trials, hits and log_rate [C]
float32 are updated in place: each scored, reached node adds a trial to its cell and a hit if accepted, then every
cell's trials are capped at max_trials with its hits scaled alike (the estimate follows the traffic), and log_rate
becomes log(max(hits / trials, 1e-6)), what the next expansion looks its candidates up in (kept here, so that an
expansion reads it with no launch of its own).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._dispatch import next_pow2, use_triton
from kernels._launch import launch

MIN_RATE = 1e-6  # an estimate's floor: a cell never seen accepted still ranks its candidates by their bucket


def outcome_ref(path: torch.Tensor, parents: torch.Tensor,
                num_drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    B, N = parents.shape
    on_path = torch.zeros((B, N + 1), dtype=torch.bool, device=path.device).scatter_(1, path, True)
    real = torch.arange(N, device=path.device)[None, :] < num_drafts[:, None]
    return on_path.gather(1, parents) & real, on_path[:, 1:] & real


def log_estimates(trials: torch.Tensor, hits: torch.Tensor) -> torch.Tensor:
    """The log of each cell's estimate, floored at 1e-6 (what an expansion looks its candidates up in)."""
    return (hits / trials).clamp(min=MIN_RATE).log()


def observe_ref(trials: torch.Tensor, hits: torch.Tensor, log_rate: torch.Tensor, cells: torch.Tensor,
                reached: torch.Tensor, accepted: torch.Tensor, max_trials: float) -> None:
    ok = reached & (cells >= 0)
    idx = cells.clamp(min=0).flatten()
    trials.index_add_(0, idx, ok.flatten().float())
    hits.index_add_(0, idx, (ok & accepted).flatten().float())
    scale = (max_trials / trials).clamp(max=1.0)
    trials.mul_(scale)
    hits.mul_(scale)
    log_rate.copy_(log_estimates(trials, hits))


@triton.jit(do_not_specialize=["N", "D1"])
def _outcome_kernel(path_ptr, parents_ptr, num_ptr, reached_ptr, accepted_ptr, N, D1,
                    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    node = j < N
    path = tl.load(path_ptr + b * D1 + d, mask=d < D1, other=-1)  # -1: no node
    parent = tl.load(parents_ptr + b * N + j, mask=node, other=-2)
    real = node & (j < tl.load(num_ptr + b))
    on_node = tl.max((path[None, :] == (j + 1).to(tl.int64)[:, None]).to(tl.int32), 1) > 0
    on_parent = tl.max((path[None, :] == parent[:, None]).to(tl.int32), 1) > 0
    tl.store(reached_ptr + b * N + j, on_parent & real, mask=node)
    tl.store(accepted_ptr + b * N + j, on_node & real, mask=node)


@triton.jit(do_not_specialize=["n", "num_cells"])
def _observe_kernel(cells_ptr, reached_ptr, accepted_ptr, trials_ptr, hits_ptr, log_rate_ptr, n, num_cells,
                    max_trials, min_rate, BLOCK: tl.constexpr, BLOCK_C: tl.constexpr):
    for start in range(0, n, BLOCK):
        i = start + tl.arange(0, BLOCK)
        m = i < n
        cell = tl.load(cells_ptr + i, mask=m, other=-1)
        ok = m & (cell >= 0) & (tl.load(reached_ptr + i, mask=m, other=0) != 0)
        hit = ok & (tl.load(accepted_ptr + i, mask=m, other=0) != 0)
        tl.atomic_add(trials_ptr + cell, tl.full([BLOCK], 1.0, tl.float32), mask=ok)
        tl.atomic_add(hits_ptr + cell, tl.full([BLOCK], 1.0, tl.float32), mask=hit)
    tl.debug_barrier()  # every count is in before the decay reads them
    c = tl.arange(0, BLOCK_C)
    mc = c < num_cells
    # past the atomics, read from L2 (".cg"): a cached line of the table would predate them
    trials = tl.load(trials_ptr + c, mask=mc, other=1.0, cache_modifier=".cg")
    hits = tl.load(hits_ptr + c, mask=mc, other=0.0, cache_modifier=".cg")
    scale = tl.minimum(tl.math.div_rn(tl.full([BLOCK_C], max_trials, tl.float32), trials), 1.0)
    trials, hits = trials * scale, hits * scale
    tl.store(trials_ptr + c, trials, mask=mc)
    tl.store(hits_ptr + c, hits, mask=mc)
    tl.store(log_rate_ptr + c, tl.log(tl.maximum(tl.math.div_rn(hits, trials), min_rate)), mask=mc)


def outcome_triton(path, parents, num_drafts) -> tuple[torch.Tensor, torch.Tensor]:
    B, N = parents.shape
    reached = torch.empty((B, N), dtype=torch.bool, device=parents.device)
    accepted = torch.empty((B, N), dtype=torch.bool, device=parents.device)
    launch(_outcome_kernel, (B,), path.contiguous(), parents.contiguous(), num_drafts.contiguous(), reached, accepted,
           N, path.shape[1], BLOCK_N=max(next_pow2(N), 2), BLOCK_D=max(next_pow2(path.shape[1]), 2), num_warps=1)
    return reached, accepted


def observe_triton(trials, hits, log_rate, cells, reached, accepted, max_trials: float) -> None:
    for t in (trials, hits, log_rate):
        assert t.is_contiguous() and t.dtype == torch.float32
    n = cells.numel()
    launch(_observe_kernel, (1,), cells.contiguous(), reached.contiguous(), accepted.contiguous(), trials, hits,
           log_rate, n, trials.numel(), float(max_trials), MIN_RATE, BLOCK=256,
           BLOCK_C=max(next_pow2(trials.numel()), 2), num_warps=4)


def outcome(path, parents, num_drafts) -> tuple[torch.Tensor, torch.Tensor]:
    """(reached, accepted) of each request's nodes (the module's docstring): Triton on a GPU, the reference on a CPU."""
    fn = outcome_triton if use_triton(parents) and parents.shape[0] > 0 else outcome_ref
    return fn(path, parents, num_drafts)


def observe(trials, hits, log_rate, cells, reached, accepted, max_trials: float) -> None:
    """The acceptance table's update from one verification, in place (the module's docstring): Triton on a GPU, the
    reference on a CPU."""
    fn = observe_triton if use_triton(trials) else observe_ref
    fn(trials, hits, log_rate, cells, reached, accepted, max_trials)
