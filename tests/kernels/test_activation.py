"""kernels/activation.py: silu(gate) * up of a fused gate/up projection, the reference against transformers'
activation and the Triton kernel against the reference."""
import pytest
import torch
from transformers.activations import ACT2FN

from kernels.activation import silu_and_mul, silu_and_mul_ref, silu_and_mul_triton

TOL = {torch.float32: (1e-6, 1e-6), torch.bfloat16: (1.6e-2, 1.6e-2), torch.float16: (2e-3, 2e-3)}


def _gate_up(T, I, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(T, 2 * I, generator=gen) * 4).to(dtype)  # |g| up to ~16: exp(-g) over a wide range


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ref_is_transformers_gated_activation(dtype):
    x = _gate_up(5, 96, dtype)
    gate, up = x[:, :96], x[:, 96:]
    assert torch.equal(silu_and_mul_ref(x), ACT2FN["silu"](gate) * up)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T,I", [(1, 1536), (7, 96), (3, 40), (2, 2048 + 5), (0, 64)])
def test_triton_matches_ref(dtype, T, I):
    x = _gate_up(T, I, dtype, seed=I)
    got, want = silu_and_mul_triton(x), silu_and_mul_ref(x)
    assert got.shape == want.shape == (T, I) and got.dtype == dtype
    torch.testing.assert_close(got, want, atol=TOL[dtype][0], rtol=TOL[dtype][1])


def test_triton_reads_a_strided_projection():
    """The projection may be a view with a row stride past 2 * I (a slice of a wider buffer)."""
    wide = _gate_up(6, 80, torch.float32)  # [6, 160]
    x = wide[:, :128]  # gate = features 0..63, up = 64..127, row stride 160
    torch.testing.assert_close(silu_and_mul_triton(x), silu_and_mul_ref(x), atol=1e-6, rtol=1e-6)


def test_extremes_stay_finite_as_in_torch():
    x = torch.tensor([[-100.0, 100.0, -3e38, 0.0, 2.0, 3.0, 1.0, 5.0]])
    torch.testing.assert_close(silu_and_mul_triton(x), silu_and_mul_ref(x), atol=1e-6, rtol=1e-6)


def test_dispatcher_matches_ref():
    x = _gate_up(4, 64, torch.float32)
    torch.testing.assert_close(silu_and_mul(x), silu_and_mul_ref(x), atol=1e-6, rtol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_silu_and_mul_cuda(dtype):
    x = _gate_up(33, 14336, dtype)
    torch.testing.assert_close(silu_and_mul_triton(x.cuda()).cpu(), silu_and_mul_ref(x), atol=TOL[dtype][0],
                               rtol=TOL[dtype][1])
