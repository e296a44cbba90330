"""Rotary position embedding (neox / Llama layout), with Llama-3 and linear scaling.

The cos/sin cache and the rotation are the kernels' (kernels/norm_rope.py): Triton on CUDA, the
torch reference on CPU. The cache stays fp32 whatever the model dtype."""
from __future__ import annotations

import torch
from torch import nn

from kernels.norm_rope import apply_rope, build_rope_cache


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_pos: int, theta: float, scaling: dict | None):
        super().__init__()
        self.register_buffer("cos_sin", build_rope_cache(head_dim, max_pos, theta, scaling), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """positions [T]; q [T, Hq, D]; k [T, Hkv, D] -> rotated (q, k)."""
        return apply_rope(q, k, positions, self.cos_sin)
