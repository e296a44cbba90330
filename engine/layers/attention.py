"""Paged attention layer and the per-step attention metadata that it reads.

The metadata of a step (slot mapping, block tables, lengths) is built by the model runner before
the forward and scoped to it with `attention_context`, never stored in a module global. Every tensor
in it has a fixed shape for a given padded batch, so a CUDA graph can capture the forward.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from engine.layers.rotary import RopeAt
from engine.scoped import ForwardScoped
from kernels._dispatch import use_triton
from kernels.attention import (CPU_KERNEL_MAX_Q, AttentionPlan, cpu_kernel_serves, paged_attention, paged_attention_cpu,
                               plan_paged_attention)
from kernels.norm_rope import apply_rope, rms_norm, rope_store_kv
from kernels.store_kv import StorePlan, plan_store_kv, store_kv


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    kv_cache: torch.Tensor  # [num_layers, planes, num_blocks, block_size, heads, head_dim] (engine/layers/kv_spec.py)
    slot_mapping: torch.Tensor  # [T] int64, -1 for padding tokens
    block_tables: torch.Tensor  # [B, max_blocks] int32, 0 past each request's blocks
    seq_lens: torch.Tensor  # [B] int32, KV length including this step's tokens
    query_start_loc: torch.Tensor  # [B + 1] int32
    max_q_len: int  # host bound on the new tokens of any request
    max_seq_len: int  # host bound on seq_lens
    tree_mask: torch.Tensor | None = None  # [T] int64 draft trees' masks (kernels/tree_mask.py); None: causal
    # Reference-path (CPU) plans of this step, made by the first layer and reused by the others
    # (dataclasses.replace shares the dict: a plan depends only on the fields above and its key).
    # Whoever rewrites those tensors in place (static graph buffers) must clear it.
    plans: dict = field(default_factory=dict, compare=False, repr=False)

    def store_plan(self) -> StorePlan:
        plan = self.plans.get("store")
        if plan is None:
            plan = self.plans["store"] = plan_store_kv(self.slot_mapping)
        return plan

    def attention_plan(self, num_tokens: int, page_size: int, group: int) -> AttentionPlan:
        key = (num_tokens, page_size, group)
        plan = self.plans.get(key)
        if plan is None:
            plan = self.plans[key] = plan_paged_attention(self.block_tables, self.seq_lens, self.query_start_loc,
                                                          num_tokens, page_size, group, self.max_q_len,
                                                          self.max_seq_len, self.tree_mask)
        return plan


_current: ForwardScoped[AttentionMetadata] = ForwardScoped(
    "attention_metadata", "attention layers run only inside attention_context(...)")


def attention_context(meta: AttentionMetadata):
    return _current.scope(meta)


def current_metadata() -> AttentionMetadata:
    return _current.get()


class PagedAttention(nn.Module):
    """Writes this step's K/V into the paged cache, then attends over each request's whole prefix."""

    def __init__(self, layer_idx: int, num_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__()
        self.layer_idx = layer_idx  # index into the cache's layer dim (draft layers come after the target's)
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.group = num_heads // num_kv_heads  # query heads per KV head
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: RopeAt | None = None,
                qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq * D]. rope: q and k come unrotated and are rotated here, on the
        Triton path in one launch with the KV store (kernels/norm_rope.py rope_store_kv); None: already rotated.
        qk_norm (q weight, k weight, eps), with rope: q and k come un-normed too and are RMS-normed per head first
        (Qwen3), in that same launch."""
        meta = current_metadata()
        k_cache = meta.kv_cache[self.layer_idx, 0]
        v_cache = meta.kv_cache[self.layer_idx, 1]
        if rope is not None and use_triton(q):
            q = rope_store_kv(q, k, v, rope.positions, rope.cos_sin, k_cache, v_cache, meta.slot_mapping, qk_norm)
            return self._attend(meta, q, k_cache, v_cache)
        if qk_norm is not None:
            q, k = rms_norm(q, qk_norm[0], qk_norm[2]), rms_norm(k, qk_norm[1], qk_norm[2])
        if rope is not None:
            q, k = apply_rope(q, k, rope.positions, rope.cos_sin, rope.rows)
        kernel = cpu_kernel_serves(q)
        if kernel and meta.max_q_len <= CPU_KERNEL_MAX_Q:  # one C++ call: the stores and the attention, no plans
            out = paged_attention_cpu(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                      self.scale, tree_mask=meta.tree_mask, key=k, value=v,
                                      slot_mapping=meta.slot_mapping)
            return out.view(q.shape[0], self.num_heads * self.head_dim)
        ref = not use_triton(q)  # the torch reference: its index math is planned once per step, for every layer
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping, meta.store_plan() if ref else None)
        return self._attend(meta, q, k_cache, v_cache, kernel)

    def _attend(self, meta: AttentionMetadata, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                kernel: bool = False) -> torch.Tensor:
        """The attention over the cache, this step's rows stored. Every row of a step belongs to a request (a graph's
        padding rows to its padding requests, engine/runner/batch.py), so on the Triton path the output is left
        uninitialised: the kernel writes every row, and zeroing rows past the batch would be a memset launch, a
        graph node, per layer."""
        ref = not use_triton(q)
        plan = meta.attention_plan(q.shape[0], k_cache.shape[1], self.group) if ref else None
        out = paged_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                              self.scale, meta.max_q_len, meta.max_seq_len, None if ref else torch.empty_like(q),
                              plan=plan, tree_mask=meta.tree_mask)
        if kernel and out.stride(2) == 1:
            # A prefill chunk beside short requests: theirs come from the kernel, as in a step without the chunk.
            paged_attention_cpu(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                self.scale, out=out, tree_mask=meta.tree_mask, max_rows=CPU_KERNEL_MAX_Q)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)
