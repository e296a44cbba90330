"""The one rule every kernel dispatcher follows: Triton on CUDA; on CPU the torch reference, unless
TANDEM_TRITON_ON_CPU=1 asks for the Triton kernels (which then need TRITON_INTERPRET=1, set before
triton was first imported). Tests of the kernels call the `*_triton` entry points directly; the
engine's CPU path stays on the fast references even when the interpreter is enabled for a test run."""
import os

import torch

from kernels._launch import on_gpu

# Read once: the dispatcher runs several times per layer per step.
_TRITON_ON_CPU = os.environ.get("TANDEM_TRITON_ON_CPU") == "1" and os.environ.get("TRITON_INTERPRET") == "1"


def use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda or _TRITON_ON_CPU


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def interpreter_bf16(x: torch.Tensor) -> bool:
    """The Triton interpreter truncates fp32 -> bf16 casts (GPUs round to nearest even); kernels
    take this as a constexpr and round explicitly first (see _triton_utils.round_bf16)."""
    return x.dtype == torch.bfloat16 and not on_gpu(x)
