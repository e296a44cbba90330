"""Pack a request's KV blocks into one contiguous buffer for a hand-over, and unpack on arrival.

Both sides use the engine's cache layout `kv_cache [L, P, num_blocks, block_size, H, D]` (engine/layers/kv_spec.py:
P = 2 planes of K and V heads for the Llama family, P = 1 for MLA's latent row, one "head" of kv_lora_rank +
qk_rope_head_dim); the sender and receiver may have different num_blocks. Head slices let caches of different
tensor-parallel degrees exchange KV: a tp=1 prefill cache packs heads `head_start:head_end` for each tp=2 decode
rank (`pack_kv(..., head_start=r * H // 2, head_end=(r + 1) * H // 2)`), and a receiver whose cache holds more
heads than the buffer unpacks it at `head_start`. An MLA latent is never sliced: every rank gets it whole.
"""
import torch
import triton
import triton.language as tl

from kernels._dispatch import use_triton
from kernels._launch import launch

BLOCK = 2048  # elements per program


def _heads(kv_cache: torch.Tensor, head_start: int, head_end: int | None) -> tuple[int, int]:
    H = kv_cache.shape[4]
    head_end = H if head_end is None else head_end
    assert 0 <= head_start < head_end <= H, (head_start, head_end, H)
    return head_start, head_end


def pack_kv_ref(
    kv_cache: torch.Tensor,  # [L, P, N, S, H, D]
    block_ids: torch.Tensor,  # [n] int64
    out: torch.Tensor | None = None,  # [L, P, n, S, h1 - h0, D] contiguous
    head_start: int = 0,
    head_end: int | None = None,
) -> torch.Tensor:
    h0, h1 = _heads(kv_cache, head_start, head_end)
    src = kv_cache[:, :, :, :, h0:h1]
    if out is None:
        return src.index_select(2, block_ids)
    return torch.index_select(src, 2, block_ids, out=out)


def unpack_kv_ref(
    buffer: torch.Tensor,  # [L, P, n, S, h, D]
    kv_cache: torch.Tensor,  # [L, P, N, S, H, D], H >= head_start + h
    block_ids: torch.Tensor,  # [n] int64, distinct
    head_start: int = 0,
) -> None:
    h = buffer.shape[4]
    h0, h1 = _heads(kv_cache, head_start, head_start + h)
    kv_cache[:, :, :, :, h0:h1].index_copy_(2, block_ids, buffer.to(kv_cache.dtype))


# Per request and per rank (n, head_start), per model family (planes: 1 would otherwise be a constexpr): one
# compiled kernel for all of them.
@triton.jit(do_not_specialize=["n", "planes", "head_start"])
def _copy_blocks_kernel(
    src_ptr,  # PACK: cache [L, P, N, S, H, D]; else buffer [L, P, n, S, h, D]
    dst_ptr,  # PACK: buffer; else cache
    block_ids_ptr,  # [n] int64
    n,
    planes,  # P
    cache_s0, cache_s1, cache_s2, cache_s3, cache_s4,  # cache strides of L, P, N, S, H (D is 1)
    head_start,
    HEADS: tl.constexpr, D: tl.constexpr, BLOCK_SIZE: tl.constexpr, PACK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)  # over L * P * n blocks
    i = pid % n
    lk = pid // n
    layer = lk // planes
    kv = lk % planes
    block = tl.load(block_ids_ptr + i)
    e = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    numel = BLOCK_SIZE * HEADS * D
    ok = e < numel
    s = e // (HEADS * D)
    h = (e // D) % HEADS
    d = e % D
    cache_off = (layer.to(tl.int64) * cache_s0 + kv * cache_s1 + block * cache_s2 + s * cache_s3
                 + (head_start + h) * cache_s4 + d)
    buf_off = pid.to(tl.int64) * numel + e
    if PACK:
        x = tl.load(src_ptr + cache_off, mask=ok)
        tl.store(dst_ptr + buf_off, x.to(dst_ptr.dtype.element_ty), mask=ok)
    else:
        x = tl.load(src_ptr + buf_off, mask=ok)
        tl.store(dst_ptr + cache_off, x.to(dst_ptr.dtype.element_ty), mask=ok)


def _launch(src, dst, kv_cache, buffer, block_ids, head_start, pack):
    L, P, n, S, h, D = buffer.shape
    assert kv_cache.dim() == 6 and P in (1, 2) and kv_cache.shape[:2] == (L, P) and kv_cache.shape[3] == S
    assert kv_cache.shape[5] == D and kv_cache.stride(5) == 1 and buffer.is_contiguous()
    assert block_ids.shape == (n,) and block_ids.dtype == torch.int64 and block_ids.is_contiguous()
    assert kv_cache.device == buffer.device == block_ids.device
    if n == 0:
        return
    launch(
        _copy_blocks_kernel, (L * P * n, triton.cdiv(S * h * D, BLOCK)),
        src, dst, block_ids, n, P, *kv_cache.stride()[:5], head_start,
        HEADS=h, D=D, BLOCK_SIZE=S, PACK=pack, BLOCK=BLOCK,
    )


def pack_kv_triton(kv_cache, block_ids, out=None, head_start=0, head_end=None) -> torch.Tensor:
    h0, h1 = _heads(kv_cache, head_start, head_end)
    L, P, _, S, _, D = kv_cache.shape
    shape = (L, P, block_ids.shape[0], S, h1 - h0, D)
    if out is None:
        out = torch.empty(shape, dtype=kv_cache.dtype, device=kv_cache.device)
    assert out.shape == shape and out.dtype == kv_cache.dtype, (out.shape, shape)
    _launch(kv_cache, out, kv_cache, out, block_ids, h0, pack=True)
    return out


def unpack_kv_triton(buffer, kv_cache, block_ids, head_start=0) -> None:
    _heads(kv_cache, head_start, head_start + buffer.shape[4])
    _launch(buffer, kv_cache, kv_cache, buffer, block_ids, head_start, pack=False)


def pack_kv(kv_cache, block_ids, out=None, head_start=0, head_end=None) -> torch.Tensor:
    """Blocks `block_ids` of every layer and plane (heads head_start:head_end) as one contiguous buffer
    `[L, P, n, block_size, head_end - head_start, D]`."""
    fn = pack_kv_triton if use_triton(kv_cache) else pack_kv_ref
    return fn(kv_cache, block_ids, out, head_start, head_end)


def unpack_kv(buffer, kv_cache, block_ids, head_start=0) -> None:
    """Scatter a packed buffer into `kv_cache` blocks `block_ids` (heads from head_start). In place."""
    fn = unpack_kv_triton if use_triton(kv_cache) else unpack_kv_ref
    fn(buffer, kv_cache, block_ids, head_start)
