"""BlockFilter: what a replica's prefix cache holds, as a Bloom filter of its cached blocks' chain hashes
(engine/core/prefix_hash.py), for cache-aware routing (router/prefix_affinity.py).

Why a filter and not the hashes: a pool of 100,000 blocks is 800 KB of hashes, and Serve polls every
replica's routing stats twice a second and hands them to every router. The filter's size is bounded
(MAX_BITS: 64 KiB on the wire) whatever the cache holds; it is sized at BITS_PER_BLOCK bits per cached
block (false positives ~0.2% with 4 probes) until the cap, past which they grow (~9% at 100,000 blocks).
A false positive can only lengthen a prefix match (the router stops at the first miss of the chain, and
each further block must be a false positive too), so the cost is an occasional routing choice a little
worse than ideal, never a wrong result: the replica looks its blocks up itself.

Wire form: the bit array as bytes, bit i at byte i >> 3, bit i & 7 (numpy's little bit order); empty
bytes for a replica with prefix caching off. The i-th probe of hash h (64 bits, already uniform) is
(lo + i * hi) mod m with lo, hi its 32-bit halves (hi made odd): double hashing, no further hashing needed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from cluster.protocol import wire

NUM_PROBES = 4
BITS_PER_BLOCK = 16
MIN_BITS = 1 << 10
MAX_BITS = 1 << 19
_LOW32 = (1 << 32) - 1


def filter_bits(num_blocks: int) -> int:
    """The filter's size for num_blocks cached blocks: a power of two in [MIN_BITS, MAX_BITS]."""
    want = max(MIN_BITS, num_blocks * BITS_PER_BLOCK)
    return min(MAX_BITS, 1 << (want - 1).bit_length())


def _probes(block_hash: int, mask: int) -> list[int]:
    lo, hi = block_hash & _LOW32, (block_hash >> 32) | 1
    return [(lo + i * hi) & mask for i in range(NUM_PROBES)]


@dataclass(frozen=True, slots=True)
class BlockFilter:
    bits: bytes  # the bit array; b"": nothing cached, or prefix caching off

    @staticmethod
    def build(hashes: Iterable[int], num_hashes: int) -> "BlockFilter":
        """The filter of `num_hashes` block hashes (vectorised: a replica builds it at every stats poll)."""
        import numpy as np  # the router only reads filters; numpy stays off its import path

        if num_hashes == 0:
            return BlockFilter(b"")
        m = filter_bits(num_hashes)
        h = np.fromiter(hashes, dtype=np.uint64, count=num_hashes)  # [num_hashes]
        lo, hi = h & np.uint64(_LOW32), (h >> np.uint64(32)) | np.uint64(1)
        bitset = np.zeros(m, dtype=bool)  # [m]
        for i in range(NUM_PROBES):  # uint64 arithmetic wraps mod 2^64, which keeps the low bits exact
            bitset[((lo + np.uint64(i) * hi) & np.uint64(m - 1)).astype(np.int64)] = True
        return BlockFilter(np.packbits(bitset, bitorder="little").tobytes())

    def __contains__(self, block_hash: int) -> bool:
        if not self.bits:
            return False
        mask = len(self.bits) * 8 - 1
        return all(self.bits[p >> 3] >> (p & 7) & 1 for p in _probes(block_hash, mask))

    def leading_matches(self, hashes: list[int]) -> int:
        """How many of a prompt's leading block hashes (a chain) the filter holds: the first miss ends it."""
        for n, h in enumerate(hashes):
            if h not in self:
                return n
        return len(hashes)


def union(filters: list[bytes]) -> bytes:
    """One filter holding every block of `filters` (a decode group's ranks): each folded to the smallest size
    and OR-ed. Folding is exact because a probe is its hash arithmetic masked by the size, a power of two: bit
    p of a filter of M bits is bit p mod m of the same filter at m bits, m dividing M."""
    import numpy as np

    filters = [f for f in filters if f]
    if not filters:
        return b""
    m = min(len(f) for f in filters) * 8
    out = np.zeros(m, dtype=bool)
    for f in filters:
        bits = np.unpackbits(np.frombuffer(f, dtype=np.uint8), bitorder="little")
        out |= bits.reshape(-1, m).any(axis=0).astype(bool)
    return np.packbits(out, bitorder="little").tobytes()


def read_bits(value, name: str, field: str) -> bytes:
    """A filter's wire form, checked: bytes whose bit count is 0 or a power of two in [MIN_BITS, MAX_BITS]."""
    wire.check(type(value) is bytes, name, field, "bytes (a block filter)", value)
    bits = len(value) * 8
    wire.check(bits == 0 or (MIN_BITS <= bits <= MAX_BITS and bits & (bits - 1) == 0), name, field,
               f"a power of two of bits in [{MIN_BITS}, {MAX_BITS}] (a block filter)", f"{bits} bits")
    return value
