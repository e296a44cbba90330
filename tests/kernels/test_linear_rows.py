"""kernels/cpu/linear_rows.cpp (torch.ops.tandem_cpu.linear_rows on kernels/linear_rows.py's packed weights): few-row
matmuls against F.linear in fp64, for fp32 and bf16 weights and activations, shapes that do not fill a packed block,
bias, and its errors. The engine's cpu_compile="full" runs every matmul of 1-16 rows through it, so the engine tests of
that mode (greedy equal to the eager engine) run through it too."""
import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_ext
from kernels.linear_rows import PACK, linear_rows, pack_rows

pytestmark = pytest.mark.skipif(not cpu_ext.available(), reason=f"C++ CPU kernels off: {cpu_ext.why_off()}")


def _want(x, w, b):
    return F.linear(x.double(), w.double(), None if b is None else b.double())


def test_pack_layout():
    w = torch.arange(70 * 3, dtype=torch.float32).view(70, 3)
    p = pack_rows(w)
    assert p.shape == (3, 3, PACK) and p.is_contiguous()
    assert torch.equal(p[1, 2, 5], w[PACK + 5, 2]) and torch.all(p[2, :, 70 - 2 * PACK:] == 0)


@pytest.mark.parametrize("M", [1, 2, 3, 4, 7, 16])
@pytest.mark.parametrize("N,K", [(96, 64), (70, 33), (5, 576), (960, 576)])
def test_fp32_equals_f_linear(M, N, K):
    gen = torch.Generator().manual_seed(M * N + K)
    x, w, b = torch.randn(M, K, generator=gen), torch.randn(N, K, generator=gen), torch.randn(N, generator=gen)
    for bias in (None, b):
        got = linear_rows(x, pack_rows(w), bias, N)
        assert got.shape == (M, N) and got.dtype == torch.float32
        torch.testing.assert_close(got.double(), _want(x, w, bias), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_bf16_weights_accumulate_in_fp32(x_dtype):
    """bf16 weights (and bf16 rows) read as their exact fp32 values; the sum is fp32, rounded once to x's dtype."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 576, generator=gen).to(x_dtype)
    w = torch.randn(200, 576, generator=gen).bfloat16()
    got = linear_rows(x, pack_rows(w), None, 200)
    assert got.dtype == x_dtype
    want = _want(x.float(), w.float(), None)
    tol = 1e-4 if x_dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.double(), want.to(x_dtype).double() if x_dtype != torch.float32 else want,
                               atol=tol * 10, rtol=tol)


def test_strided_rows_and_threads():
    """x as a view (a fused projection's slice), one and two threads: the same values."""
    gen = torch.Generator().manual_seed(2)
    big = torch.randn(3, 900, generator=gen)
    x = big[:, 100:676]
    w = torch.randn(300, 576, generator=gen)
    saved = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            outs.append(linear_rows(x, pack_rows(w), None, 300))
    finally:
        torch.set_num_threads(saved)
    assert torch.equal(outs[0], outs[1])
    torch.testing.assert_close(outs[0].double(), _want(x, w, None), atol=1e-4, rtol=1e-4)


def test_bad_inputs_raise_naming_the_argument():
    w = pack_rows(torch.randn(64, 32))
    with pytest.raises(RuntimeError, match="packed weight"):
        linear_rows(torch.randn(2, 31), w, None, 64)
    with pytest.raises(RuntimeError, match="packed weight"):
        linear_rows(torch.randn(2, 32), w, None, 65)
    with pytest.raises(RuntimeError, match="packed weight"):
        linear_rows(torch.randn(2, 32), torch.randn(64, 32), None, 64)  # not packed
    with pytest.raises(RuntimeError, match="bias"):
        linear_rows(torch.randn(2, 32), w, torch.randn(3), 64)
    with pytest.raises(RuntimeError, match="weight fp32 or bf16"):
        linear_rows(torch.randn(2, 32), w.half(), None, 64)
