"""kernels/bitmask.py: reference, C++ and Triton against an unpackbits oracle and xgrammar's own kernel."""
import numpy as np
import pytest
import torch
import xgrammar as xgr

from kernels import cpu_ext
from kernels.bitmask import (apply_token_bitmask, apply_token_bitmask_cpu, apply_token_bitmask_ref,
                             apply_token_bitmask_triton)

cpp = pytest.param(apply_token_bitmask_cpu, marks=pytest.mark.skipif(not cpu_ext.available(),
                                                                      reason="C++ CPU kernels not built"))
FNS = [apply_token_bitmask_ref, apply_token_bitmask_triton, cpp, apply_token_bitmask]


def allowed_table(bitmask: torch.Tensor) -> np.ndarray:
    """[R, 32 * W] bool from the packed words, little-endian bits within each little-endian int32."""
    return np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little").astype(bool)


def oracle(logits, bitmask, flag, indices, d2t, vocab_size):
    out = logits.clone()
    allowed = allowed_table(bitmask)
    vt = 32 * bitmask.shape[1] if vocab_size is None else min(vocab_size, 32 * bitmask.shape[1])
    for i in range(logits.shape[0]):
        if flag is not None and not flag[i]:
            continue
        r = i if indices is None else int(indices[i])
        for j in range(logits.shape[1]):
            t = j if d2t is None else j + int(d2t[j])
            if 0 <= t < vt and not allowed[r, t]:
                out[i, j] = float("-inf")
    return out


def make(rows, V, Vt=None, bm_rows=None, seed=0, dtype=torch.float32, density=0.5):
    gen = torch.Generator().manual_seed(seed)
    Vt = V if Vt is None else Vt
    W = (Vt + 31) // 32
    bits = torch.rand((bm_rows or rows, W * 32), generator=gen) < density
    words = (bits.view(-1, W, 32).long() << torch.arange(32)).sum(-1)
    bitmask = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    logits = torch.randn(rows, V, generator=gen).to(dtype)
    return logits, bitmask, gen


@pytest.mark.parametrize("fn", FNS)
@pytest.mark.parametrize("rows,V", [(0, 33), (1, 1), (3, 31), (2, 32), (4, 33), (3, 1000), (2, 4097)])
def test_matches_oracle_and_xgrammar(fn, rows, V):
    logits, bitmask, _ = make(rows, V, seed=rows * 7 + V)
    want = oracle(logits, bitmask, None, None, None, None)
    if rows:
        theirs = logits.clone()
        xgr.apply_token_bitmask_inplace(theirs, bitmask, backend="cpu")
        assert torch.equal(theirs, want), "oracle disagrees with xgrammar"
    fn(logits, bitmask)
    assert torch.equal(logits, want)


@pytest.mark.parametrize("fn", FNS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_dtypes(fn, dtype):
    logits, bitmask, _ = make(3, 77, dtype=dtype)
    want = oracle(logits, bitmask, None, None, None, None)
    fn(logits, bitmask)
    assert torch.equal(logits, want)


@pytest.mark.parametrize("fn", FNS)
def test_row_flags_match_xgrammar_indices(fn):
    """Flags select rows the way xgrammar's `indices` does; unflagged rows stay bit-identical."""
    logits, bitmask, _ = make(6, 200, seed=3)
    flag = torch.tensor([True, False, False, True, False, True])
    theirs = logits.clone()
    xgr.apply_token_bitmask_inplace(theirs, bitmask, indices=[0, 3, 5], backend="cpu")
    fn(logits, bitmask, flag)
    assert torch.equal(logits, theirs)


@pytest.mark.parametrize("fn", FNS)
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
def test_indices_and_vocab_size(fn, idx_dtype):
    logits, bitmask, gen = make(5, 130, bm_rows=9, seed=5)
    indices = torch.randint(0, 9, (5,), generator=gen).to(idx_dtype)
    flag = torch.tensor([True, True, False, True, True])
    for vocab_size in (None, 100):
        x = logits.clone()
        fn(x, bitmask, flag, indices, None, vocab_size)
        assert torch.equal(x, oracle(logits, bitmask, flag, indices, None, vocab_size))


@pytest.mark.parametrize("fn", FNS)
@pytest.mark.parametrize("Vd,Vt", [(40, 100), (257, 1000), (1, 33)])
def test_draft_vocab_d2t(fn, Vd, Vt):
    logits, bitmask, gen = make(4, Vd, Vt=Vt, bm_rows=6, seed=Vd)
    target_ids = torch.sort(torch.randperm(Vt, generator=gen)[:Vd]).values
    d2t = target_ids - torch.arange(Vd)
    indices = torch.tensor([5, 0, 2, 2])
    flag = torch.tensor([True, False, True, True])
    want = oracle(logits, bitmask, flag, indices, d2t, None)
    fn(logits, bitmask, flag, indices, d2t)
    assert torch.equal(logits, want)
    # with d2t a draft row equals the target-vocab mask gathered at the mapped ids
    full = torch.randn(1, Vt)
    apply_token_bitmask_ref(full, bitmask[5:6])
    assert torch.equal(torch.isinf(logits[0]), torch.isinf(full[0, target_ids]))


@pytest.mark.parametrize("fn", FNS)
def test_strided_flags_indices_and_d2t(fn):
    """Column slices as StepMasks.verify hands them on a trimmed step (flags [B, k+1][:, :1] flattened is a view of
    stride k+1): each row reads its own flag. Read as contiguous, rows took other requests' flags (an H200 run:
    a guided request's first token unmasked)."""
    logits, bitmask, gen = make(4, 70, bm_rows=8, seed=11)
    flags_2d = torch.tensor([[True, False, False], [False, True, True], [True, True, False], [True, False, True]])
    flag = flags_2d[:, :1].flatten()
    assert flag.stride(0) == 3
    indices = torch.tensor([[7, 0], [1, 0], [5, 0], [2, 0]])[:, 0]
    d2t = torch.zeros((70, 2), dtype=torch.int64)[:, 0]
    want = oracle(logits, bitmask, flag.contiguous(), indices.contiguous(), d2t.contiguous(), None)
    fn(logits, bitmask, flag, indices, d2t)
    assert torch.equal(logits, want)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("V", [32000, 128256, 151936 + 5])
def test_cuda_matches_xgrammar(dtype, V):
    logits, bitmask, gen = make(8, V, dtype=dtype)
    logits, bitmask = logits.cuda(), bitmask.cuda()
    theirs = logits.clone()
    xgr.apply_token_bitmask_inplace(theirs, bitmask)
    flag = torch.ones(8, dtype=torch.bool, device="cuda")
    apply_token_bitmask_triton(logits, bitmask, flag)
    assert torch.equal(logits, theirs)
