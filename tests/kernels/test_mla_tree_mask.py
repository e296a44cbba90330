"""Tree-masked latent paged attention (kernels/mla_attention.py with kernels/tree_mask.py's masks): reference and
Triton against dense per-request math over the latent rows with an explicit boolean mask, beside prompt chunks and
empty requests; a chain's mask and the all-ones mask equal plain causal attention exactly."""
import pytest
import torch

from kernels.attention import plan_paged_attention
from kernels.mla_attention import mla_attention, mla_attention_ref, mla_attention_triton
from kernels.tree_mask import chain_bits, window_bits

from tests.support.paged_batches import TOL, TREE_CASES, tree_case
from tests.support.paged_batches import latent_batch as make_batch


def dense_mla_masked(q_lat, q_rope, rows, allowed, scale, L):
    """One request: queries [n, H, L] and [n, H, R] over its cached rows [s, L + R] (latent then rope key), where
    allowed [n, s] says which positions each row sees; the value is the latent. fp64."""
    c, kr = rows[:, :L].double(), rows[:, L:].double()
    s = (torch.einsum("qhl,kl->hqk", q_lat.double(), c) + torch.einsum("qhr,kr->hqk", q_rope.double(), kr)) * scale
    return torch.einsum("hqk,kl->qhl", s.masked_fill(~allowed[None], float("-inf")).softmax(-1), c)


# (q_lens, seq_lens): one tree, trees beside a decode row and an empty request, a tree with no prefix before it,
# trees whose rows span more than one query tile, prompt chunks (q_len > 40: mask -1) alone and beside trees.
CASES = TREE_CASES
# (heads, kv_lora_rank, qk_rope_head_dim): a tile of whole heads; 3 heads (a tile's last rows pad); widths that are
# not powers of two.
SHAPES = [(4, 32, 16), (3, 40, 24)]


def _run(fn, q_lens, seq_lens, H, L, R, dtype=torch.float32, page=16, seed=0, prefill_rows=True, **kw):
    batch, dense = make_batch(q_lens, seq_lens, H, L, R, page, dtype, seed=seed)
    tree, allowed = tree_case(q_lens, seq_lens, seed, prefill_rows)
    scale = 0.17
    out = fn(**batch, scale=scale, max_q_len=max(q_lens), max_seq_len=max(seq_lens) + 2, tree_mask=tree, **kw)
    start = 0
    for b, n in enumerate(q_lens):
        if n:
            sl = slice(start, start + n)
            want = dense_mla_masked(batch["q_latent"][sl], batch["q_rope"][sl], dense[b], allowed[b], scale, L)
            torch.testing.assert_close(out[sl].double(), want, atol=TOL[dtype], rtol=TOL[dtype])
        start += n
    return out


@pytest.mark.parametrize("q_lens,seq_lens", CASES)
@pytest.mark.parametrize("H,L,R", SHAPES)
def test_mla_tree_ref(q_lens, seq_lens, H, L, R):
    _run(mla_attention_ref, q_lens, seq_lens, H, L, R)


@pytest.mark.parametrize("q_lens,seq_lens", CASES)
@pytest.mark.parametrize("H,L,R", SHAPES)
def test_mla_tree_triton(q_lens, seq_lens, H, L, R):
    _run(mla_attention_triton, q_lens, seq_lens, H, L, R, num_splits=1)


@pytest.mark.parametrize("fn", [mla_attention_ref, mla_attention_triton])
def test_mla_tree_of_63_nodes(fn):
    """The largest tree: its root and 63 nodes fill the whole 64-position window."""
    _run(fn, [64, 3], [200, 64], 4, 32, 16, prefill_rows=False, **({"num_splits": 1} if fn is mla_attention_triton
                                                                     else {}))


def test_mla_tree_triton_head_blocks():
    """More heads than a tile: each head block of a tree's rows reads the same row masks."""
    _run(mla_attention_triton, [6, 1], [50, 20], 40, 32, 16, num_splits=1)


@pytest.mark.parametrize("num_splits", [2, 3])
def test_mla_tree_triton_split_kv(num_splits):
    """Split KV: the window's positions fall in the last split, or straddle two."""
    _run(mla_attention_triton, [9, 5], [300, 70], 6, 48, 16, num_splits=num_splits)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mla_tree_triton_equals_ref_low_precision(dtype):
    batch, _ = make_batch([7, 3], [60, 21], 4, 64, 16, 5, dtype, seed=3)
    tree, _ = tree_case([7, 3], [60, 21], 3)
    kw = dict(scale=0.2, max_q_len=7, max_seq_len=60, tree_mask=tree)
    got = mla_attention_triton(**batch, **kw, num_splits=1)
    want = mla_attention_ref(**batch, **kw)
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("fn", [mla_attention_ref, mla_attention_triton])
@pytest.mark.parametrize("q_lens,seq_lens", [([4], [30]), ([1, 6, 3], [9, 70, 3])])
def test_mla_chain_mask_is_causal(fn, q_lens, seq_lens):
    """A chain's tree mask (lower-triangular ancestors), and the all-ones mask, give exactly today's causal
    attention."""
    batch, _ = make_batch(q_lens, seq_lens, 4, 32, 16, 8, torch.float32, seed=1)
    kw = dict(scale=0.2, max_q_len=max(q_lens), max_seq_len=max(seq_lens))
    plain = fn(**batch, **kw)
    chain = torch.cat([window_bits(chain_bits(n), n) for n in q_lens])
    assert torch.equal(fn(**batch, **kw, tree_mask=chain), plain)
    ones = torch.full((sum(q_lens),), -1, dtype=torch.int64)
    assert torch.equal(fn(**batch, **kw, tree_mask=ones), plain)


def test_mla_tree_ref_with_the_steps_plan_and_dispatch():
    """The engine's reference path hands over the step's plan, made with the tree mask (group = H); the dispatching
    function passes the mask on (without it the result differs)."""
    q_lens, seq_lens, H = [5, 2], [40, 12], 4
    batch, _ = make_batch(q_lens, seq_lens, H, 32, 16, 8, torch.float32, seed=2)
    tree, _ = tree_case(q_lens, seq_lens, 2)
    kw = dict(scale=0.2, max_q_len=5, max_seq_len=40)
    want = mla_attention_ref(**batch, **kw, tree_mask=tree)
    plan = plan_paged_attention(batch["block_tables"], batch["seq_lens"], batch["query_start_loc"], 7, 8, H, 5, 40,
                                tree)
    assert torch.equal(mla_attention_ref(**batch, **kw, plan=plan), want)
    torch.testing.assert_close(mla_attention(**batch, **kw, tree_mask=tree), want, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(mla_attention(**batch, **kw), want)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [None, 1, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("H", [16, 128])
def test_mla_tree_triton_cuda(num_splits, dtype, H):
    """Compiled on a GPU at DeepSeek-V3's widths (16 heads: tp 8; 128: one rank), trees beside a prompt chunk."""
    q_lens, seq_lens = [9, 1, 50, 64], [700, 30, 50, 1500]
    batch, dense = make_batch(q_lens, seq_lens, H, 512, 64, 16, dtype, device="cuda")
    tree, allowed = tree_case(q_lens, seq_lens, 4)
    scale = 0.1
    out = mla_attention_triton(**batch, scale=scale, max_q_len=max(q_lens), max_seq_len=max(seq_lens),
                               num_splits=num_splits, tree_mask=tree.cuda()).cpu()
    tol = {**TOL, torch.float32: 1e-4}[dtype]
    start = 0
    for b, n in enumerate(q_lens):
        sl = slice(start, start + n)
        want = dense_mla_masked(batch["q_latent"][sl].cpu(), batch["q_rope"][sl].cpu(), dense[b], allowed[b], scale,
                                512)
        torch.testing.assert_close(out[sl].double(), want, atol=tol, rtol=tol)
        start += n
