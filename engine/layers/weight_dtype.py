"""bf16 weights with fp32 arithmetic on a CPU (EngineConfig.weight_dtype = "bfloat16").

A batch-1 CPU decode step is bound by reading its weights; bf16 halves the bytes. But on a CPU without bf16
arithmetic (AVX2; torch's bf16 elementwise ops and attention convert back and forth) a bf16 *model* decodes slower
than fp32 (bench/results/real_decode_full_bf16_cpu.md: 22.9 against 32.7 tok/s). So only the weights go bf16:
every matrix is rounded to bf16 once at load, and under cpu_compile="full" the streamed matmuls read a bf16 packed
copy, widened to fp32 in registers (kernels/cpu/linear_rows.cpp); activations, norms, attention, the KV cache
and the logits stay fp32. This is llama.cpp's bf16 model: 2-D tensors bf16, 1-D tensors (norms) f32.

Every path of the engine computes with the same rounded values, so prefill (F.linear on the fp32 copy of the
rounded weights: a prefill worker runs uncompiled), decode (the bf16 stream) and verification agree with each
other and with a transformers model whose matrices are rounded the same way (tests/engine/layers/test_weight_dtype.py).
The fp32 copy stays for the matmuls past the streamed row buckets (prefill chunks), so weights take 1.5x fp32's memory,
not 0.5x: this is a speed option, not a memory one.
"""
from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def round_weights(nets: list[nn.Module], dtype: torch.dtype) -> int:
    """Round every parameter of two or more dims (projections, embeddings, LM heads) of `nets` to `dtype`'s values,
    in place, keeping the parameters' own dtype, and the row-major copies engine/layers/linear.py's matvec_layout
    keeps of them (`weight_rows`); a tensor shared by nets (a tied head) is rounded once.
    -> number of tensors rounded."""
    seen: set[int] = set()
    for net in nets:
        tensors = [p for p in net.parameters()]
        tensors += [m.weight_rows for m in net.modules() if getattr(m, "weight_rows", None) is not None]
        for t in tensors:
            if t.dim() < 2 or id(t) in seen or not t.is_floating_point():
                continue
            seen.add(id(t))
            t.copy_(t.to(dtype))
    return len(seen)
