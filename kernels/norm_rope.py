"""Fused RMSNorm (optionally with the residual add) and rotary position embedding, Llama conventions.

RMSNorm follows HF Llama: the residual add happens in the activation dtype, statistics in fp32, the
normalized value is rounded to the activation dtype and then multiplied by the weight.
Rotary embedding is the neox / Llama layout (rotate_half) over the first `rotary_dim` features of
each head; `cos_sin [max_pos, rotary_dim]` holds cos in its first half and sin in its second, as
built by `build_rope_cache` (which also implements Llama-3, linear and YaRN rope scaling; YaRN's
attention factor is folded into the table, as transformers multiplies cos and sin by it). The rotation is
computed in fp32 and rounded once.
"""
import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels._attention_triton import store_row
from kernels._dispatch import interpreter_bf16, next_pow2, use_triton
from kernels._launch import launch
from kernels._triton_utils import round_bf16
from kernels.store_kv import check_cache, store_kv_ref


# -------------------------------------------------------------------------------------------- norm


def rms_norm_ref(
    x: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, H]
):
    """norm(x), or with a residual (norm(x + residual), x + residual)."""
    if residual is not None:
        x = x + residual
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        out = F.rms_norm(x, weight.shape, weight, eps)  # one fused op on CPU; same fp32 arithmetic
        return out if residual is None else (out, x)
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    out = (weight.float() * normed.float()).to(x.dtype)
    return out if residual is None else (out, x)


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [T, H]
    res_ptr,  # [T, H] (read when HAS_RES)
    w_ptr,  # [H]
    out_ptr,  # [T, H] contiguous
    new_res_ptr,  # [T, H] contiguous (written when HAS_RES)
    stride_x, stride_r, eps,
    H: tl.constexpr, BLOCK: tl.constexpr, HAS_RES: tl.constexpr, RNE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < H
    x = tl.load(x_ptr + t * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_RES:
        r = tl.load(res_ptr + t * stride_r + cols, mask=ok, other=0.0).to(tl.float32)
        s = x + r
        if RNE:
            s = round_bf16(s)
        s = s.to(new_res_ptr.dtype.element_ty)  # rounded like the reference's dtype add
        tl.store(new_res_ptr + t * H + cols, s, mask=ok)
        x = s.to(tl.float32)
    tl.store(out_ptr + t * H + cols, _normed_row(x, w_ptr, cols, ok, eps, out_ptr, H, RNE), mask=ok)


@triton.jit
def _normed_row(x, w_ptr, cols, ok, eps, out_ptr, H: tl.constexpr, RNE: tl.constexpr):
    """One row x [BLOCK] (fp32, zero past H) RMS-normed and times the weight, in out_ptr's dtype."""
    return _weighted(x * (1.0 / tl.sqrt(tl.sum(x * x, 0) / H + eps)), w_ptr + cols, ok, out_ptr, RNE)


@triton.jit
def _weighted(normed, w_ptrs, w_ok, dtype_ptr, RNE: tl.constexpr):
    """rms_norm_ref's rounding of normed features (fp32): to dtype_ptr's dtype, then times the weight, rounded again
    to that dtype."""
    if RNE:
        normed = round_bf16(normed)
    normed = normed.to(dtype_ptr.dtype.element_ty).to(tl.float32)
    y = tl.load(w_ptrs, mask=w_ok, other=0.0).to(tl.float32) * normed
    if RNE:
        y = round_bf16(y)
    return y.to(dtype_ptr.dtype.element_ty)


def rms_norm_triton(x, weight, eps, residual=None):
    shape, H = x.shape, x.shape[-1]
    assert weight.shape == (H,) and weight.is_contiguous(), (x.shape, weight.shape)
    if residual is not None:
        assert residual.shape == shape and residual.dtype == x.dtype, (residual.shape, shape)
    # Every leading dim is a row, as in the reference: Qwen3 normalizes q/k [T, heads, D] per head.
    if x.dim() != 2:
        x = x.reshape(-1, H)
        residual = residual.reshape(-1, H) if residual is not None else None
    assert x.stride(1) == 1 and (residual is None or residual.stride(1) == 1), (x.stride(), shape)
    T = x.shape[0]
    out = torch.empty((T, H), dtype=x.dtype, device=x.device)
    new_res = torch.empty_like(out) if residual is not None else out
    if T:
        launch(
            _rms_norm_kernel, (T,), x, residual if residual is not None else x, weight, out, new_res,
            x.stride(0), residual.stride(0) if residual is not None else 0, eps,
            H=H, BLOCK=next_pow2(H), HAS_RES=residual is not None, RNE=interpreter_bf16(x),
            num_warps=4 if H <= 4096 else 8,
        )
    out, new_res = out.view(shape), new_res.view(shape)
    return out if residual is None else (out, new_res)


def rms_norm(x, weight, eps, residual=None):
    """RMSNorm over the last dim of x `[..., H]`; with `residual`, returns (normed, new_residual = x + residual)."""
    fn = rms_norm_triton if use_triton(x) else rms_norm_ref
    return fn(x, weight, eps, residual)


# A draft head's input (MTP's eh_proj, EAGLE-3's attention): two rows normed by their own weights, side by side.


def rms_norm_cat_ref(a, weight_a, b, weight_b, eps):
    """[rms_norm_ref(a) | rms_norm_ref(b)] of a and b [T, H] -> [T, 2H]."""
    return torch.cat([rms_norm_ref(a, weight_a, eps), rms_norm_ref(b, weight_b, eps)], -1)


@triton.jit
def _rms_norm_cat_kernel(a_ptr, wa_ptr, b_ptr, wb_ptr, out_ptr, stride_a, stride_b, eps,
                         H: tl.constexpr, BLOCK: tl.constexpr, RNE: tl.constexpr):
    """Token t: a's row normed into out[t, :H], b's into out[t, H:]: one launch where two norms and a cat were three."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < H
    a = tl.load(a_ptr + t * stride_a + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * 2 * H + cols, _normed_row(a, wa_ptr, cols, ok, eps, out_ptr, H, RNE), mask=ok)
    b = tl.load(b_ptr + t * stride_b + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * 2 * H + H + cols, _normed_row(b, wb_ptr, cols, ok, eps, out_ptr, H, RNE), mask=ok)


def rms_norm_cat_triton(a, weight_a, b, weight_b, eps):
    T, H = a.shape
    assert b.shape == (T, H) and a.dtype == b.dtype and a.stride(1) == 1 and b.stride(1) == 1, (a.shape, b.shape)
    assert weight_a.shape == weight_b.shape == (H,) and weight_a.is_contiguous() and weight_b.is_contiguous()
    out = torch.empty((T, 2 * H), dtype=a.dtype, device=a.device)
    if T:
        launch(_rms_norm_cat_kernel, (T,), a, weight_a, b, weight_b, out, a.stride(0), b.stride(0), eps,
               H=H, BLOCK=next_pow2(H), RNE=interpreter_bf16(a), num_warps=4 if H <= 4096 else 8)
    return out


def rms_norm_cat(a, weight_a, b, weight_b, eps):
    """[rms_norm(a, weight_a) | rms_norm(b, weight_b)] of a and b [T, H] -> [T, 2H], one launch on a GPU."""
    fn = rms_norm_cat_triton if use_triton(a) and a.dtype == b.dtype else rms_norm_cat_ref
    return fn(a, weight_a, b, weight_b, eps)


# -------------------------------------------------------------------------------------------- rope


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """[head_dim // 2] fp32 inverse frequencies; `scaling` is the checkpoint's rope_scaling dict
    (rope_type "default", "linear", "llama3" or "yarn"), arithmetic as in transformers."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if rope_type == "default":
        return inv_freq
    factor = scaling["factor"]
    if rope_type == "linear":
        return inv_freq / factor
    if rope_type == "yarn":
        return _yarn_inv_freq(head_dim, theta, scaling)
    if rope_type != "llama3":
        raise ValueError(f"unsupported rope_type {rope_type!r} (default, linear, llama3, yarn)")
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    # short wavelengths kept, long ones divided by factor, a smooth blend in between
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, blended, scaled)


def _yarn_inv_freq(dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """YaRN: frequencies that turn fewer than beta_slow times over the original context are interpolated
    (divided by factor), those turning more than beta_fast times kept, a linear ramp between."""
    factor = scaling["factor"]
    old_len = scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def rope_attention_factor(scaling: dict | None) -> float:
    """The factor transformers multiplies cos and sin by: YaRN's mscale ratio (1 for DeepSeek-V3, whose
    mscale equals mscale_all_dim), 1 for every other rope type."""
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if rope_type != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])

    def mscale(factor: float, m: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    factor, m, m_all = scaling["factor"], scaling.get("mscale"), scaling.get("mscale_all_dim")
    return float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)


def build_rope_cache(head_dim: int, max_pos: int, theta: float, scaling: dict | None = None,
                     dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """cos_sin `[max_pos, head_dim]`: cos of the head_dim/2 frequencies, then their sin (both times the
    rope type's attention factor)."""
    inv_freq = rope_inv_freq(head_dim, theta, scaling)
    freqs = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv_freq[None, :]
    table = torch.cat([freqs.cos(), freqs.sin()], -1)
    factor = rope_attention_factor(scaling)
    if factor != 1.0:
        table = table * factor
    return table.to(device=device, dtype=dtype)


def rope_rows(
    positions: torch.Tensor,  # [T] int
    cos_sin: torch.Tensor,  # [max_pos, rotary_dim]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference path's per-token tables, gathered once per forward and shared by its layers:
    (cos twice [T, 1, R], (-sin, sin) [T, 1, R]) fp32, so that rotate_half becomes two products and a sum."""
    half = cos_sin.shape[1] // 2
    cs = cos_sin.index_select(0, positions.long()).float()
    cos, sin = cs[:, :half], cs[:, half:]
    return torch.cat([cos, cos], -1)[:, None, :], torch.cat([-sin, sin], -1)[:, None, :]


def apply_rope_ref(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    positions: torch.Tensor,  # [T] int
    cos_sin: torch.Tensor,  # [max_pos, rotary_dim]
    rows: tuple[torch.Tensor, torch.Tensor] | None = None,  # rope_rows(positions, cos_sin), if already gathered
) -> tuple[torch.Tensor, torch.Tensor]:
    R = cos_sin.shape[1]
    half = R // 2
    cos2, sin2 = rows if rows is not None else rope_rows(positions, cos_sin)

    def rotate(x):
        # [x1, x2] * [cos, cos] + [x2, x1] * [-sin, sin]: the same products and sums as
        # [x1 cos - x2 sin, x2 cos + x1 sin] (a - b is a + (-b) exactly), in fewer ops.
        xf = x if x.dtype == torch.float32 else x.float()
        xr = xf[..., :R]
        y = xr * cos2
        y += torch.cat([xr[..., half:], xr[..., :half]], -1) * sin2
        if R < xf.shape[-1]:
            y = torch.cat([y, xf[..., R:]], -1)
        return y if x.dtype == torch.float32 else y.to(x.dtype)

    return rotate(q), rotate(k)


@triton.jit
def _rotate_heads(src_ptr, dst_ptr, stride_t, stride_h, t, dst_row, cos, sin, f, f_ok, w_ptr, eps,
                  H: tl.constexpr, D: tl.constexpr, R: tl.constexpr, BLOCK_H: tl.constexpr,
                  BLOCK_PASS: tl.constexpr, RNE: tl.constexpr, HAS_NORM: tl.constexpr, ROW: tl.constexpr = 0):
    """Token t's H heads of src rotated by its cos/sin row [1, BLOCK_HALF] into row dst_row of dst (rows of ROW
    elements, H * D when 0, each holding the H heads contiguous: an output, or a paged cache by slot; a negative
    row, a padding token's slot, is skipped). The result is rounded to src's dtype, then stored in dst's (a cache of
    another dtype rounds once more, as a store of the rotated tensor would). HAS_NORM: each head is first RMS-normed
    over its D features with weight w_ptr [D] (Qwen3's q/k norm), rounded as rms_norm_ref rounds."""
    HALF: tl.constexpr = R // 2
    h = tl.arange(0, BLOCK_H)[:, None]
    ok = (h < H) & f_ok[None, :]
    src = src_ptr + t * stride_t + h * stride_h
    dst = dst_ptr + dst_row * (ROW if ROW else H * D) + h * D
    x1 = tl.load(src + f[None, :], mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + f[None, :], mask=ok, other=0.0).to(tl.float32)
    p = R + tl.arange(0, BLOCK_PASS)[None, :]  # features past rotary_dim pass through (rotation-wise)
    p_in = (h < H) & (p < D)
    if HAS_NORM:
        xp = tl.load(src + p, mask=p_in, other=0.0).to(tl.float32)  # none when R == D: p starts at D
        inv = 1.0 / tl.sqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1) + tl.sum(xp * xp, 1)) / D + eps)[:, None]
        x1 = _weighted(x1 * inv, w_ptr + f[None, :], f_ok[None, :], src_ptr, RNE).to(tl.float32)
        x2 = _weighted(x2 * inv, w_ptr + HALF + f[None, :], f_ok[None, :], src_ptr, RNE).to(tl.float32)
        xp = _weighted(xp * inv, w_ptr + p, p < D, src_ptr, RNE).to(tl.float32)
    y1 = x1 * cos - x2 * sin
    y2 = x2 * cos + x1 * sin
    if RNE:
        y1 = round_bf16(y1)
        y2 = round_bf16(y2)
    ok = ok & ((h * 0 + dst_row) >= 0)  # the row test broadcast: the interpreter rejects scalar masks
    y1 = y1.to(src_ptr.dtype.element_ty).to(dst_ptr.dtype.element_ty)
    y2 = y2.to(src_ptr.dtype.element_ty).to(dst_ptr.dtype.element_ty)
    tl.store(dst + f[None, :], y1, mask=ok)
    tl.store(dst + HALF + f[None, :], y2, mask=ok)
    if R < D:
        p_ok = p_in & ((h * 0 + dst_row) >= 0)
        if HAS_NORM:
            tl.store(dst + p, xp.to(src_ptr.dtype.element_ty).to(dst_ptr.dtype.element_ty), mask=p_ok)
        else:
            tl.store(dst + p, tl.load(src + p, mask=p_ok).to(dst_ptr.dtype.element_ty), mask=p_ok)


@triton.jit
def _cos_sin_row(cos_sin_ptr, pos_ptr, t, R: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Token t's cos and sin rows [1, BLOCK_HALF] (fp32), their feature offsets and which are real."""
    HALF: tl.constexpr = R // 2
    pos = tl.load(pos_ptr + t).to(tl.int64)
    f = tl.arange(0, BLOCK_HALF)
    f_ok = f < HALF
    cos = tl.load(cos_sin_ptr + pos * R + f, mask=f_ok, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(cos_sin_ptr + pos * R + HALF + f, mask=f_ok, other=0.0).to(tl.float32)[None, :]
    return cos, sin, f, f_ok


@triton.jit
def _rope_kernel(
    q_ptr,  # [T, HQ, D] (D contiguous)
    k_ptr,  # [T, HK, D] (D contiguous)
    q_out_ptr,  # [T, HQ, D] contiguous
    k_out_ptr,  # [T, HK, D] contiguous
    pos_ptr,  # [T] int
    cos_sin_ptr,  # [max_pos, R] contiguous
    stride_qt, stride_qh, stride_kt, stride_kh,
    HQ: tl.constexpr, HK: tl.constexpr, D: tl.constexpr, R: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr,
    RNE: tl.constexpr,
):
    """q and k of token t in one program: one launch (a graph node) per layer, not two; the cos/sin row read once."""
    t = tl.program_id(0).to(tl.int64)
    cos, sin, f, f_ok = _cos_sin_row(cos_sin_ptr, pos_ptr, t, R, BLOCK_HALF)
    _rotate_heads(q_ptr, q_out_ptr, stride_qt, stride_qh, t, t, cos, sin, f, f_ok, q_ptr, 0.0, HQ, D, R, BLOCK_HQ,
                  BLOCK_PASS, RNE, False)
    _rotate_heads(k_ptr, k_out_ptr, stride_kt, stride_kh, t, t, cos, sin, f, f_ok, k_ptr, 0.0, HK, D, R, BLOCK_HK,
                  BLOCK_PASS, RNE, False)


def apply_rope_triton(q, k, positions, cos_sin):
    assert positions.shape == (q.shape[0],) and k.shape[0] == q.shape[0] and positions.is_contiguous()
    assert q.shape[2] == k.shape[2] and q.device == k.device == cos_sin.device == positions.device
    assert q.dtype == k.dtype, (q.dtype, k.dtype)
    T, HQ, D = q.shape
    HK = k.shape[1]
    R = cos_sin.shape[1]
    assert q.stride(2) == 1 and k.stride(2) == 1 and R % 2 == 0 and R <= D and cos_sin.is_contiguous(), \
        (q.stride(), k.stride(), cos_sin.shape)
    q_out = torch.empty((T, HQ, D), dtype=q.dtype, device=q.device)
    k_out = torch.empty((T, HK, D), dtype=k.dtype, device=k.device)
    if T:
        launch(
            _rope_kernel, (T,), q, k, q_out, k_out, positions, cos_sin,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            HQ=HQ, HK=HK, D=D, R=R, BLOCK_HQ=next_pow2(HQ), BLOCK_HK=next_pow2(HK),
            BLOCK_HALF=next_pow2(R // 2), BLOCK_PASS=next_pow2(max(D - R, 1)), RNE=interpreter_bf16(q),
        )
    return q_out, k_out


# ------------------------------------------------------------------------------- rotary + KV store, fused


@triton.jit
def _rope_store_kernel(
    q_ptr,  # [T, HQ, D] (D contiguous)
    k_ptr,  # [T, HK, D] (D contiguous)
    v_ptr,  # [T, HK, D] (D contiguous)
    q_out_ptr,  # [T, HQ, D] contiguous
    k_cache_ptr,  # [N, S, HK, D] contiguous
    v_cache_ptr,  # [N, S, HK, D] contiguous
    slot_ptr,  # [T] int64, -1 = padding (nothing stored)
    pos_ptr,  # [T] int
    cos_sin_ptr,  # [max_pos, R] contiguous
    qw_ptr, kw_ptr,  # [D] q/k norm weights (read when HAS_NORM)
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, eps,
    HQ: tl.constexpr, HK: tl.constexpr, D: tl.constexpr, R: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr,
    BLOCK_D: tl.constexpr, RNE: tl.constexpr, HAS_NORM: tl.constexpr,
):
    """Token t: q rotated into q_out, k rotated and v copied into the caches at its slot (with HAS_NORM q and k each
    RMS-normed per head first: Qwen3). One launch (a graph node) per layer where rotary embedding and the KV store
    were two (and the q/k norms two more, with their copies out of the strided qkv); the rotated k is never written
    anywhere else."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t)
    cos, sin, f, f_ok = _cos_sin_row(cos_sin_ptr, pos_ptr, t, R, BLOCK_HALF)
    _rotate_heads(q_ptr, q_out_ptr, stride_qt, stride_qh, t, t, cos, sin, f, f_ok, qw_ptr, eps, HQ, D, R, BLOCK_HQ,
                  BLOCK_PASS, RNE, HAS_NORM)
    _rotate_heads(k_ptr, k_cache_ptr, stride_kt, stride_kh, t, slot, cos, sin, f, f_ok, kw_ptr, eps, HK, D, R,
                  BLOCK_HK, BLOCK_PASS, RNE, HAS_NORM)
    store_row(v_ptr, stride_vt, stride_vh, t, v_cache_ptr, slot, HK, D, BLOCK_HK, BLOCK_D)


def rope_store_kv_ref(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping, qk_norm=None):
    """rms_norm_ref of q and k per head (qk_norm), apply_rope_ref, then store_kv_ref of the rotated k and v: what the
    fused kernel computes."""
    if qk_norm is not None:
        q_weight, k_weight, eps = qk_norm
        q, k = rms_norm_ref(q, q_weight, eps), rms_norm_ref(k, k_weight, eps)
    q, k = apply_rope_ref(q, k, positions, cos_sin)
    store_kv_ref(k, v, k_cache, v_cache, slot_mapping)
    return q


def rope_store_kv_triton(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping, qk_norm=None):
    check_cache(k_cache, v_cache)
    T, HQ, D = q.shape
    HK = k.shape[1]
    R = cos_sin.shape[1]
    assert k.shape == v.shape == (T, HK, D) and k_cache.shape[2:] == (HK, D), (q.shape, k.shape, k_cache.shape)
    assert q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1 and q.dtype == k.dtype
    assert positions.shape == (T,) and positions.is_contiguous() and cos_sin.is_contiguous()
    assert slot_mapping.shape == (T,) and slot_mapping.dtype == torch.int64 and R % 2 == 0 and R <= D
    q_weight, k_weight, eps = qk_norm if qk_norm is not None else (q, k, 0.0)
    if qk_norm is not None:
        assert q_weight.shape == k_weight.shape == (D,) and q_weight.is_contiguous() and k_weight.is_contiguous()
    q_out = torch.empty((T, HQ, D), dtype=q.dtype, device=q.device)
    if T:
        launch(
            _rope_store_kernel, (T,), q, k, v, q_out, k_cache, v_cache, slot_mapping, positions, cos_sin,
            q_weight, k_weight, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), eps,
            HQ=HQ, HK=HK, D=D, R=R, BLOCK_HQ=next_pow2(HQ), BLOCK_HK=next_pow2(HK), BLOCK_HALF=next_pow2(R // 2),
            BLOCK_PASS=next_pow2(max(D - R, 1)), BLOCK_D=next_pow2(D), RNE=interpreter_bf16(q),
            HAS_NORM=qk_norm is not None,
        )
    return q_out


def rope_store_kv(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping, qk_norm=None):
    """Rotate q `[T, Hq, D]` and k `[T, Hkv, D]` by their positions, and write the rotated k and v `[T, Hkv, D]`
    into the paged caches at `slot_mapping` (-1: skipped) -> the rotated q. qk_norm (q weight [D], k weight [D],
    eps): q and k RMS-normed per head first (Qwen3), in the same launch. (The engine's reference path norms, rotates
    and stores apart, with tables and a store plan made once per step: engine/layers/attention.py.)"""
    if use_triton(q):
        return rope_store_kv_triton(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping, qk_norm)
    return rope_store_kv_ref(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping, qk_norm)


def apply_rope(q, k, positions, cos_sin, rows=None):
    """Rotate q `[T, Hq, D]` and k `[T, Hkv, D]` by their token positions; returns new (q, k).
    `rows`: rope_rows(positions, cos_sin) gathered once for every layer of a forward (reference path)."""
    if use_triton(q):
        return apply_rope_triton(q, k, positions, cos_sin)
    return apply_rope_ref(q, k, positions, cos_sin, rows)
