"""Latent paged attention (MLA): writes this step's latent rows into the layer's cache, then attends over
each request's whole prefix in the absorbed form. Every row takes that one path (prompt chunks, decode, chains, a
draft tree's verification and expansion rows: the metadata's tree mask goes to the kernel as PagedAttention's
does). Reads the step's AttentionMetadata like PagedAttention;
the layer's cache is `kv_cache[layer, 0, :, :, 0]` `[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]`
(engine/layers/kv_spec.py)."""
from __future__ import annotations

import torch
from torch import nn

from engine.layers.attention import current_metadata
from engine.layers.kv_spec import KVCacheSpec
from kernels._dispatch import use_triton
from kernels.latent_rope_store import latent_rope_store
from kernels.mla_attention import mla_attention, store_latent


class LatentPagedAttention(nn.Module):
    def __init__(self, layer_idx: int, num_heads: int, kv_lora_rank: int, qk_rope_head_dim: int, scale: float):
        super().__init__()
        self.layer_idx = layer_idx  # index into the cache's layer dim (draft layers come after the target's)
        self.num_heads = num_heads
        self.group = num_heads  # query heads per KV head: every head reads the one latent row (plans are keyed by it)
        self.kv_lora_rank = kv_lora_rank
        self.qk_rope_head_dim = qk_rope_head_dim
        self.scale = scale

    def kv_cache_spec(self) -> KVCacheSpec:
        return KVCacheSpec(planes=1, heads=1, head_dim=self.kv_lora_rank + self.qk_rope_head_dim, replicated=True)

    def forward(self, q_latent: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor,
                rope_key: torch.Tensor, fused: tuple | None = None) -> torch.Tensor:
        """q_latent [T, H, L] (q_nope already through W_UK), q_rope [T, H, R] rotated; latent [T, L]
        normed, rope_key [T, R] rotated -> [T, H, L] attention output in latent space. fused (RopeAt, the latent
        norm's weight, eps), the Triton path: q_rope and rope_key come unrotated and the latent un-normed, and one
        launch norms, rotates and stores them (kernels/latent_rope_store.py)."""
        meta = current_metadata()
        cache = meta.kv_cache[self.layer_idx, 0, :, :, 0]  # [N, S, L + R], contiguous
        ref = not use_triton(q_latent)  # the torch reference: its index math is planned once per step
        if fused is not None:
            assert not ref, "the fused latent store is the Triton path's"
            rope, weight, eps = fused
            q_rope = latent_rope_store(latent, rope_key, q_rope, rope.positions, rope.cos_sin, weight, eps, cache,
                                       meta.slot_mapping)
        else:
            store_latent(latent, rope_key, cache, meta.slot_mapping, meta.store_plan() if ref else None)
        plan = meta.attention_plan(q_latent.shape[0], cache.shape[1], self.num_heads) if ref else None
        # On the Triton path the output is not zero-filled first (a memset per layer): every row of a step belongs
        # to a request, and the kernel writes each request's rows (engine/layers/attention.py does the same).
        return mla_attention(q_latent, q_rope, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                             self.scale, meta.max_q_len, meta.max_seq_len, None if ref else torch.empty_like(q_latent),
                             plan=plan, tree_mask=meta.tree_mask)
