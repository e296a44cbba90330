"""RMSNorm with an optional fused residual add (the residual stream is carried between layers).
The arithmetic is the kernels' (kernels/norm_rope.py): Triton on CUDA, the torch reference on CPU."""
from __future__ import annotations

import torch
from torch import nn

from kernels.norm_rope import rms_norm


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without residual: norm(x). With residual: (norm(x + residual), x + residual)."""
        return rms_norm(x, self.weight, self.eps, residual)
