"""cluster/protocol/block_filter.py: a replica's cached block hashes as a bounded Bloom filter. Every hash put
in is found (no false negatives), the false-positive rate stays near its design at and past the size cap,
a chain match stops at the first miss, and a malformed wire form is a typed error naming the field."""
from __future__ import annotations

import random

import pytest

from cluster.errors import ProtocolError
from cluster.protocol.block_filter import MAX_BITS, MIN_BITS, BlockFilter, filter_bits, read_bits


def _hashes(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.getrandbits(64) for _ in range(n)]


@pytest.mark.parametrize("n", [1, 7, 64, 1000, 40_000])
def test_every_hash_put_in_is_found_and_few_others_are(n):
    held, others = _hashes(n, 1), _hashes(5000, 2)
    f = BlockFilter.build(iter(held), n)
    assert len(f.bits) * 8 == filter_bits(n)
    assert all(h in f for h in held)
    false_positives = sum(h in f for h in others) / len(others)
    # 16 bits a block and 4 probes: ~0.24% until the cap (32,768 blocks); 40,000 blocks in 2^19 bits: ~0.5%
    assert false_positives < (0.01 if n <= 32_768 else 0.02), false_positives


def test_the_size_is_a_power_of_two_within_the_bounds():
    assert filter_bits(0) == filter_bits(1) == MIN_BITS
    assert filter_bits(100) == 2048  # 1600 bits, rounded up
    assert filter_bits(10**7) == MAX_BITS  # bounded whatever the cache holds


def test_an_empty_filter_holds_nothing():
    f = BlockFilter.build(iter([]), 0)
    assert f.bits == b"" and 123 not in f and f.leading_matches([1, 2]) == 0


def test_a_chain_match_stops_at_the_first_miss():
    a, b, c, d = _hashes(4, 3)
    f = BlockFilter.build(iter([a, b, d]), 3)
    assert f.leading_matches([a, b, c, d]) == 2  # d is held, but after the miss c it cannot be reused
    assert f.leading_matches([a, b]) == 2 and f.leading_matches([c, a]) == 0


@pytest.mark.parametrize("value, message", [
    ("abc", "must be bytes"),
    (b"\0" * 3, "must be a power of two of bits"),
    (b"\0" * (MIN_BITS // 16), "must be a power of two of bits"),  # below the minimum
    (b"\0" * (MAX_BITS // 4), "must be a power of two of bits"),  # above the cap
])
def test_a_malformed_filter_is_refused_with_its_field(value, message):
    with pytest.raises(ProtocolError, match=f"field 'cached_blocks' {message}"):
        read_bits(value, "prefill routing stats", "cached_blocks")
    assert read_bits(b"", "s", "f") == b""


def test_a_union_of_filters_of_different_sizes_holds_every_member():
    from cluster.protocol.block_filter import union

    small, large = _hashes(50, 1), _hashes(5000, 2)
    merged = BlockFilter(union([BlockFilter.build(small, 50).bits, BlockFilter.build(large, 5000).bits, b""]))
    assert len(merged.bits) == len(BlockFilter.build(small, 50).bits)  # folded to the smallest
    assert all(h in merged for h in small + large)
    assert union([]) == b"" and union([b""]) == b""
