"""Small Triton helpers shared by the kernels."""
import triton
import triton.language as tl


@triton.jit
def round_bf16(x):
    """fp32 -> the nearest-even fp32 value representable in bf16, so a later truncating cast (the
    interpreter's) is exact. GPUs do not need it: their cast already rounds to nearest even."""
    u = x.to(tl.uint32, bitcast=True)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.to(tl.float32, bitcast=True)
