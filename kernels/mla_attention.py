"""Latent paged KV cache writes and varlen latent paged attention (multi-head latent attention, MLA).

Layout shared with the engine: per layer `latent_cache` is `[num_blocks, block_size, L + R]`, contiguous:
each token's compressed latent c (L = kv_lora_rank) then its rotated rope key (R = qk_rope_head_dim),
one row for all heads. Attention runs in the absorbed form: each head's query arrives already projected
into latent space (q_latent = q_nope W_UK, [T, H, L]) beside its rotated rope part ([T, H, R]); scores are
q_latent . c + q_rope . k_rope and the output is softmax @ c, [T, H, L] (the caller applies W_UV). The batch
layout (varlen query rows, block tables, lengths, causal within a request) is kernels/attention.py's.

Each public function picks the Triton kernel on CUDA (or under TANDEM_TRITON_ON_CPU) and the torch reference
otherwise. The Triton path reads no tensor data on the host (CUDA-graph capturable); the reference is
paged_attention_ref over the latent rows as a single KV head whose values are the rows themselves,
sharing its per-step plan.
"""
import math

import torch

from kernels import _attention_triton as _attn
from kernels import _mla_attention_triton as _tr
from kernels._dispatch import next_pow2, use_triton
from kernels._launch import launch, multiprocessor_count, on_gpu
from kernels.attention import AttentionPlan, paged_attention_ref
from kernels.store_kv import StorePlan, plan_store_kv


MAX_COMBINE_ELEMENTS = 64 * 128


def _check_cache(latent_cache: torch.Tensor) -> None:
    assert latent_cache.dim() == 3 and latent_cache.is_contiguous(), (latent_cache.shape, latent_cache.stride())


# ------------------------------------------------------------------------------------- store_latent


def store_latent_ref(
    latent: torch.Tensor,  # [T, L]
    rope_key: torch.Tensor,  # [T, R]
    latent_cache: torch.Tensor,  # [N, S, L + R]
    slot_mapping: torch.Tensor,  # [T] int64, -1 = padding
    plan: StorePlan | None = None,  # plan_store_kv(slot_mapping), shared by the layers of a step
) -> None:
    _check_cache(latent_cache)
    T, L = latent.shape
    assert rope_key.shape[0] == T and L + rope_key.shape[1] == latent_cache.shape[2], (latent.shape, rope_key.shape)
    if T == 0:
        return
    flat = latent_cache.view(-1, latent_cache.shape[2])
    rows = torch.cat([latent, rope_key], -1).to(flat.dtype)
    plan = plan if plan is not None else plan_store_kv(slot_mapping)
    if plan.direct:
        flat.index_copy_(0, slot_mapping, rows)
        return
    # Padding rows rewrite a real row's slot with that row's data (kernels/attention.py's plan_store_kv).
    flat.index_copy_(0, plan.dst, torch.where(plan.keep, flat[0], rows.index_select(0, plan.src)))


def store_latent_triton(latent, rope_key, latent_cache, slot_mapping) -> None:
    _check_cache(latent_cache)
    T, L = latent.shape
    R = rope_key.shape[1]
    assert rope_key.shape == (T, R) and latent_cache.shape[2] == L + R, (latent.shape, rope_key.shape)
    assert latent.stride(1) == 1 and rope_key.stride(1) == 1, "features must be contiguous"
    assert slot_mapping.shape == (T,) and slot_mapping.dtype == torch.int64
    assert latent.device == rope_key.device == latent_cache.device == slot_mapping.device
    if T == 0:
        return
    launch(_tr.store_latent_kernel, (T,), latent, rope_key, latent_cache, slot_mapping,
           latent.stride(0), rope_key.stride(0), LATENT=L, ROPE=R, BLOCK_L=next_pow2(L), BLOCK_R=next_pow2(R))


def store_latent(latent, rope_key, latent_cache, slot_mapping, plan: StorePlan | None = None) -> None:
    """Write each token's latent `[T, L]` and rope key `[T, R]` as one cache row at `slot_mapping` `[T]`
    (-1 = skip). In place. `plan` (reference path only): plan_store_kv's index math of the step."""
    if use_triton(latent):
        store_latent_triton(latent, rope_key, latent_cache, slot_mapping)
    else:
        store_latent_ref(latent, rope_key, latent_cache, slot_mapping, plan)


# ------------------------------------------------------------------------------------ mla_attention


def mla_attention_ref(
    q_latent: torch.Tensor,  # [T, H, L]
    q_rope: torch.Tensor,  # [T, H, R]
    latent_cache: torch.Tensor,  # [N, S, L + R]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32, KV length including the new tokens
    query_start_loc: torch.Tensor,  # [B+1] int32
    scale: float,
    max_q_len: int,
    max_seq_len: int,
    out: torch.Tensor | None = None,  # [T, H, L]
    plan: AttentionPlan | None = None,  # plan_paged_attention(..., group=H) of this step, shared by its layers
    tree_mask: torch.Tensor | None = None,  # [T] int64, bit w admits KV position seq_len - 64 + w (tree_mask.py)
) -> torch.Tensor:
    """The latent rows as one KV head whose keys are [c, k_rope] and whose values are the same rows; the
    value's last R features (the rope key) are dropped from the output. A plan made with a tree mask carries it."""
    _check_cache(latent_cache)
    T, H, L = q_latent.shape
    assert q_rope.shape[:2] == (T, H) and L + q_rope.shape[2] == latent_cache.shape[2], (q_latent.shape, q_rope.shape)
    rows = latent_cache.unsqueeze(2)  # [N, S, 1, L + R]
    query = torch.cat([q_latent, q_rope.to(q_latent.dtype)], -1)
    o = paged_attention_ref(query, rows, rows, block_tables, seq_lens, query_start_loc, scale, max_q_len, max_seq_len,
                            plan=plan, tree_mask=tree_mask)[..., :L]
    return o.contiguous() if out is None else out.copy_(o)


def mla_attention_triton(
    q_latent, q_rope, latent_cache, block_tables, seq_lens, query_start_loc, scale, max_q_len, max_seq_len,
    out=None, num_splits: int | None = None, tree_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton varlen latent paged attention; `num_splits > 1` splits each request's KV (flash decoding)
    and combines the partial results by log-sum-exp. None picks splits from the launch size.
    fp32 inputs use IEEE fp32 dots; bf16 off a GPU (the interpreter) is upcast in registers."""
    _check_cache(latent_cache)
    T, H, L = q_latent.shape
    R = q_rope.shape[2]
    N, S, W = latent_cache.shape
    B = block_tables.shape[0]
    assert q_rope.shape == (T, H, R) and W == L + R, (q_latent.shape, q_rope.shape, latent_cache.shape)
    assert q_latent.dtype == q_rope.dtype == latent_cache.dtype, (q_latent.dtype, q_rope.dtype, latent_cache.dtype)
    assert q_latent.stride(2) == 1 and q_rope.stride(2) == 1, (q_latent.stride(), q_rope.stride())
    assert block_tables.dtype == torch.int32 and block_tables.stride(1) == 1
    assert seq_lens.dtype == torch.int32 and seq_lens.shape == (B,) and seq_lens.is_contiguous()
    assert query_start_loc.dtype == torch.int32 and query_start_loc.shape == (B + 1,)
    assert query_start_loc.is_contiguous()
    if tree_mask is not None:
        assert tree_mask.dtype == torch.int64 and tree_mask.shape == (T,) and tree_mask.is_contiguous()
    if out is None:
        out = torch.zeros_like(q_latent)
    assert out.shape == q_latent.shape and out.dtype == q_latent.dtype and out.stride(2) == 1
    if T == 0 or B == 0 or max_q_len == 0:
        return out
    gpu = on_gpu(q_latent)
    fp32_dot = q_latent.dtype == torch.float32 or (q_latent.dtype == torch.bfloat16 and not gpu)
    tiles = _tr.mla_config(H, max_q_len, L, fp32_dot, gpu)
    q_blocks = -(-max_q_len // tiles.tokens_per_block)
    head_blocks = -(-H // tiles.heads_per_tile)
    if num_splits is None:
        sm_count = multiprocessor_count(q_latent.device) if gpu else None
        num_splits = _attn.pick_num_splits(q_blocks * B * head_blocks, max_seq_len, sm_count)
        # The combine holds a [splits, L] fp32 tile per row; at L = 512, 64 splits spilled registers on sm_80-100
        # (kernels/compile_check.py): at most as many elements as 64 splits of a 128-wide head.
        num_splits = min(num_splits, max(1, MAX_COMBINE_ELEMENTS // next_pow2(L)))
    chunk = -(-max(1, max_seq_len) // num_splits)
    chunk = -(-chunk // tiles.block_n) * tiles.block_n
    num_splits = -(-max(1, max_seq_len) // chunk)
    if num_splits == 1:
        part_out, part_lse = out, out  # the lse pointer is unused without SPLIT
        o_strides, l_strides = (0, out.stride(0), out.stride(1)), (0, 0)
    else:
        part_out = torch.empty((num_splits, T, H, L), device=q_latent.device, dtype=torch.float32)
        part_lse = torch.empty((num_splits, T, H), device=q_latent.device, dtype=torch.float32)
        o_strides, l_strides = part_out.stride()[:3], part_lse.stride()[:2]
    launch(
        _tr.mla_attention_kernel, (q_blocks, B, head_blocks * num_splits),
        q_latent, q_rope, latent_cache, block_tables, seq_lens, query_start_loc, part_out, part_lse,
        tree_mask if tree_mask is not None else seq_lens,  # any pointer when TREE is off
        scale * math.log2(math.e),
        q_latent.stride(0), q_latent.stride(1), q_rope.stride(0), q_rope.stride(1),
        latent_cache.stride(0), latent_cache.stride(1),
        block_tables.stride(0),
        o_strides[0], o_strides[1], o_strides[2],
        l_strides[0], l_strides[1],
        chunk, num_splits,
        H=H, HB=tiles.heads_per_tile, PAGE=S, LATENT=L, ROPE=R,
        BLOCK_L=next_pow2(max(L, 16)), BLOCK_R=next_pow2(max(R, 16)),
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, SPLIT=num_splits > 1, FP32_DOT=fp32_dot,
        TREE=tree_mask is not None, num_warps=tiles.num_warps,
    )
    if num_splits > 1:
        launch(
            _attn.combine_splits_kernel, (max_q_len, B, H), part_out, part_lse, query_start_loc, out,
            part_out.stride(0), part_out.stride(1), part_out.stride(2),
            part_lse.stride(0), part_lse.stride(1),
            out.stride(0), out.stride(1), num_splits,
            HEAD_DIM=L, BLOCK_D=next_pow2(L), SPLITS_P2=next_pow2(num_splits),
        )
    return out


def mla_attention(
    q_latent, q_rope, latent_cache, block_tables, seq_lens, query_start_loc, scale, max_q_len, max_seq_len,
    out=None, plan: AttentionPlan | None = None, tree_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Varlen causal latent attention of q_latent `[T, H, L]` and q_rope `[T, H, R]` over the latent paged
    cache; returns `[T, H, L]` in latent space. Rows past `query_start_loc[B]` belong to no request:
    zero (reference, or a fresh `out`) or untouched (Triton with a caller `out`). `tree_mask` [T] int64: draft
    trees' masks as in kernels/attention.py's paged_attention (all bits set: causal); a reference `plan` must
    have been made with the same mask."""
    if use_triton(q_latent):
        return mla_attention_triton(q_latent, q_rope, latent_cache, block_tables, seq_lens, query_start_loc, scale,
                                    max_q_len, max_seq_len, out, tree_mask=tree_mask)
    return mla_attention_ref(q_latent, q_rope, latent_cache, block_tables, seq_lens, query_start_loc, scale,
                             max_q_len, max_seq_len, out, plan, tree_mask)
