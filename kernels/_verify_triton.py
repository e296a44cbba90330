"""Triton kernels behind kernels/verify.py.

Both verifiers split the vocabulary into chunks so a small batch still spreads over the device:
stage 1 (grid [rows, chunks]) reduces each chunk to a (value, first index) pair, stage 2 (grid [B])
combines the chunks, runs the sequential acceptance scan and writes the fixed-shape outputs.
Ties resolve to the lowest index everywhere, as torch.argmax does.
"""
import torch
import triton
import triton.language as tl

from kernels import rng
from kernels._dispatch import next_pow2
from kernels._launch import launch, on_gpu
from kernels._rng_triton import hash_key, stream_salt, uniform

INT_MAX = 2**31 - 1


def _chunking(V: int, gpu: bool, chunk: int | None) -> tuple[int, int, int]:
    """(CHUNK, BLOCK, num_chunks); CHUNK is a power of two and a multiple of BLOCK."""
    if chunk is None:
        chunk = 8192 if gpu else 4096
    chunk = next_pow2(min(chunk, max(V, 1)))
    block = min(chunk, 1024)
    return chunk, block, triton.cdiv(V, chunk)


@triton.jit
def _first_max(vals, idxs):
    """Max of vals and the lowest idx that attains it."""
    m = tl.max(vals, 0)
    return m, tl.min(tl.where(vals == m, idxs, 2147483647), 0)


# ------------------------------------------------------------------------------------------- greedy


# Scalars that change with k or the batch are not specialized (== 1 and divisible-by-16 variants would
# each compile another kernel on a GPU).
@triton.jit(do_not_specialize=["stride_b", "k1"])
def _argmax_partial_kernel(
    logits_ptr,  # [B, K+1, V]
    val_ptr,  # [B * (K+1), C] fp32
    idx_ptr,  # [B * (K+1), C] int32
    stride_b, stride_j, V, C,
    k1,  # K+1, a runtime value: only the row split needs it, and each k would compile a kernel otherwise
    CHUNK: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    c = tl.program_id(1)
    base = logits_ptr + (row // k1).to(tl.int64) * stride_b + (row % k1) * stride_j
    lo = c * CHUNK
    hi = tl.minimum(V, lo + CHUNK)
    best = tl.full([], float("-inf"), tl.float32)
    best_i = lo
    for start in range(lo, hi, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < hi, other=float("-inf")).to(tl.float32)
        m = tl.max(x, 0)
        i = start + tl.argmax(x, 0)
        take = m > best
        best = tl.where(take, m, best)
        best_i = tl.where(take, i, best_i)
    tl.store(val_ptr + row * C + c, best)
    tl.store(idx_ptr + row * C + c, best_i)


@triton.jit(do_not_specialize=["stride_d"])
def _greedy_finalize_kernel(
    val_ptr,  # [B * (K+1), C] fp32
    idx_ptr,  # [B * (K+1), C] int32
    draft_ptr,  # [B, K] int64
    out_ptr,  # [B, K+1] int64
    accepted_ptr,  # [B] int32
    stride_d, C,
    K: tl.constexpr, C_P2: tl.constexpr,
):
    b = tl.program_id(0)
    offs = tl.arange(0, C_P2)
    alive = tl.full([], 1, tl.int32)
    n = tl.zeros([], tl.int32)
    for j in tl.static_range(K + 1):
        row = b * (K + 1) + j
        v = tl.load(val_ptr + row * C + offs, mask=offs < C, other=float("-inf"))
        i = tl.load(idx_ptr + row * C + offs, mask=offs < C, other=2147483647)
        _, tok = _first_max(v, i)
        tl.store(out_ptr + b * (K + 1) + j, tl.where(alive != 0, tok.to(tl.int64), -1))
        if j < K:
            draft = tl.load(draft_ptr + b * stride_d + j)
            alive = tl.where(tok.to(tl.int64) == draft, alive, 0)
            n += alive
    tl.store(accepted_ptr + b, n)


def verify_greedy(target_logits, draft_token_ids, chunk=None):
    B, K1, V = target_logits.shape
    K = K1 - 1
    assert K >= 0 and draft_token_ids.shape == (B, K) and draft_token_ids.dtype == torch.int64
    assert target_logits.stride(2) == 1 and target_logits.is_floating_point()
    assert draft_token_ids.device == target_logits.device
    dev = target_logits.device
    out = torch.empty((B, K1), dtype=torch.int64, device=dev)
    accepted_len = torch.empty((B,), dtype=torch.int32, device=dev)
    if B == 0:
        return out, accepted_len
    CHUNK, BLOCK, C = _chunking(V, on_gpu(target_logits), chunk)
    vals = torch.empty((B * K1, C), dtype=torch.float32, device=dev)
    idxs = torch.empty((B * K1, C), dtype=torch.int32, device=dev)
    launch(
        _argmax_partial_kernel, (B * K1, C),
        target_logits, vals, idxs, target_logits.stride(0), target_logits.stride(1), V, C, K1,
        CHUNK=CHUNK, BLOCK=BLOCK,
    )
    drafts = draft_token_ids.contiguous() if K else out  # never read when K == 0
    launch(
        _greedy_finalize_kernel, (B,), vals, idxs, drafts, out, accepted_len, max(K, 1), C, K=K, C_P2=next_pow2(C),
    )
    return out, accepted_len


# ----------------------------------------------------------------------------- rejection sampling


@triton.jit
def _accept_scan(p_ptr, q_ptr, draft_ptr, b, seed, pos0, stride_pb, stride_pj, stride_qb, stride_qj, stride_d,
                 K: tl.constexpr, HAS_Q: tl.constexpr, SALT_ACCEPT: tl.constexpr):
    """Number of leading drafts that pass u * q(x) < p(x)."""
    alive = tl.full([], 1, tl.int32)
    n = tl.zeros([], tl.int32)
    for j in tl.static_range(K):
        x = tl.load(draft_ptr + b * stride_d + j)
        px = tl.load(p_ptr + b * stride_pb + j * stride_pj + x)
        if HAS_Q:
            qx = tl.load(q_ptr + b * stride_qb + j * stride_qj + x)
        else:
            qx = 1.0
        u = uniform(hash_key(seed, pos0 + j, SALT_ACCEPT), tl.zeros([], tl.int32))
        alive = tl.where(u * qx < px, alive, 0)
        n += alive
    return n


@triton.jit(do_not_specialize=["stride_pb", "stride_qb", "stride_qj", "stride_d", "B"])
def _rejection_partial_kernel(
    p_ptr,  # [B, K+1, V] fp32
    q_ptr,  # [B, K, V] fp32 (read when HAS_Q)
    draft_ptr,  # [B, K] int64
    seed_ptr,  # [B] int64
    pos_ptr,  # [B] int64
    part_ptr,  # [5, B, C] fp32 view: residual value/index, any-positive, p value/index
    stride_pb, stride_pj, stride_qb, stride_qj, stride_d, V, C, B,
    K: tl.constexpr, HAS_Q: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
    SALT_ACCEPT: tl.constexpr, SALT_RESIDUAL: tl.constexpr, SALT_SAMPLE: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    seed = tl.load(seed_ptr + b)
    pos0 = tl.load(pos_ptr + b)
    n = _accept_scan(p_ptr, q_ptr, draft_ptr, b, seed, pos0, stride_pb, stride_pj, stride_qb, stride_qj,
                     stride_d, K, HAS_Q, SALT_ACCEPT)
    rejected = n < K
    key = tl.where(rejected, hash_key(seed, pos0 + n, SALT_RESIDUAL), hash_key(seed, pos0 + n, SALT_SAMPLE))
    p_row = p_ptr + b * stride_pb + n * stride_pj
    n_q = tl.minimum(n, K - 1)  # the rejected draft's row (unused when all are accepted)
    if K > 0:
        x_n = tl.load(draft_ptr + b * stride_d + n_q)
    else:
        x_n = -1
    lo = c * CHUNK
    hi = tl.minimum(V, lo + CHUNK)
    best_r = tl.full([], -1.0, tl.float32)
    best_p = tl.full([], -1.0, tl.float32)
    idx_r = lo
    idx_p = lo
    any_pos = tl.zeros([], tl.float32)
    for start in range(lo, hi, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        ok = cols < hi
        pv = tl.load(p_row + cols, mask=ok, other=0.0)
        if HAS_Q:
            qv = tl.load(q_ptr + b * stride_qb + n_q * stride_qj + cols, mask=ok & ((cols * 0 + n) < K), other=0.0)
            r = tl.maximum(pv - qv, 0.0)
        else:
            r = tl.where(cols == x_n, 0.0, pv)
        r = tl.where(rejected, r, pv)
        noise = -tl.log(uniform(key, cols))
        vr = tl.where(ok, r / noise, -1.0)
        vp = tl.where(ok, pv / noise, -1.0)
        m, i = _first_max(vr, cols)
        idx_r = tl.where(m > best_r, i, idx_r)
        best_r = tl.maximum(best_r, m)
        m, i = _first_max(vp, cols)
        idx_p = tl.where(m > best_p, i, idx_p)
        best_p = tl.maximum(best_p, m)
        any_pos = tl.maximum(any_pos, tl.max(tl.where(r > 0.0, 1.0, 0.0), 0))
    slot = b * C + c
    plane = B * C
    tl.store(part_ptr + slot, best_r)
    tl.store(part_ptr + plane + slot, idx_r.to(tl.float32))  # indices < 2**24 are exact in fp32
    tl.store(part_ptr + 2 * plane + slot, any_pos)
    tl.store(part_ptr + 3 * plane + slot, best_p)
    tl.store(part_ptr + 4 * plane + slot, idx_p.to(tl.float32))


@triton.jit(do_not_specialize=["stride_pb", "stride_qb", "stride_qj", "stride_d", "B"])
def _rejection_finalize_kernel(
    p_ptr, q_ptr, draft_ptr, seed_ptr, pos_ptr,  # as in _rejection_partial_kernel
    part_ptr,  # [5, B, C] fp32
    out_ptr,  # [B, K+1] int64
    accepted_ptr,  # [B] int32
    stride_pb, stride_pj, stride_qb, stride_qj, stride_d, C, B,
    K: tl.constexpr, HAS_Q: tl.constexpr, C_P2: tl.constexpr, SALT_ACCEPT: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    seed = tl.load(seed_ptr + b)
    pos0 = tl.load(pos_ptr + b)
    n = _accept_scan(p_ptr, q_ptr, draft_ptr, b, seed, pos0, stride_pb, stride_pj, stride_qb, stride_qj,
                     stride_d, K, HAS_Q, SALT_ACCEPT)
    offs = tl.arange(0, C_P2)
    ok = offs < C
    plane = B * C
    row = part_ptr + b * C + offs
    _, tok_r = _first_max(tl.load(row, mask=ok, other=-2.0), tl.load(row + plane, mask=ok, other=2.0**30).to(tl.int32))
    any_pos = tl.max(tl.load(row + 2 * plane, mask=ok, other=0.0), 0)
    _, tok_p = _first_max(tl.load(row + 3 * plane, mask=ok, other=-2.0),
                          tl.load(row + 4 * plane, mask=ok, other=2.0**30).to(tl.int32))
    tok = tl.where(any_pos > 0.0, tok_r, tok_p).to(tl.int64)
    for j in tl.static_range(K + 1):
        if j < K:
            draft = tl.load(draft_ptr + b * stride_d + j)
        else:
            draft = tl.full([], -1, tl.int64)
        val = tl.where(j < n, draft, tl.where(j == n, tok, -1))
        tl.store(out_ptr + b * (K + 1) + j, val)
    tl.store(accepted_ptr + b, n)


def rejection_from_probs(p, draft_token_ids, draft_probs, seeds, positions, chunk=None):
    B, K1, V = p.shape
    K = K1 - 1
    dev = p.device
    assert p.dtype == torch.float32 and p.stride(2) == 1, (p.dtype, p.stride())
    assert draft_token_ids.shape == (B, K) and draft_token_ids.dtype == torch.int64
    assert seeds.shape == (B,) and seeds.dtype == torch.int64 and positions.shape == (B,)
    assert positions.dtype == torch.int64
    assert V < 2**24, "chunk indices travel as fp32"
    has_q = draft_probs is not None and K > 0
    if has_q:
        assert draft_probs.shape == (B, K, V) and draft_probs.dtype == torch.float32
        assert draft_probs.stride(2) == 1
    out = torch.empty((B, K1), dtype=torch.int64, device=dev)
    accepted_len = torch.empty((B,), dtype=torch.int32, device=dev)
    if B == 0:
        return out, accepted_len
    CHUNK, BLOCK, C = _chunking(V, on_gpu(p), chunk)
    parts = torch.empty((5, B, C), dtype=torch.float32, device=dev)
    drafts = draft_token_ids.contiguous() if K else seeds  # never read when K == 0
    q = draft_probs if has_q else p
    qs = (q.stride(0), q.stride(1)) if has_q else (0, 0)
    seeds, positions = seeds.contiguous(), positions.contiguous()
    common = (p.stride(0), p.stride(1), qs[0], qs[1], max(K, 1))
    launch(
        _rejection_partial_kernel, (B, C), p, q, drafts, seeds, positions, parts, *common, V, C, B,
        K=K, HAS_Q=has_q, CHUNK=CHUNK, BLOCK=BLOCK, SALT_ACCEPT=stream_salt(rng.STREAM_ACCEPT),
        SALT_RESIDUAL=stream_salt(rng.STREAM_RESIDUAL), SALT_SAMPLE=stream_salt(rng.STREAM_SAMPLE),
    )
    launch(
        _rejection_finalize_kernel, (B,), p, q, drafts, seeds, positions, parts, out, accepted_len, *common, C, B,
        K=K, HAS_Q=has_q, C_P2=next_pow2(C), SALT_ACCEPT=stream_salt(rng.STREAM_ACCEPT),
    )
    return out, accepted_len
