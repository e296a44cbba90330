"""Triton kernels behind kernels/mla_attention.py: latent cache writes and varlen latent paged attention.

Every head attends over the same cached rows (one latent "KV head"), so one program owns a tile of
BLOCK_M query rows where row r is token `r // HB` of the tile and head `head_block * HB + r % HB`: a
decode step's heads fill the tile and each cached tile is loaded once for all of them. The score of a
row is q_latent . c + q_rope . k_rope; the value is the latent itself, so the output is in latent space
(the caller folds W_UV in afterwards). Split-KV partial results are combined by the paged attention's
combine kernel (kernels/_attention_triton.py), which is generic over the head dim.
"""
from dataclasses import dataclass

import triton
import triton.language as tl

from kernels._dispatch import next_pow2


@triton.jit
def store_latent_kernel(
    latent_ptr,  # [T, L] (L contiguous)
    rope_ptr,  # [T, R] (R contiguous)
    cache_ptr,  # [N, S, L + R] contiguous
    slot_ptr,  # [T] int64, -1 = padding
    stride_lt, stride_rt,
    LATENT: tl.constexpr, ROPE: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t)
    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    # The slot test is broadcast to a tensor first: the interpreter rejects tensor & scalar masks.
    l_ok = (offs_l < LATENT) & ((offs_l * 0 + slot) >= 0)
    r_ok = (offs_r < ROPE) & ((offs_r * 0 + slot) >= 0)
    c = tl.load(latent_ptr + t * stride_lt + offs_l, mask=l_ok)
    k = tl.load(rope_ptr + t * stride_rt + offs_r, mask=r_ok)
    row = cache_ptr + slot * (LATENT + ROPE)
    tl.store(row + offs_l, c.to(cache_ptr.dtype.element_ty), mask=l_ok)
    tl.store(row + LATENT + offs_r, k.to(cache_ptr.dtype.element_ty), mask=r_ok)


# Scalars that change with the batch are not specialized (one compiled kernel per value class otherwise).
@triton.jit(do_not_specialize=["stride_bt", "stride_os", "stride_ot", "stride_ls", "split_len", "num_splits"])
def mla_attention_kernel(
    q_lat_ptr,  # [T, H, L] (L contiguous)
    q_rope_ptr,  # [T, H, R] (R contiguous)
    cache_ptr,  # [N, PAGE, L + R] contiguous: latent then rope key per token
    block_tables_ptr,  # [B, max_blocks] int32
    seq_lens_ptr,  # [B] int32
    query_start_loc_ptr,  # [B+1] int32
    o_ptr,  # not SPLIT: out [T, H, L]; else partial outputs [num_splits, T, H, L] fp32
    lse_ptr,  # [num_splits, T, H] fp32 log2-sum-exp2 of each split (unused unless SPLIT)
    tree_ptr,  # [T] int64 tree masks (kernels/tree_mask.py): bit w admits KV position seq_len - 64 + w; if TREE
    scale_log2,  # softmax scale * log2(e)
    stride_qt, stride_qh, stride_rt, stride_rh,
    stride_cn, stride_cs,
    stride_bt,
    stride_os, stride_ot, stride_oh,
    stride_ls, stride_lt,
    split_len,  # KV positions per split, a multiple of BLOCK_N
    num_splits,
    H: tl.constexpr, HB: tl.constexpr, PAGE: tl.constexpr, LATENT: tl.constexpr, ROPE: tl.constexpr,
    BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, FP32_DOT: tl.constexpr, TREE: tl.constexpr = False,
):
    TOKENS: tl.constexpr = BLOCK_M // HB
    HEAD_BLOCKS: tl.constexpr = (H + HB - 1) // HB
    q_block = tl.program_id(0)
    b = tl.program_id(1)
    head_block = tl.program_id(2) % HEAD_BLOCKS
    split = tl.program_id(2) // HEAD_BLOCKS

    q_start = tl.load(query_start_loc_ptr + b).to(tl.int64)
    q_len = tl.load(query_start_loc_ptr + b + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + b)
    ctx = seq_len - q_len

    r = tl.arange(0, BLOCK_M)
    tok = q_block * TOKENS + r // HB  # token index within the request
    head = head_block * HB + r % HB
    row_ok = (r < TOKENS * HB) & (tok < q_len) & (head < H)
    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    l_ok = offs_l < LATENT
    r_ok = offs_r < ROPE

    q_row = q_start + tok
    q_lat = tl.load(q_lat_ptr + (q_row * stride_qt + head * stride_qh)[:, None] + offs_l[None, :],
                    mask=row_ok[:, None] & l_ok[None, :], other=0.0)
    q_rope = tl.load(q_rope_ptr + (q_row * stride_rt + head * stride_rh)[:, None] + offs_r[None, :],
                     mask=row_ok[:, None] & r_ok[None, :], other=0.0)
    if FP32_DOT:
        q_lat = q_lat.to(tl.float32)
        q_rope = q_rope.to(tl.float32)

    first_tok = q_block * TOKENS
    kv_end = tl.where(first_tok < q_len, ctx + tl.minimum(q_len, first_tok + TOKENS), 0)
    kv_lo = split * split_len
    kv_hi = tl.minimum(kv_end, kv_lo + split_len)
    q_pos = ctx + tok
    if TREE:  # as in paged_attention_kernel: 32-bit halves, a column's bit tested by an AND (no tile of shifts)
        tree_bits = tl.load(tree_ptr + q_row, mask=row_ok, other=-1)  # [BLOCK_M] int64, one per row's token
        tree_lo = (tree_bits & 0xFFFFFFFF).to(tl.int32)
        tree_hi = (tree_bits >> 32).to(tl.int32)
        window = seq_len - 64  # the positions the bits speak of start here

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_L], tl.float32)
    bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
    for start in range(kv_lo, kv_hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        pos_ok = pos < kv_hi
        blk = tl.load(bt_row + pos // PAGE, mask=pos_ok, other=0).to(tl.int64)
        row = cache_ptr + blk * stride_cn + (pos % PAGE) * stride_cs
        c = tl.load(row[:, None] + offs_l[None, :], mask=pos_ok[:, None] & l_ok[None, :], other=0.0)
        kr = tl.load(row[:, None] + LATENT + offs_r[None, :], mask=pos_ok[:, None] & r_ok[None, :], other=0.0)
        if FP32_DOT:
            c = c.to(tl.float32)
            kr = kr.to(tl.float32)
            s = tl.dot(q_lat, tl.trans(c), input_precision="ieee")
            s += tl.dot(q_rope, tl.trans(kr), input_precision="ieee")
        else:
            s = tl.dot(q_lat, tl.trans(c))
            s += tl.dot(q_rope, tl.trans(kr))
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
            pv = tl.dot(p, c, input_precision="ieee")
        else:
            pv = tl.dot(p.to(c.dtype), c)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_safe[:, None]
    out_rows = split * stride_os + q_row * stride_ot + head * stride_oh
    tl.store(o_ptr + out_rows[:, None] + offs_l[None, :], o.to(o_ptr.dtype.element_ty),
             mask=row_ok[:, None] & l_ok[None, :])
    if SPLIT:
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
        tl.store(lse_ptr + split * stride_ls + q_row * stride_lt + head, lse, mask=row_ok)


@dataclass(frozen=True, slots=True)
class MLATiles:
    block_m: int  # query rows per program (tokens x heads of the tile)
    block_n: int  # cached positions per inner step
    heads_per_tile: int
    tokens_per_block: int
    num_warps: int


def mla_config(num_heads: int, max_q_len: int, latent: int, fp32_dot: bool, gpu: bool) -> MLATiles:
    """Tiles of mla_attention_kernel. The fp32 accumulator is BLOCK_M x latent (512 for DeepSeek-V3), so
    tiles stay small on GPUs: 32 rows (16 with IEEE fp32 dots, which hold whole operand tiles in registers)
    over 8 warps. Off a GPU (the interpreter) larger tiles only mean fewer interpreted iterations."""
    if gpu:
        rows = 16 if fp32_dot or latent > 512 else 32
        block_n, warps = 32, 8
    else:
        rows, block_n, warps = 32, 32, 4
    rows = max(16, min(rows, next_pow2(num_heads * max(1, max_q_len))))
    heads = min(num_heads, rows)
    return MLATiles(block_m=rows, block_n=block_n, heads_per_tile=heads, tokens_per_block=rows // heads,
                     num_warps=warps)
