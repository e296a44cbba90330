"""Rotary position embedding (neox / Llama layout), with Llama-3 and linear scaling.

The cos/sin cache and the rotation are the kernels' (kernels/norm_rope.py): Triton on CUDA, the
torch reference on CPU. The cache stays fp32 whatever the model dtype. A forward looks its positions
up once (`at`) and every layer rotates with that: the reference path then gathers cos/sin once per
step instead of once per layer."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kernels._dispatch import use_triton
from kernels.norm_rope import apply_rope, build_rope_cache, rope_rows


@dataclass(frozen=True, slots=True)
class RopeAt:
    """A forward's positions and, on the reference path, their gathered tables."""

    positions: torch.Tensor  # [T] int64
    rows: tuple[torch.Tensor, torch.Tensor] | None  # rope_rows(positions, cos_sin); None on the Triton path
    cos_sin: torch.Tensor | None = None  # the embedding's table

    @property
    def fused(self) -> bool:
        """The Triton path: the attention rotates q and k itself, in one launch with the KV store
        (engine/layers/attention.py), so the projections hand them over unrotated."""
        return self.rows is None and self.cos_sin is not None


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_pos: int, theta: float, scaling: dict | None):
        super().__init__()
        self.register_buffer("cos_sin", build_rope_cache(head_dim, max_pos, theta, scaling), persistent=False)

    def at(self, positions: torch.Tensor) -> RopeAt:
        """positions [T] -> what each layer of one forward rotates with."""
        return RopeAt(positions, None if use_triton(positions) else rope_rows(positions, self.cos_sin), self.cos_sin)

    def forward(self, rope: RopeAt, q: torch.Tensor, k: torch.Tensor):
        """rope: self.at(positions); q [T, Hq, D]; k [T, Hkv, D] -> rotated (q, k)."""
        return apply_rope(q, k, rope.positions, self.cos_sin, rope.rows)
