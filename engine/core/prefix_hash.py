"""Block hashes for prefix caching: a chain over the tokens of each full KV block.

A full block's hash commits to every token before it (the parent's hash is part of its input) and to
whatever else decides its KV content: the model and the request's cache salt (`namespace`, folded into
the first block). Two requests share a block exactly when their first (i+1) * block_size tokens and
namespaces are equal.

The hash is SHA-256 of a canonical byte string, truncated to 64 bits: stable across processes and
machines (Python's `hash` is not for strings), so a router can compute the same hashes a replica
reports and route by prefix overlap (issue 34, cache-aware routing). 64 bits: a collision among a
cache's blocks is ~n^2 / 2^65, 1e-8 for a million blocks; a collision would serve another prefix's KV,
so callers that need more can widen it (the width is part of the namespace's wire format, not of callers).
"""
from __future__ import annotations

import hashlib
import struct

ROOT = 0  # the parent of a prompt's first block


def namespace_hash(model: str, cache_salt: str | None = None) -> int:
    """What besides the tokens decides a block's KV: the model (its identity, as the engine names it) and
    the request's cache salt (requests with different salts never share blocks)."""
    digest = hashlib.sha256(b"tandem-prefix-v1\0" + model.encode() + b"\0" + (cache_salt or "").encode()).digest()
    return int.from_bytes(digest[:8], "little")


def block_hash(parent: int, tokens: list[int] | tuple[int, ...], namespace: int) -> int:
    """The hash of one full block given its parent's (ROOT for the first block)."""
    payload = struct.pack(f"<QQ{len(tokens)}q", parent, namespace, *tokens)
    return int.from_bytes(hashlib.sha256(payload).digest()[:8], "little")


def extend_hashes(hashes: list[int], token_ids: list[int], block_size: int, namespace: int) -> list[int]:
    """Append the hashes of the full blocks of `token_ids` not yet in `hashes` (in place; returned)."""
    full = len(token_ids) // block_size
    parent = hashes[-1] if hashes else ROOT
    for b in range(len(hashes), full):
        parent = block_hash(parent, token_ids[b * block_size:(b + 1) * block_size], namespace)
        hashes.append(parent)
    return hashes


def reusable_prompt_hashes(token_ids, block_size: int, model: str, cache_salt: str | None = None) -> list[int]:
    """The chain hashes of a prompt's blocks an engine could reuse for it: its full blocks less the one with the
    last prompt token (always computed, engine/core/prefix_cache.py). What a router or a decode controller
    looks up in a worker's BlockFilter (cluster/protocol/block_filter.py)."""
    usable = max(0, (len(token_ids) - 1) // block_size)
    return extend_hashes([], list(token_ids[:usable * block_size]), block_size, namespace_hash(model, cache_salt))
