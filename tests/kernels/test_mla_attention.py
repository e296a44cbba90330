"""kernels/mla_attention.py: latent cache writes and latent paged attention, reference and Triton, against
dense per-request math over the latent rows."""
import pytest
import torch

from kernels.attention import plan_paged_attention
from kernels.mla_attention import (
    mla_attention,
    mla_attention_ref,
    mla_attention_triton,
    store_latent,
    store_latent_ref,
    store_latent_triton,
)

from tests.support.paged_batches import TOL
from tests.support.paged_batches import latent_batch as make_batch


def dense_mla(q_lat, q_rope, rows, ctx, scale, L):
    """One request: queries [n, H, L] and [n, H, R] at positions ctx..ctx+n-1 over its cached rows
    [ctx+n, L+R] (latent then rope key); the value is the latent. fp64."""
    n = q_lat.shape[0]
    c, kr = rows[:, :L].double(), rows[:, L:].double()
    s = (torch.einsum("qhl,kl->hqk", q_lat.double(), c) + torch.einsum("qhr,kr->hqk", q_rope.double(), kr)) * scale
    allowed = torch.arange(rows.shape[0])[None, :] <= (ctx + torch.arange(n))[:, None]
    s = s.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,kl->qhl", s.softmax(-1), c)


def expected(batch, dense, q_lens, seq_lens, scale, L):
    batch = {k: v.cpu() for k, v in batch.items()}
    out = torch.zeros(batch["q_latent"].shape, dtype=torch.float64)
    start = 0
    for b, (n, s) in enumerate(zip(q_lens, seq_lens)):
        if n:
            sl = slice(start, start + n)
            out[sl] = dense_mla(batch["q_latent"][sl], batch["q_rope"][sl], dense[b], s - n, scale, L)
        start += n
    return out


# (q_lens, seq_lens): decode, prefill, chunked prefill, speculation chains, empty padding requests, a
# prefill chunk beside decode rows.
CASES = [
    ([1], [1]),
    ([1], [37]),
    ([5], [5]),
    ([3, 1, 0, 4], [19, 1, 0, 4]),
    ([4, 4, 4], [4, 33, 70]),
    ([1] * 5, [3, 17, 40, 1, 66]),
    ([1, 40, 4, 0, 17, 1], [30, 40, 9, 0, 50, 2]),
]
# (heads, kv_lora_rank, qk_rope_head_dim): odd head counts (a tile holds whole heads of fewer tokens),
# more heads than a tile (several head blocks), widths that are not powers of two.
SHAPES = [(4, 32, 16), (6, 48, 8), (40, 64, 16), (3, 40, 24)]


def _check(fn, q_lens, seq_lens, H, L, R, page, dtype, pad_rows=2, **kw):
    batch, dense = make_batch(q_lens, seq_lens, H, L, R, page, dtype, pad_rows)
    scale = 0.17
    out = fn(**batch, scale=scale, max_q_len=max(q_lens) + 1, max_seq_len=max(seq_lens) + 3, **kw)
    ref = expected(batch, dense, q_lens, seq_lens, scale, L)
    n = sum(q_lens)
    assert out.shape == batch["q_latent"].shape
    torch.testing.assert_close(out[:n].double(), ref[:n], atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.all(out[n:] == 0), "rows past the batch must stay zero in a fresh output"


@pytest.mark.parametrize("q_lens,seq_lens", CASES)
@pytest.mark.parametrize("H,L,R", SHAPES)
def test_mla_attention_ref(q_lens, seq_lens, H, L, R):
    _check(mla_attention_ref, q_lens, seq_lens, H, L, R, 16, torch.float32)


def test_mla_attention_ref_with_the_steps_plan():
    """The engine hands the reference the step's plan made for the latent rows' one KV head (group = H)."""
    q_lens, seq_lens, H = [1, 1, 1], [9, 30, 2], 5
    batch, dense = make_batch(q_lens, seq_lens, H, 32, 16, 4, torch.float32)
    plan = plan_paged_attention(batch["block_tables"], batch["seq_lens"], batch["query_start_loc"], 3, 4, H, 1, 33)
    out = mla_attention_ref(**batch, scale=0.2, max_q_len=1, max_seq_len=33, plan=plan)
    torch.testing.assert_close(out.double(), expected(batch, dense, q_lens, seq_lens, 0.2, 32), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("q_lens,seq_lens", CASES)
@pytest.mark.parametrize("H,L,R", SHAPES)
def test_mla_attention_triton(q_lens, seq_lens, H, L, R):
    _check(mla_attention_triton, q_lens, seq_lens, H, L, R, 16, torch.float32, num_splits=1)


@pytest.mark.parametrize("num_splits", [2, 5])
@pytest.mark.parametrize("q_lens,seq_lens", [([1, 1, 0], [150, 9, 0]), ([3, 2], [100, 64])])
def test_mla_attention_triton_split_kv(num_splits, q_lens, seq_lens):
    _check(mla_attention_triton, q_lens, seq_lens, 6, 48, 16, 16, torch.float32, num_splits=num_splits)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("page", [5, 16])
def test_mla_attention_dtypes(dtype, page):
    for fn in (mla_attention_ref, mla_attention_triton):
        _check(fn, [3, 1, 0, 2], [19, 30, 0, 2], 4, 64, 16, page, dtype)


def test_mla_attention_triton_keeps_caller_out_rows():
    batch, _ = make_batch([2, 1], [5, 9], 4, 32, 16, 4, torch.float32, pad_rows=3)
    out = torch.full_like(batch["q_latent"], 7.0)
    mla_attention_triton(**batch, scale=0.125, max_q_len=2, max_seq_len=9, out=out)
    assert torch.all(out[3:] == 7.0)


def test_mla_attention_dispatch_matches_ref():
    batch, _ = make_batch([3, 1], [20, 41], 6, 48, 16, 16, torch.float32)
    a = mla_attention(**batch, scale=0.125, max_q_len=3, max_seq_len=41)
    b = mla_attention_ref(**batch, scale=0.125, max_q_len=3, max_seq_len=41)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fn", [store_latent_ref, store_latent_triton, store_latent])
@pytest.mark.parametrize("slots", [[5, 0, 11, 3], [-1, 7, -1, 2], [-1, -1, -1, -1], []])
def test_store_latent(fn, slots):
    """Each row lands at its slot as [latent, rope key]; padding rows (-1) write nothing; other slots keep
    their contents (also when no row is real, where the reference rewrites slot 0 with itself)."""
    L, R, page = 24, 8, 4
    gen = torch.Generator().manual_seed(len(slots))
    cache = torch.randn(3, page, L + R, generator=gen)
    before = cache.clone()
    T = len(slots)
    latent, rope_key = torch.randn(T, L, generator=gen), torch.randn(T, R, generator=gen)
    # Strided inputs, as the model has them: views into one wider projection.
    wide = torch.zeros(T, L + 5)
    wide[:, :L] = latent
    fn(wide[:, :L], rope_key, cache, torch.tensor(slots, dtype=torch.int64))
    want = before.view(-1, L + R).clone()
    for t, s in enumerate(slots):
        if s >= 0:
            want[s] = torch.cat([latent[t], rope_key[t]])
    assert torch.equal(cache.view(-1, L + R), want)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [None, 1, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("q_lens,seq_lens", CASES + [([1, 1], [1500, 700])])
@pytest.mark.parametrize("H,L,R", [(16, 512, 64), (128, 512, 64), (6, 48, 8)])
def test_mla_attention_triton_cuda(num_splits, dtype, q_lens, seq_lens, H, L, R):
    """Compiled on a GPU at DeepSeek-V3's widths (16 heads: tp 8; 128: one rank)."""
    tol = {**TOL, torch.float32: 1e-4}
    batch, dense = make_batch(q_lens, seq_lens, H, L, R, 16, dtype, 2, device="cuda")
    scale = 0.1
    out = mla_attention_triton(**batch, scale=scale, max_q_len=max(q_lens), max_seq_len=max(seq_lens),
                               num_splits=num_splits)
    ref = expected(batch, dense, q_lens, seq_lens, scale, L)
    n = sum(q_lens)
    torch.testing.assert_close(out[:n].cpu().double(), ref[:n], atol=tol[dtype], rtol=tol[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_store_latent_cuda(dtype):
    L, R = 512, 64
    cache = torch.randn(4, 16, L + R, device="cuda").to(dtype)
    want = cache.clone().view(-1, L + R)
    latent, rope_key = torch.randn(9, L, device="cuda").to(dtype), torch.randn(9, R, device="cuda").to(dtype)
    slots = torch.tensor([3, -1, 40, 0, 63, -1, 7, 8, 9], device="cuda")
    store_latent_triton(latent, rope_key, cache, slots)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            want[s] = torch.cat([latent[t], rope_key[t]])
    assert torch.equal(cache.view(-1, L + R), want)
