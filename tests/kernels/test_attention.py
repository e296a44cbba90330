"""kernels/store_kv.py and kernels/attention.py: store_kv and paged attention, reference and Triton, against dense per-request math."""
import math

import pytest
import torch

from kernels.attention import (
    paged_attention,
    paged_attention_ref,
    paged_attention_triton,
    plan_chain,
    plan_paged_attention,
)
from kernels.store_kv import plan_store_kv, store_kv, store_kv_ref, store_kv_triton

from tests.support.paged_batches import TOL
from tests.support.paged_batches import paged_batch as make_batch

def dense_attention(q, k, v, ctx, scale):
    """One request: q [n, Hq, D] at positions ctx..ctx+n-1 over k/v [ctx+n, Hkv, D], fp64 math."""
    n, Hq, _ = q.shape
    G = Hq // k.shape[1]
    k = k.double().repeat_interleave(G, dim=1)
    v = v.double().repeat_interleave(G, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    allowed = torch.arange(k.shape[0])[None, :] <= (ctx + torch.arange(n))[:, None]
    s = s.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


def expected(batch, dense_k, dense_v, q_lens, seq_lens, scale):
    q = batch["query"].cpu()
    out = torch.zeros(q.shape, dtype=torch.float64)
    start = 0
    for b, (n, s) in enumerate(zip(q_lens, seq_lens)):
        if n:
            out[start : start + n] = dense_attention(q[start : start + n], dense_k[b], dense_v[b], s - n, scale)
        start += n
    return out


# (q_lens, seq_lens): decode, prefill, chunked prefill, speculation, padding requests with q_len 0.
CASES = [
    ([1], [1]),
    ([1], [37]),
    ([5], [5]),
    ([3, 1, 0, 4], [19, 1, 0, 4]),
    ([4, 4, 4], [4, 33, 70]),
    ([0, 7, 0], [0, 29, 0]),
    ([1] * 5, [3, 17, 40, 1, 66]),
    # Prefill chunks beside decode rows: the reference pads the two groups separately.
    ([1, 40, 4, 0, 17, 1], [30, 40, 9, 0, 50, 2]),
]
HEADS = [(4, 4), (6, 2), (8, 1)]


def _check(fn, q_lens, seq_lens, Hq, Hkv, D, page, dtype, pad_rows=2, device="cpu", **kw):
    batch, dk, dv = make_batch(q_lens, seq_lens, Hq, Hkv, D, page, dtype, pad_rows, device)
    scale = 1 / math.sqrt(D)
    # Caller-provided bounds may exceed the true maxima.
    out = fn(**batch, scale=scale, max_q_len=max(q_lens) + 1, max_seq_len=max(seq_lens) + 3, **kw)
    ref = expected(batch, dk, dv, q_lens, seq_lens, scale)
    n = sum(q_lens)
    torch.testing.assert_close(out[:n].cpu().double(), ref[:n], atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.all(out[n:] == 0), "rows past the batch must stay zero in a fresh output"


@pytest.mark.parametrize("q_lens,seq_lens", CASES)
@pytest.mark.parametrize("Hq,Hkv", HEADS)
def test_paged_attention_ref(q_lens, seq_lens, Hq, Hkv):
    _check(paged_attention_ref, q_lens, seq_lens, Hq, Hkv, 64, 16, torch.float32)


# Decode layouts: every request owns the same number of rows and nothing pads (plain decode, full
# verification chains, draft-chain steps).
UNIFORM = [([1], [1]), ([1], [37]), ([1] * 5, [3, 17, 40, 1, 66]), ([4], [90]), ([4, 4, 4], [4, 33, 70])]


@pytest.mark.parametrize("q_lens,seq_lens", UNIFORM)
@pytest.mark.parametrize("Hq,Hkv", HEADS)
def test_paged_attention_ref_uniform(q_lens, seq_lens, Hq, Hkv):
    """The reference's uniform plan (no query gather or scatter; at one row per request a length mask
    SDPA broadcasts over the query heads) against dense math, with a KV bound past every length so
    that masked positions exist and unused slots hold NaN."""
    batch, dk, dv = make_batch(q_lens, seq_lens, Hq, Hkv, 64, 16, torch.float32, pad_rows=0)
    bounds = dict(max_q_len=max(q_lens), max_seq_len=max(seq_lens) + 3)
    plan = plan_paged_attention(batch["block_tables"], batch["seq_lens"], batch["query_start_loc"], sum(q_lens), 16,
                                Hq // Hkv, **bounds)
    assert plan.uniform
    out = paged_attention_ref(**batch, scale=0.125, **bounds, plan=plan)
    torch.testing.assert_close(out.double(), expected(batch, dk, dv, q_lens, seq_lens, 0.125), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("B,passes,page,G", [(1, 1, 16, 3), (1, 2, 16, 3), (5, 3, 4, 1), (3, 7, 5, 2)])
def test_plan_chain_equals_one_plan_per_pass(B, passes, page, G):
    """A draft chain's plans made together (plan_chain) equal the plans made pass by pass, field by field,
    including passes whose last positions are past a request's slots (slot_mapping -1: the store plan
    that redirects padding rows) and lengths that cross a block boundary."""
    g = torch.Generator().manual_seed(B * 100 + passes)
    M = 6
    tables = torch.randint(0, 50, (B, M), generator=g, dtype=torch.int32)
    first = torch.randint(1, M * page - passes, (B,), generator=g)
    pos = first[None, :] + torch.arange(passes)[:, None]  # [P, B]
    limit = first + torch.randint(0, passes + 1, (B,), generator=g)  # some passes write past the held slots
    slot = tables.gather(1, (pos // page).t().long()).t().long() * page + pos % page
    slot_mapping = torch.where(pos < limit, slot, -1)
    seq_lens = (pos + 1).to(torch.int32)
    max_seq = int(seq_lens.max()) + 2
    together = plan_chain(tables, seq_lens, slot_mapping, page, G, max_seq)
    qsl = torch.arange(B + 1, dtype=torch.int32)
    for p, (store, attend) in enumerate(together):
        want_store = plan_store_kv(slot_mapping[p])
        for field in ("src", "dst", "keep"):
            assert torch.equal(getattr(store, field), getattr(want_store, field)), (p, field)
        assert store.direct == want_store.direct
        want = plan_paged_attention(tables, seq_lens[p], qsl, B, page, G, 1, max_seq)
        assert (attend.T, attend.B, attend.G, attend.uniform, attend.in_batch) == (B, B, G, True, None)
        assert want.uniform and len(attend.groups) == len(want.groups) == 1
        got, ref = attend.groups[0], want.groups[0]
        assert (got.B, got.L, got.mq) == (ref.B, ref.L, ref.mq)
        assert torch.equal(got.slots, ref.slots) and torch.equal(got.mask, ref.mask)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D,page", [(64, 16), (128, 8), (40, 5)])
def test_paged_attention_ref_dtypes(dtype, D, page):
    _check(paged_attention_ref, [3, 1, 0, 2], [19, 30, 0, 2], 6, 2, D, page, dtype)


@pytest.mark.parametrize("q_lens,seq_lens", CASES)
@pytest.mark.parametrize("Hq,Hkv", HEADS)
def test_paged_attention_triton(q_lens, seq_lens, Hq, Hkv):
    _check(paged_attention_triton, q_lens, seq_lens, Hq, Hkv, 64, 16, torch.float32, num_splits=1)


@pytest.mark.parametrize("num_splits", [2, 3, 7])
@pytest.mark.parametrize("q_lens,seq_lens", [([1, 1, 0], [150, 9, 0]), ([3, 2], [100, 64])])
def test_paged_attention_triton_split_kv(num_splits, q_lens, seq_lens):
    _check(paged_attention_triton, q_lens, seq_lens, 6, 2, 64, 16, torch.float32, num_splits=num_splits)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D,page", [(128, 8), (40, 5), (80, 3)])
def test_paged_attention_triton_shapes(dtype, D, page):
    _check(paged_attention_triton, [3, 1, 0, 2], [19, 30, 0, 2], 6, 2, D, page, dtype, num_splits=None)


def test_paged_attention_triton_keeps_caller_out_rows():
    batch, _, _ = make_batch([2, 1], [5, 9], 4, 2, 64, 4, torch.float32, pad_rows=3)
    out = torch.full_like(batch["query"], 7.0)
    paged_attention_triton(**batch, scale=0.125, max_q_len=2, max_seq_len=9, out=out)
    assert torch.all(out[3:] == 7.0)


def test_paged_attention_dispatch_matches_ref():
    """The dispatcher runs Triton under the interpreter; it must agree with the reference."""
    batch, _, _ = make_batch([3, 1], [20, 41], 6, 2, 64, 16, torch.float32)
    a = paged_attention(**batch, scale=0.125, max_q_len=3, max_seq_len=41)
    b = paged_attention_ref(**batch, scale=0.125, max_q_len=3, max_seq_len=41)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def _store_case(T, pad, dtype, device="cpu"):
    gen = torch.Generator().manual_seed(T * 31 + pad)
    N, S, H, D = 6, 4, 3, 20
    k_cache = torch.randn(N, S, H, D, generator=gen).to(dtype)
    v_cache = torch.randn(N, S, H, D, generator=gen).to(dtype)
    slots = torch.randperm(N * S, generator=gen)[:T]
    slots[torch.randperm(T, generator=gen)[:pad]] = -1
    # key/value as non-contiguous views of a fused projection, as the engine produces them
    kv = torch.randn(T, 2, H, D, generator=gen).to(dtype)
    key, value = kv[:, 0], kv[:, 1]
    want_k, want_v = k_cache.clone().view(N * S, H, D), v_cache.clone().view(N * S, H, D)
    for t in range(T):
        if slots[t] >= 0:
            want_k[slots[t]] = key[t]
            want_v[slots[t]] = value[t]
    args = [x.to(device) for x in (key, value, k_cache, v_cache, slots)]
    return args, want_k.view(N, S, H, D), want_v.view(N, S, H, D)


@pytest.mark.parametrize("fn", [store_kv_ref, store_kv_triton, store_kv])
@pytest.mark.parametrize("T,pad", [(0, 0), (1, 0), (1, 1), (7, 0), (7, 3), (9, 9)])
def test_store_kv(fn, T, pad):
    args, want_k, want_v = _store_case(T, pad, torch.float32)
    fn(*args)
    assert torch.equal(args[2], want_k) and torch.equal(args[3], want_v)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_store_kv_cuda(dtype):
    args, want_k, want_v = _store_case(9, 3, dtype, "cuda")
    store_kv_triton(*args)
    assert torch.equal(args[2].cpu(), want_k) and torch.equal(args[3].cpu(), want_v)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [None, 1, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("q_lens,seq_lens", CASES + [([1, 1], [1500, 700])])
@pytest.mark.parametrize("D", [64, 128, 80])
def test_paged_attention_triton_cuda(num_splits, dtype, q_lens, seq_lens, D):
    tol = {**TOL, torch.float32: 1e-4}
    batch, dk, dv = make_batch(q_lens, seq_lens, 8, 2, D, 16, dtype, 2, "cuda")
    out = paged_attention_triton(**batch, scale=D**-0.5, max_q_len=max(q_lens), max_seq_len=max(seq_lens),
                                 num_splits=num_splits)
    ref = expected(batch, dk, dv, q_lens, seq_lens, D**-0.5)
    n = sum(q_lens)
    torch.testing.assert_close(out[:n].cpu().double(), ref[:n], atol=tol[dtype], rtol=tol[dtype])


@pytest.mark.parametrize("fn", [paged_attention_ref, paged_attention_triton])
def test_paged_attention_strided_query(fn):
    """q as a view of a fused qkv projection [T, Hq + 2 * Hkv, D] (row stride != Hq * D)."""
    batch, dk, dv = make_batch([2, 3], [7, 12], 4, 2, 64, 4, torch.float32, pad_rows=0)
    fused = torch.randn(5, 8, 64)
    fused[:, :4] = batch["query"]
    batch["query"] = fused[:, :4]
    out = fn(**batch, scale=0.125, max_q_len=3, max_seq_len=12)
    ref = expected(batch, dk, dv, [2, 3], [7, 12], 0.125)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)
