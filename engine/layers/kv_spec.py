"""What one layer of a model caches per token: the shape the model runner allocates the paged KV cache
with. Each model states its own (`kv_cache_spec()`), so a cache is never assumed to be K and V heads.

The engine's cache tensor is `[num_layers, planes, num_blocks, block_size, heads, head_dim]`:
- Llama family: planes 2 (K and V), this rank's KV heads, head_dim;
- MLA (DeepSeek-V3): planes 1, one "head" holding the latent and the rope key (kv_lora_rank + qk_rope_head_dim),
  which every attention head reads. Tensor parallelism cannot shard that head: every TP rank holds it whole
  (`replicated`), and a hand-over sends each rank all of it (attention data parallelism is what saves memory).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    planes: int  # 2: separate K and V tensors; 1: one row per token (the MLA latent)
    heads: int  # KV heads on this rank (1 for MLA)
    head_dim: int  # elements per head per plane
    replicated: bool = False  # the same heads on every tensor-parallel rank (MLA's latent), not a slice of them

    def __post_init__(self) -> None:
        if self.planes not in (1, 2) or self.heads < 1 or self.head_dim < 1:
            raise ValueError(f"invalid KV cache spec {self}")

    def elements_per_token(self) -> int:
        """Elements one token caches in one layer."""
        return self.planes * self.heads * self.head_dim

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        return self.elements_per_token() * dtype.itemsize

    def shape(self, num_layers: int, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (num_layers, self.planes, num_blocks, block_size, self.heads, self.head_dim)
