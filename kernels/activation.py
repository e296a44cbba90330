"""The gated MLP's activation: silu(gate) * up of a fused gate/up projection, in one launch.

`x [T, 2 * I]` holds gate in its first half and up in its second (MergedColumnParallelLinear's layout, per
tensor-parallel shard); the result is `[T, I]`. Arithmetic as torch's `F.silu(gate) * up`, the reference: silu
computed in fp32 as g / (1 + exp(-g)) and rounded to the activation dtype, then the product computed in fp32 and
rounded once more. Two aten ops (silu, mul) on a GPU are two launches, two graph nodes per layer; the kernel is one.
"""
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels._dispatch import interpreter_bf16, next_pow2, use_triton
from kernels._launch import launch
from kernels._triton_utils import round_bf16

BLOCK = 1024  # features per program: a row of a 135M model's MLP (1536) in two, of an 8B's (14336) in fourteen


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,  # [T, 2 * I] (features contiguous)
    out_ptr,  # [T, I] contiguous
    stride_t, I,
    BLOCK_I: tl.constexpr, RNE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    ok = cols < I
    g = tl.load(x_ptr + t * stride_t + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + t * stride_t + I + cols, mask=ok, other=0.0).to(tl.float32)
    s = g / (1.0 + tl.exp(-g))
    if RNE:  # the interpreter truncates bf16 casts; the reference rounds to nearest even
        s = round_bf16(s)
    s = s.to(out_ptr.dtype.element_ty).to(tl.float32)  # silu's result in the activation dtype, as torch's
    y = s * u
    if RNE:
        y = round_bf16(y)
    tl.store(out_ptr + t * I + cols, y.to(out_ptr.dtype.element_ty), mask=ok)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    assert x.dim() == 2 and x.shape[1] % 2 == 0 and x.stride(1) == 1, (x.shape, x.stride())
    T, I = x.shape[0], x.shape[1] // 2
    out = torch.empty((T, I), dtype=x.dtype, device=x.device)
    if T and I:
        block = min(BLOCK, next_pow2(I))
        launch(_silu_and_mul_kernel, (T, triton.cdiv(I, block)), x, out, x.stride(0), I,
               BLOCK_I=block, RNE=interpreter_bf16(x), num_warps=4 if block >= 512 else 1)
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[:, :I]) * x[:, I:] for x [T, 2 * I] -> [T, I]."""
    if use_triton(x):
        return silu_and_mul_triton(x)
    return silu_and_mul_ref(x)
