"""Few-row CPU matmuls on weights packed for streaming (kernels/cpu/linear_rows.cpp, torch.ops.tandem_cpu.linear_rows).

`pack_rows(weight)` lays a [N, K] weight out as [ceil(N / PACK), K, PACK]: PACK output rows interleaved per input
column, zero-padded, so that a few-row matmul reads it as one sequential stream. The engine packs a model's weights
once, in the model's dtype, for EngineConfig.cpu_compile="full" (engine/models/piecewise.py); every row bucket's
graph reads the same packed copy. Needs cpu_ext.available().
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

PACK = 32  # mirrors BLOCK in kernels/cpu/linear_rows.cpp


# bf16: within each 16 rows the middle two quads swap places (the kernel widens bf16 with in-lane unpacks, which
# read them back in row order); fp32 keeps row order.
_BF16_ORDER = torch.tensor([r for h in (0, 16) for r in (*range(h, h + 4), *range(h + 8, h + 12), *range(h + 4, h + 8),
                                                          *range(h + 12, h + 16))])


def pack_rows(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [ceil(N / PACK), K, PACK], contiguous, same dtype."""
    N, K = weight.shape
    pad = -N % PACK
    w = F.pad(weight, (0, 0, 0, pad)) if pad else weight
    packed = w.reshape(-1, PACK, K).transpose(1, 2)
    if weight.dtype == torch.bfloat16:
        packed = packed[:, :, _BF16_ORDER]
    return packed.contiguous()


def linear_rows(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [M, K] (fp32 or bf16; fp32 accumulation) and packed = pack_rows(weight)
    (fp32 or bf16), weight having n rows. -> [M, n] in x's dtype."""
    return torch.ops.tandem_cpu.linear_rows(x, packed, bias, int(n))
