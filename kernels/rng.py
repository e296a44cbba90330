"""Counter-based random numbers shared by every sampler in Tandem.

A uniform number is a pure function of (seed, position, index, stream): no generator state, so
  - the same seed gives the same tokens whatever else is in the batch (batch invariance),
  - it is computable inside a kernel or a CUDA graph without a host round trip,
  - the torch reference here and the Triton kernels produce bit-identical numbers.

All arithmetic is on 32-bit words held in int64 tensors (torch) or uint32 (Triton). Multiplications
are split so that no int64 product overflows; the low 32 bits equal a native uint32 multiply.
The mixer is the "lowbias32" integer hash (C. Wellons, public domain constants).

Streams separate independent uses at the same position (sampling, acceptance tests, residual
sampling, draft sampling) so that they never reuse a number.
"""
import torch

MASK32 = 0xFFFFFFFF
MIX_C1 = 0x7FEB352D
MIX_C2 = 0x846CA68B
GOLDEN = 0x9E3779B9

# Stream ids (salts). Keep in sync with kernels that draw numbers.
STREAM_SAMPLE = 0  # sampling a token from the (target) distribution
STREAM_ACCEPT = 1  # acceptance test u < p/q in rejection sampling
STREAM_RESIDUAL = 2  # sampling from the residual max(0, p - q) after a rejection
STREAM_DRAFT = 3  # reserved: drafts now race on STREAM_SAMPLE at their target position (coupled drafts,
#                   engine/speculative/proposer.py); kept so that the other streams' ids never move


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x in [0, 2**32) without int64 overflow."""
    c_lo, c_hi = c & 0xFFFF, c >> 16
    return (x * c_lo + (((x * c_hi) & 0xFFFF) << 16)) & MASK32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 finalizer on int64 tensors holding uint32 values."""
    x = x ^ (x >> 16)
    x = _mul32(x, MIX_C1)
    x = x ^ (x >> 15)
    x = _mul32(x, MIX_C2)
    x = x ^ (x >> 16)
    return x


def hash_key(seed: torch.Tensor, position: torch.Tensor, stream: int) -> torch.Tensor:
    """Per-row key from a 64-bit seed, a token position and a stream id. All int64, same shape."""
    seed_lo = seed & MASK32
    seed_hi = (seed >> 32) & MASK32
    h = mix32((seed_hi + (stream * GOLDEN)) & MASK32)
    h = mix32(seed_lo ^ h)
    h = mix32(h ^ (position & MASK32))
    return h


def uniform_from_key(key: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Uniform float32 in (0, 1) from a row key and an element index (int64, broadcastable).

    23 random bits map to (k + 0.5) / 2**23, which is exact in float32 and never 0 or 1, so
    -log(u) is finite and positive. (With 24 bits, k + 0.5 past 2**23 rounds to an integer in float32
    and k = 2**24 - 1 gave u = 1: zero noise, so a masked token's 0 / 0 = NaN won the argmax.)
    """
    return unit_interval(mix32(key ^ (index & MASK32)))


def unit_interval(h: torch.Tensor) -> torch.Tensor:
    """32-bit hashes (int64 holding 0 .. 2**32 - 1) -> float32 in (0, 1), strictly inside."""
    return ((h >> 9).to(torch.float32) + 0.5) * (1.0 / 8388608.0)


def uniform(seed: torch.Tensor, position: torch.Tensor, n: int, stream: int) -> torch.Tensor:
    """[rows, n] uniforms: row r uses (seed[r], position[r]); column j is element index j."""
    key = hash_key(seed.to(torch.int64), position.to(torch.int64), stream)
    idx = torch.arange(n, device=seed.device, dtype=torch.int64)
    return uniform_from_key(key[:, None], idx[None, :])


def exponential(seed: torch.Tensor, position: torch.Tensor, n: int, stream: int) -> torch.Tensor:
    """[rows, n] Exp(1) noise; argmax(p / E) samples from p (the exponential race, no host sync)."""
    return -torch.log(uniform(seed, position, n, stream))
