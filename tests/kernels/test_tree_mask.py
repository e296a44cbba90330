"""Tree-masked paged attention (kernels/tree_mask.py): reference and Triton against dense math with an explicit
boolean mask, and a chain (lower-triangular ancestors) equal to plain causal attention."""
import math

import pytest
import torch

from kernels.attention import paged_attention, paged_attention_ref, paged_attention_triton
from kernels.tree_mask import ancestor_bits, chain_bits, window_bits

from tests.support.paged_batches import paged_batch as make_batch
from tests.support.paged_batches import TREE_CASES, tree_case


def dense_masked(q, k, v, allowed, scale):
    """One request: q [n, Hq, D] over k/v [s, Hkv, D] where allowed [n, s] says which positions each row sees."""
    G = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(G, dim=1)
    v = v.double().repeat_interleave(G, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    return torch.einsum("hqk,khd->qhd", s.masked_fill(~allowed[None], float("-inf")).softmax(-1), v)


# (q_lens, seq_lens): one tree, trees beside plain rows and empty requests, a tree whose prefix is shorter than
# the 64-position window, trees of up to 63 drafts, a prefill chunk (mask -1) beside trees.
CASES = TREE_CASES


def _run(fn, q_lens, seq_lens, Hq, Hkv, dtype=torch.float32, seed=0, **kw):
    batch, dk, dv = make_batch(q_lens, seq_lens, Hq, Hkv, 32, 8, dtype, pad_rows=0, seed=seed)
    tree, allowed = tree_case(q_lens, seq_lens, seed)
    scale = 1 / math.sqrt(32)
    out = fn(**batch, scale=scale, max_q_len=max(q_lens), max_seq_len=max(seq_lens) + 2, tree_mask=tree, **kw)
    start = 0
    for b, n in enumerate(q_lens):
        if n:
            want = dense_masked(batch["query"][start : start + n], dk[b], dv[b], allowed[b], scale)
            torch.testing.assert_close(out[start : start + n].double(), want, atol=2e-5, rtol=2e-5)
        start += n
    return out


@pytest.mark.parametrize("q_lens,seq_lens", CASES)
@pytest.mark.parametrize("Hq,Hkv", [(4, 4), (6, 2)])
def test_tree_ref(q_lens, seq_lens, Hq, Hkv):
    _run(paged_attention_ref, q_lens, seq_lens, Hq, Hkv)


@pytest.mark.parametrize("q_lens,seq_lens", CASES)
@pytest.mark.parametrize("Hq,Hkv", [(4, 4), (6, 2)])
def test_tree_triton(q_lens, seq_lens, Hq, Hkv):
    _run(paged_attention_triton, q_lens, seq_lens, Hq, Hkv, num_splits=1)


@pytest.mark.parametrize("num_splits", [2, 3])
def test_tree_triton_split_kv(num_splits):
    """Split KV: the window's positions fall in the last split, or straddle two."""
    _run(paged_attention_triton, [9, 5], [300, 70], 6, 2, num_splits=num_splits)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_tree_triton_equals_ref_low_precision(dtype):
    batch, _, _ = make_batch([7, 3], [60, 21], 6, 2, 32, 8, dtype, pad_rows=0, seed=3)
    tree, _ = tree_case([7, 3], [60, 21], 3)
    kw = dict(scale=0.2, max_q_len=7, max_seq_len=60, tree_mask=tree)
    got = paged_attention_triton(**batch, **kw, num_splits=1)
    want = paged_attention_ref(**batch, **kw)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("fn", [paged_attention_ref, paged_attention_triton])
@pytest.mark.parametrize("q_lens,seq_lens", [([4], [30]), ([1, 6, 3], [9, 70, 3])])
def test_chain_mask_is_causal(fn, q_lens, seq_lens):
    """A chain's tree mask (lower-triangular ancestors), and the all-ones mask, give exactly today's causal
    attention."""
    batch, _, _ = make_batch(q_lens, seq_lens, 6, 2, 32, 8, torch.float32, pad_rows=0, seed=1)
    kw = dict(scale=0.2, max_q_len=max(q_lens), max_seq_len=max(seq_lens))
    plain = fn(**batch, **kw)
    chain = torch.cat([window_bits(chain_bits(n), n) for n in q_lens])
    assert torch.equal(fn(**batch, **kw, tree_mask=chain), plain)
    ones = torch.full((sum(q_lens),), -1, dtype=torch.int64)
    assert torch.equal(fn(**batch, **kw, tree_mask=ones), plain)


def test_dispatch_passes_tree_mask():
    batch, _, _ = make_batch([5, 2], [40, 12], 4, 2, 32, 8, torch.float32, pad_rows=0, seed=2)
    tree, _ = tree_case([5, 2], [40, 12], 2)
    kw = dict(scale=0.2, max_q_len=5, max_seq_len=40, tree_mask=tree)
    torch.testing.assert_close(paged_attention(**batch, **kw), paged_attention_ref(**batch, **kw), atol=1e-5,
                               rtol=1e-5)
    assert not torch.allclose(paged_attention(**batch, scale=0.2, max_q_len=5, max_seq_len=40),
                              paged_attention_ref(**batch, **kw))


def test_ancestor_bits():
    parents = torch.tensor([[0, 0, 1, 3], [0, 1, 2, 3]])
    assert ancestor_bits(parents).tolist() == [[0b1, 0b11, 0b101, 0b1011, 0b11011],
                                               [0b1, 0b11, 0b111, 0b1111, 0b11111]]
    assert chain_bits(5).tolist() == ancestor_bits(parents[1:]).tolist()[0]
    assert window_bits(torch.tensor([0b11]), 2).tolist() == [-1]


@pytest.mark.parametrize("n", [1, 2, 7, 8, 9, 31, 63])
def test_ancestor_bits_equal_a_walk_up_each_nodes_parents(n):
    """Pointer doubling against the definition: a node's bits are its own and its parent's, for random trees and
    the deepest (a chain); with max_depth the tree's true depth too. Bit 63 (node 63) is the sign bit."""
    g = torch.Generator().manual_seed(n)
    trees = [torch.randint(0, j + 1, (1,), generator=g).item() for j in range(n)], list(range(n))
    parents = torch.tensor(trees)
    want = []
    for row in trees:
        bits = [1]
        for j, p in enumerate(row):
            bits.append(bits[p] | (1 << (j + 1)))
        want.append([b - (1 << 64) if b >> 63 else b for b in bits])
    assert ancestor_bits(parents).tolist() == want
    depth = max(bin(b % (1 << 64)).count("1") - 1 for row in want for b in row)
    assert ancestor_bits(parents, max_depth=depth).tolist() == want
    assert window_bits(torch.tensor([0b101]), 3).tolist() == [~(1 << 62)]  # the span is the top 3 bits: 101


@pytest.mark.parametrize("span", [1, 5, 32, 63, 64])
def test_window_bits_of_a_python_span_equal_a_tensor_span(span):
    """A Python span is computed as scalars (no host-to-device copy inside a captured CUDA graph): the same masks."""
    ancestors = torch.randint(0, 2**62, (3, 4), generator=torch.Generator().manual_seed(span)) & ((1 << span) - 1)
    assert torch.equal(window_bits(ancestors, span), window_bits(ancestors, torch.tensor(span)))
