"""Few-row CPU matmuls on weights packed for streaming (EngineConfig.cpu_compile = "full").

At 1-16 rows a decode step reads each weight once and does little else with it. StreamedGemm keeps one packed copy
of a weight (kernels/linear_rows.py: 32 output rows interleaved per input column, so a thread reads one sequential
stream) and runs the C++ kernel on it, eagerly (the LM head) and inside the compiled graphs, where linear() emits it
while engine/layers/cpu_compile.py traces. One copy serves every row bucket, where inductor's packed GEMMs
(engine/layers/packed_gemm.py) keep one per bucket. SmolLM2's weights, 2-core EPYC, 2 threads: 22.6 GB/s at one row
against ~16 for inductor's, 24 for a plain sum (a side probe; bench/results/real_decode_streamed_cpu.md has the
decode step).
"""
from __future__ import annotations

import torch
from torch import nn

from engine.layers.packed_gemm import BUCKETS, cpu_linears
from kernels.linear_rows import linear_rows, pack_rows

MAX_ROWS = BUCKETS[-1]  # the largest row bucket a compiled graph pads to
# The row buckets of whole-forward graphs on streamed weights (EngineConfig.cpu_compile "full"): 2 beside
# PackedGemm's, as one copy of the weights serves every bucket here (PackedGemm keeps one per bucket), and where the
# CPU's FMA throughput bounds few-row matmuls a row costs: SmolLM2's layers at 2 / 4 rows cost 1.11x / 1.38x one
# row on the 2-core Zen-1 EPYC (bench/results/linear_rows_cpu.md), so k=1 at batch 1 (and batch 2 without
# speculation) verifies 2 rows, not 4 padded ones.
# And a 32-row bucket served only by the C++ stack op (engine/models/native_stack.py), never an inductor graph: a
# speculative step at batch 16 (16 requests x 2 rows at k=1) ran eagerly, ~3.6x a plain batch-16 step on the 2-core
# EPYC, where 32 rows of streamed bf16 weights cost ~1.3x 16 rows'.
STREAMED_BUCKETS = (1, 2, *BUCKETS[1:], 32)
NATIVE_ONLY_ROWS = MAX_ROWS  # buckets above it run only as the C++ stack op (else eagerly)


class StreamedGemm:
    """y = x W^T + b for 1-16 rows through kernels/linear_rows.py; None for other row counts (use F.linear)."""

    in_graphs = True  # linear() emits it while a function is traced (PackedGemm's kernels are compiled code instead)

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype | None = None):
        """dtype: the packed copy's (EngineConfig.weight_dtype: bf16 under fp32 arithmetic); None: the weight's."""
        self.pack = pack_rows(weight if dtype is None else weight.to(dtype))
        self.n = weight.shape[0]
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor | None:
        if x.dim() != 2 or not 0 < x.shape[0] <= MAX_ROWS or x.dtype not in (torch.float32, torch.bfloat16):
            return None
        return linear_rows(x, self.pack, self.bias, self.n)


def stream_cpu_gemms(model: nn.Module, seen: dict[int, StreamedGemm] | None = None,
                     dtype: torch.dtype | None = None) -> int:
    """Give every fp32/bf16 CPU linear of `model` (projections and the LM head) a StreamedGemm, replacing any
    PackedGemm. A weight shared by two modules (a tied or shared head; `seen` carries them across models: a draft head
    sharing the target's LM head) gets one. dtype: the packed copies' (bf16 weights under fp32 arithmetic,
    engine/layers/weight_dtype.py); None: each weight's own. -> number of weights packed."""
    seen = {} if seen is None else seen
    for _, module, bias in cpu_linears(model):
        if module.weight.dtype not in (torch.float32, torch.bfloat16):
            continue
        key = id(module.weight)
        if key not in seen:
            seen[key] = StreamedGemm(module.weight, bias, dtype)
        module.packed = seen[key]
    return len(seen)
