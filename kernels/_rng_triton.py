"""kernels/rng.py inside Triton kernels: the same lowbias32 hash on native uint32 (multiplies wrap),
so every uniform is bit-identical to the torch reference's split-multiply version."""
import triton
import triton.language as tl

from kernels import rng


def stream_salt(stream: int) -> int:
    """The per-stream constant added to the seed's high word, reduced mod 2**32 on the host."""
    return (stream * rng.GOLDEN) & rng.MASK32


@triton.jit
def mix32(x):
    """lowbias32 finalizer on uint32 values."""
    x = x ^ (x >> 16)
    x = x * tl.full([], 0x7FEB352D, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full([], 0x846CA68B, tl.uint32)
    x = x ^ (x >> 16)
    return x


@triton.jit
def hash_key(seed, position, SALT: tl.constexpr):
    """Row key from an int64 seed, an int64 position and a stream salt (see stream_salt)."""
    seed = seed.to(tl.int64)
    seed_lo = (seed & 0xFFFFFFFF).to(tl.uint32)
    seed_hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    h = mix32(seed_hi + tl.full([], SALT, tl.uint32))
    h = mix32(seed_lo ^ h)
    return mix32(h ^ (position.to(tl.int64) & 0xFFFFFFFF).to(tl.uint32))


@triton.jit
def uniform(key, index):
    """Uniform float32 in (0, 1) from a uint32 key and an integer element index (any shape)."""
    h = mix32(key ^ (index.to(tl.int64) & 0xFFFFFFFF).to(tl.uint32))
    return ((h >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)  # 23 bits: see rng.uniform_from_key
