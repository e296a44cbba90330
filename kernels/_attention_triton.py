"""Triton kernels behind kernels/attention.py: KV slot writes, varlen paged attention, split combine.

GQA packing: one program owns one KV head and a tile of BLOCK_M query rows, where row r is token
`r // G` of the tile and query head `kv_head * G + r % G`. A decode step (one token, G heads) then
fills a tile with real rows instead of padding each head to 16 rows, and each K/V tile is loaded
once for all G heads that share it.
"""
from dataclasses import dataclass

import triton
import triton.language as tl

from kernels._dispatch import next_pow2


@triton.jit
def store_row(src_ptr, stride_t, stride_h, t, cache_ptr, slot,
              H: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """Token t's H heads of src written into a paged cache ([N, S, H, D] contiguous) at `slot` (-1: skipped), in the
    cache's dtype: the KV store's row write, shared with the rotary-fused store (kernels/norm_rope.py)."""
    offs_h = tl.arange(0, BLOCK_H)[:, None]
    offs_d = tl.arange(0, BLOCK_D)[None, :]
    # The slot test is broadcast to a tensor first: the interpreter rejects tensor & scalar masks.
    mask = (offs_h < H) & (offs_d < D) & ((offs_h * 0 + slot) >= 0)
    x = tl.load(src_ptr + t * stride_t + offs_h * stride_h + offs_d, mask=mask)
    tl.store(cache_ptr + slot * (H * D) + offs_h * D + offs_d, x.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def store_kv_kernel(
    key_ptr,  # [T, H, D] (D contiguous)
    value_ptr,  # [T, H, D] (D contiguous)
    k_cache_ptr,  # [N, S, H, D] contiguous
    v_cache_ptr,  # [N, S, H, D] contiguous
    slot_ptr,  # [T] int64, -1 = padding
    stride_kt, stride_kh, stride_vt, stride_vh,
    H: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t)
    store_row(key_ptr, stride_kt, stride_kh, t, k_cache_ptr, slot, H, D, BLOCK_H, BLOCK_D)
    store_row(value_ptr, stride_vt, stride_vh, t, v_cache_ptr, slot, H, D, BLOCK_H, BLOCK_D)


# Scalars that change with the batch (sizes, split counts, strides over T) are not specialized: each value
# class (== 1, divisible by 16) would otherwise compile another kernel on a GPU, e.g. during graph capture.
@triton.jit(do_not_specialize=["stride_bt", "stride_os", "stride_ot", "stride_ls", "split_len", "num_splits"])
def paged_attention_kernel(
    q_ptr,  # [T, Hq, D]
    k_cache_ptr,  # [N, PAGE, Hkv, D] contiguous
    v_cache_ptr,  # [N, PAGE, Hkv, D] contiguous, same strides as k_cache
    block_tables_ptr,  # [B, max_blocks] int32
    seq_lens_ptr,  # [B] int32
    query_start_loc_ptr,  # [B+1] int32
    o_ptr,  # not SPLIT: out [T, Hq, D]; else partial outputs [num_splits, T, Hq, D] fp32
    lse_ptr,  # [num_splits, T, Hq] fp32 log2-sum-exp2 of each split (unused unless SPLIT)
    tree_ptr,  # [T] int64 tree masks (kernels/tree_mask.py): bit w admits KV position seq_len - 64 + w; if TREE
    scale_log2,  # softmax scale * log2(e)
    stride_qt, stride_qh,
    stride_kn, stride_ks, stride_kh,
    stride_bt,
    stride_os, stride_ot, stride_oh,
    stride_ls, stride_lt,
    split_len,  # KV positions per split, a multiple of BLOCK_N
    num_splits,  # a runtime value: a constexpr would compile one kernel per split count
    G: tl.constexpr, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, FP32_DOT: tl.constexpr,
    TREE: tl.constexpr = False,
):
    TOKENS: tl.constexpr = BLOCK_M // G
    q_block = tl.program_id(0)
    b = tl.program_id(1)
    kv_head = tl.program_id(2) // num_splits
    split = tl.program_id(2) % num_splits

    q_start = tl.load(query_start_loc_ptr + b).to(tl.int64)
    q_len = tl.load(query_start_loc_ptr + b + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + b)
    ctx = seq_len - q_len

    r = tl.arange(0, BLOCK_M)
    tok = q_block * TOKENS + r // G  # token index within the request
    head = kv_head * G + r % G
    row_ok = (r < TOKENS * G) & (tok < q_len)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM

    q_rows = (q_start + tok) * stride_qt + head * stride_qh
    q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if FP32_DOT:
        q = q.to(tl.float32)

    # KV this tile needs: up to its last token's causal position, intersected with this split.
    first_tok = q_block * TOKENS
    kv_end = tl.where(first_tok < q_len, ctx + tl.minimum(q_len, first_tok + TOKENS), 0)
    kv_lo = split * split_len
    kv_hi = tl.minimum(kv_end, kv_lo + split_len)
    q_pos = ctx + tok
    if TREE:
        tree_bits = tl.load(tree_ptr + q_start + tok, mask=row_ok, other=-1)  # [BLOCK_M] int64
        # 32-bit halves, each column's bit tested by an AND with a per-column mask: [BLOCK_M, BLOCK_N] tiles of
        # variable shifts (of the int64, or of the halves) spilled 4 B on sm_90/sm_100 (G=3 16-bit split-KV).
        tree_lo = (tree_bits & 0xFFFFFFFF).to(tl.int32)
        tree_hi = (tree_bits >> 32).to(tl.int32)
        window = seq_len - 64  # the positions the bits speak of start here

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
    for start in range(kv_lo, kv_hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        pos_ok = pos < kv_hi
        blk = tl.load(bt_row + pos // PAGE, mask=pos_ok, other=0).to(tl.int64)
        kv_off = blk * stride_kn + (pos % PAGE) * stride_ks + kv_head * stride_kh
        kv_mask = pos_ok[:, None] & d_ok[None, :]
        k = tl.load(k_cache_ptr + kv_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if FP32_DOT:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        allowed = pos_ok[None, :] & (pos[None, :] <= q_pos[:, None])
        if TREE:  # inside the last 64 positions a row sees only what its bit admits (its tree ancestors)
            w = pos - window  # [BLOCK_N]
            col_bit = 1 << (w & 31)  # [BLOCK_N] int32: each column's bit within its half
            half = tl.where((w < 32)[None, :], tree_lo[:, None], tree_hi[:, None])
            allowed = allowed & ((w < 0)[None, :] | ((half & col_bit[None, :]) != 0))
        s = tl.where(allowed, s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing yet stay at 0
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if FP32_DOT:
            pv = tl.dot(p, v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_safe[:, None]
    out_rows = split * stride_os + (q_start + tok) * stride_ot + head * stride_oh
    out_mask = row_ok[:, None] & d_ok[None, :]
    tl.store(o_ptr + out_rows[:, None] + offs_d[None, :], o.to(o_ptr.dtype.element_ty), mask=out_mask)
    if SPLIT:
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
        lse_rows = split * stride_ls + (q_start + tok) * stride_lt + head
        tl.store(lse_ptr + lse_rows, lse, mask=row_ok)


@triton.jit(do_not_specialize=["stride_ps", "stride_ls", "num_splits"])
def combine_splits_kernel(
    part_ptr,  # [num_splits, T, Hq, D] fp32
    lse_ptr,  # [num_splits, T, Hq] fp32, log2 domain, -inf for empty splits
    query_start_loc_ptr,  # [B+1] int32
    out_ptr,  # [T, Hq, D]
    stride_ps, stride_pt, stride_ph,
    stride_ls, stride_lt,
    stride_ot, stride_oh,
    num_splits,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS_P2: tl.constexpr,
):
    i = tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + b).to(tl.int64)
    q_len = tl.load(query_start_loc_ptr + b + 1) - q_start
    t = q_start + i
    offs_s = tl.arange(0, SPLITS_P2)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = (offs_s * 0 + i) < q_len  # [SPLITS_P2], all equal: is token i part of request b?
    s_ok = (offs_s < num_splits) & row_ok
    lse = tl.load(lse_ptr + offs_s * stride_ls + t * stride_lt + h, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))  # [SPLITS_P2], 0 for empty splits
    part_mask = s_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    part = tl.load(part_ptr + offs_s[:, None] * stride_ps + t * stride_pt + h * stride_ph + offs_d[None, :],
                   mask=part_mask, other=0.0)
    total = tl.sum(w, 0)
    o = tl.sum(part * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    out_mask = (offs_d < HEAD_DIM) & ((offs_d * 0 + i) < q_len)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty), mask=out_mask)


@dataclass(frozen=True, slots=True)
class AttentionConfig:
    block_m: int  # query rows per program (tokens * G, padded to a power of two)
    block_n: int  # KV positions per inner step
    tokens_per_block: int
    num_warps: int


def attention_config(G: int, max_q_len: int, head_dim: int, fp32_dot: bool, gpu: bool) -> AttentionConfig:
    """Tiles and warps of paged_attention_kernel. On GPUs the register budget decides (measured by
    kernels/compile_check.py, ptxas for sm_80/sm_90/sm_100): IEEE fp32 dots run on FMA units with whole
    operand tiles in registers, so they keep 16-row tiles and spread them over 8 warps (64-row tiles spilled
    kilobytes at every head dim); 64-row tiles of 128-wide heads take 8 warps too (on 4 warps they spilled
    on sm_80 in bf16 and fp16)."""
    rows = next_pow2(max(16, G))  # tl.dot needs >= 16 rows
    if max_q_len * G > rows and not (gpu and fp32_dot):
        rows = max(rows, 64)
    block_n = 64 if gpu else 32
    wide = rows >= 64 and head_dim > 64
    num_warps = 8 if gpu and (fp32_dot or wide) else 4
    return AttentionConfig(block_m=rows, block_n=block_n, tokens_per_block=rows // G, num_warps=num_warps)


def pick_num_splits(programs: int, max_seq_len: int, sm_count: int | None) -> int:
    """Split KV when the grid cannot fill the device and each split still gets >= 256 positions.
    sm_count: the GPU's multiprocessors (None off a GPU)."""
    target = 2 * sm_count if sm_count is not None else 4
    if programs >= target:
        return 1
    return max(1, min(-(-target // programs), max_seq_len // 256, 64))
