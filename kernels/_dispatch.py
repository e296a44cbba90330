"""The one rule every kernel dispatcher follows: Triton on CUDA, or anywhere under the interpreter."""
import os

import torch


def use_triton(t: torch.Tensor) -> bool:
    """True when `t` lives on CUDA or TRITON_INTERPRET=1 (set before triton was first imported)."""
    return t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()
