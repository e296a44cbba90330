"""Adaptive k's start-up cost probe: the step's time at each batch size bucket and k, measured on this machine
before the first request, so that the first steps of a batch size already know what a draft costs.

Why: the cost table (engine/speculative/adaptive.py, StepCost) learns a k's cost from the steps that ran at it.
Before that it assumed a line 1 + 0.2 k, which is right for a GPU step at batch 1 and wrong by an order of
magnitude where the verified rows leave a compiled bucket: at batch 16 on a 2-core CPU a k = 1 step (32 rows, past
the 16-row compiled forward) costs ~3.6 plain ones, and each run's first steps and each smaller batch that a
round's tail reached verified drafts before the table knew better (adaptive k at 0.62x of no speculation,
bench/results/real_spec_bf16w_b16_adaptive2_cpu.md). What a step costs at (batch, k) is mostly a function of
shapes: rows through the target, the draft chain's passes, which bucket or graph serves them. Those are what the
probe runs, on the step function real steps run (the same compiled buckets, the same captured graphs).

What it runs: per batch size (powers of two up to the engine's largest batch) and k = 0..K, a step of idle
requests (engine/runner/batch.py: padding rows, which write no KV and only the scratch draft state), one warm-up
and REPEATS timed, the k's in turn; the median. Eager steps verify k + 1 rows per request as a trimmed eager step
does; graph steps replay the graph a real step of that size and pass count replays (k + 1 = K + 1 rows, `passes`
draft passes).

What it misses, and where the measured steps take over: the host's share of a step (scheduling, the grammar,
reading outputs) and attention over real contexts (idle rows attend over k + 1 tokens). StepCost scales the probe's
times to the k's it measured and prices only the k's not measured lately from them. Under tensor parallelism an
eager step keeps all K + 1 logit columns where the probe computes k + 1: its prices are a little low there.
"""
from __future__ import annotations

import logging
import statistics
import time

import torch

from engine.runner.batch import NoBlocks, Padding, build_batch

log = logging.getLogger(__name__)

REPEATS = 3
# Idle rows attend over at most k + 1 tokens: a short bound keeps the probe's block tables and chains small.
PROBE_SEQ_LEN = 64


def probe_sizes(max_batch: int) -> list[int]:
    """Powers of two up to max_batch, and max_batch: one size per StepCost bucket a batch can fall in."""
    sizes = [1 << i for i in range(max(max_batch, 1).bit_length()) if 1 << i < max_batch]
    return sizes + [max_batch]


def probe_step_costs(runner, max_batch: int, repeats: int = REPEATS) -> dict[int, list[float]]:
    """{batch size: [seconds of a step at k = 0..K]} for the sizes of probe_sizes(max_batch), on `runner`
    (a ModelRunner with its KV cache allocated, one rank: no collective waits on another rank's steps)."""
    assert runner.kv_cache is not None and runner.dp is None
    k_max = runner.k
    sync = torch.cuda.synchronize if runner.device.type == "cuda" else (lambda: None)
    out: dict[int, list[float]] = {}
    started = time.perf_counter()
    for size in probe_sizes(max_batch):
        steps = [_step(runner, size, k) for k in range(k_max + 1)]
        for step in steps:
            step()  # warm-up: first calls of a shape pay allocations, a graph its first replay
            sync()
        # The k's take turns, so that a burst of another job's work (a shared machine) falls on one sample of
        # several k's rather than on every sample of one k and skews its median: with only 3 samples a k, such a
        # skew prices that k until adaptive k runs it (engine/speculative/adaptive.py, UNMEASURED).
        runs: list[list[float]] = [[] for _ in steps]
        for _ in range(repeats):
            for k, step in enumerate(steps):
                t0 = time.perf_counter()
                step()
                sync()
                runs[k].append(time.perf_counter() - t0)
        out[size] = [statistics.median(r) for r in runs]
    log.info("adaptive k: probed step costs at %d batch sizes, k = 0..%d, in %.1f s", len(out), k_max,
             time.perf_counter() - started)
    return out


def rank0s(probed: dict[int, list[float]], tp, device: torch.device) -> dict[int, list[float]]:
    """Rank 0's probe on every rank of a tensor-parallel group (`tp`: TPContext; alone: `probed` as it is). Each rank
    timed its own steps; a k priced differently on two ranks would be decided differently, and the ranks' steps (and
    collectives) would part."""
    if tp.size == 1:
        return probed
    import torch.distributed as dist

    sizes = sorted(probed)
    times = torch.tensor([probed[s] for s in sizes], dtype=torch.float64, device=device)
    dist.broadcast(times, group=tp.group, group_src=0)
    return {s: row for s, row in zip(sizes, times.tolist())}


def _step(runner, size: int, k: int):
    """A step of `size` idle requests verifying k drafts each and running k draft passes, the way a real step of
    that size and k runs (a captured graph, or the eager step function)."""
    passes = k if runner.proposer is not None else None
    graphs = runner.graphs
    if graphs is not None and size <= graphs.sizes[-1]:
        padded = graphs.size_for(size)
        batch = graphs.dummy(padded, None, draft_passes=passes)
        return lambda: graphs.replay(batch)
    block_size = runner.cfg.block_size
    pad = Padding(batch_size=size, table_width=-(-PROBE_SEQ_LEN // block_size),
                  scratch_slot=runner.scratch_slot, max_seq_len=PROBE_SEQ_LEN)
    # k + 1 rows per idle request, as a trimmed eager step verifies (build_batch's `k` is the row width here)
    batch = build_batch([], NoBlocks(block_size), runner.kv_cache, runner.device, runner.vocab_size, k, [] if
                        runner.proposer is not None else None, pad, draft_passes=passes)

    def run():
        with torch.inference_mode():
            runner.run_step(batch)

    return run
