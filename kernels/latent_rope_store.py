"""Multi-head latent attention's (DeepSeek-V3) per-token work before the attention, in one launch on a GPU.

Per token, from the down projection's outputs: the compressed latent c [L] is RMS-normed (kv_a_layernorm), the rope
key [R] and the query's rope parts [H, R] are rotated by the token's position, and the latent cache row at the
token's slot gets [normed c | rotated key] (kernels/mla_attention.py's layout). Three launches before (the norm,
the rotation of q and k, the cache store), each a graph node of a few microseconds at batch 1; the normed latent
and the rotated key are never materialised outside the cache. The rounding is the three steps': the norm as
kernels/norm_rope.py's rms_norm_ref (the normed row to the activation dtype, then times the weight), the rotation as
apply_rope_ref (fp32, rounded to the activation dtype), then the cache's dtype.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._dispatch import interpreter_bf16, next_pow2, use_triton
from kernels._launch import launch
from kernels.mla_attention import store_latent_ref
from kernels.norm_rope import _cos_sin_row, _normed_row, _rotate_heads, apply_rope_ref, rms_norm_ref


def latent_rope_store_ref(latent, rope_key, q_rope, positions, cos_sin, weight, eps, latent_cache, slot_mapping):
    """rms_norm_ref of the latent, apply_rope_ref of q_rope and the key, store_latent_ref: what the kernel fuses.
    latent [T, L], rope_key [T, R], q_rope [T, H, R] -> q_rope rotated; the cache row of each slot written."""
    q, k = apply_rope_ref(q_rope, rope_key[:, None], positions, cos_sin)
    store_latent_ref(rms_norm_ref(latent, weight, eps), k[:, 0], latent_cache, slot_mapping)
    return q


@triton.jit
def _latent_rope_store_kernel(
    latent_ptr,  # [T, L] (L contiguous)
    key_ptr,  # [T, R] (R contiguous)
    q_ptr,  # [T, H, R] (R contiguous)
    q_out_ptr,  # [T, H, R] contiguous
    w_ptr,  # [L] the latent norm's weight
    cache_ptr,  # [N, S, L + R] contiguous
    slot_ptr,  # [T] int64, -1 = padding (nothing stored)
    pos_ptr,  # [T] int
    cos_sin_ptr,  # [max_pos, R] contiguous
    stride_lt, stride_kt, stride_qt, stride_qh, eps,
    H: tl.constexpr, L: tl.constexpr, R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_L: tl.constexpr,
    BLOCK_HALF: tl.constexpr, RNE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t)
    cos, sin, f, f_ok = _cos_sin_row(cos_sin_ptr, pos_ptr, t, R, BLOCK_HALF)
    # the query's rope parts: every head rotated into q_out (R == the head's features: no pass-through)
    _rotate_heads(q_ptr, q_out_ptr, stride_qt, stride_qh, t, t, cos, sin, f, f_ok, q_ptr, 0.0, H, R, R, BLOCK_H,
                  1, RNE, False)
    row = cache_ptr + slot * (L + R)
    # the latent, normed: rms_norm_ref's rounding (the normed row to the activation dtype, then times the weight)
    c = tl.arange(0, BLOCK_L)
    c_in = c < L
    c_ok = c_in & ((c * 0 + slot) >= 0)  # the slot test broadcast: the interpreter rejects scalar masks
    x = tl.load(latent_ptr + t * stride_lt + c, mask=c_in, other=0.0).to(tl.float32)
    y = _normed_row(x, w_ptr, c, c_in, eps, latent_ptr, L, RNE)  # in the activation dtype, as rms_norm's kernel
    tl.store(row + c, y.to(cache_ptr.dtype.element_ty), mask=c_ok)
    # the rope key: one head rotated straight into the slot's row, after the latent (rows of L + R)
    _rotate_heads(key_ptr, cache_ptr + L, stride_kt, 0, t, slot, cos, sin, f, f_ok, key_ptr, 0.0, 1, R, R, 1, 1, RNE,
                  False, L + R)


def latent_rope_store_triton(latent, rope_key, q_rope, positions, cos_sin, weight, eps, latent_cache, slot_mapping):
    assert latent_cache.dim() == 3 and latent_cache.is_contiguous(), latent_cache.shape
    T, L = latent.shape
    _, H, R = q_rope.shape
    assert rope_key.shape == (T, R) and q_rope.shape[0] == T and latent_cache.shape[2] == L + R, \
        (latent.shape, rope_key.shape, q_rope.shape, latent_cache.shape)
    assert latent.stride(1) == 1 and rope_key.stride(1) == 1 and q_rope.stride(2) == 1, "features must be contiguous"
    assert latent.dtype == rope_key.dtype == q_rope.dtype and weight.shape == (L,) and weight.is_contiguous()
    assert positions.shape == (T,) and positions.is_contiguous() and cos_sin.is_contiguous() and cos_sin.shape[1] == R
    assert slot_mapping.shape == (T,) and slot_mapping.dtype == torch.int64 and R % 2 == 0
    q_out = torch.empty((T, H, R), dtype=q_rope.dtype, device=q_rope.device)
    if T:
        launch(_latent_rope_store_kernel, (T,), latent, rope_key, q_rope, q_out, weight, latent_cache, slot_mapping,
               positions, cos_sin, latent.stride(0), rope_key.stride(0), q_rope.stride(0), q_rope.stride(1), eps,
               H=H, L=L, R=R, BLOCK_H=next_pow2(H), BLOCK_L=next_pow2(L), BLOCK_HALF=next_pow2(R // 2),
               RNE=interpreter_bf16(latent))
    return q_out


def latent_rope_store(latent, rope_key, q_rope, positions, cos_sin, weight, eps, latent_cache, slot_mapping):
    """latent [T, L] (un-normed), rope_key [T, R] and q_rope [T, H, R] (unrotated) -> q_rope rotated by `positions`
    [T]; the latent cache row at each token's slot (-1: skipped) := [rms_norm(latent) | rotated key]. (The engine's
    reference path norms, rotates and stores apart, with a store plan made once per step:
    engine/layers/latent_attention.py.)"""
    fn = latent_rope_store_triton if use_triton(latent) else latent_rope_store_ref
    return fn(latent, rope_key, q_rope, positions, cos_sin, weight, eps, latent_cache, slot_mapping)
