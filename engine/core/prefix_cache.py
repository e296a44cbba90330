"""The engine's prefix cache: which blocks a request can reuse when it is admitted, and which of its
blocks become reusable as its KV is computed (the pool's mechanics are in block_manager.py).

Two hooks, both host bookkeeping with no tensors:
- `admit(req)`, when the scheduler admits a request that holds no blocks (new, or back after a
  preemption): its table starts with the longest cached prefix and its computed tokens start past it,
  so the step computes only the rest. The block holding the request's last token is never reused:
  that token's logits are needed, and computing it must not write into a block others read.
- `progress(req)`, after each step's update: full blocks whose KV is final are registered. A draft head
  with KV of its own (MTP, EAGLE-3) writes a position's KV once the next token is known, so its blocks
  are final one token later (`draft_lag`): a cached block always carries the head's KV too, never a stale
  one, and a request that reuses it drafts exactly as it would have after computing it.

Grammar state is per request and not cached; preemption frees a request's references (free blocks stay
cached), so a preempted request usually gets its own prefix back on re-admission.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.core.block_manager import BlockManager
from engine.core.prefix_hash import extend_hashes, namespace_hash
from engine.core.request import Request


@dataclass(slots=True)
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up at admission
    hits: int = 0  # of those, tokens whose KV was reused

    @property
    def hit_rate(self) -> float | None:
        return self.hits / self.queries if self.queries else None


class PrefixCache:
    def __init__(self, blocks: BlockManager, model: str, draft_lag: int = 0):
        self.blocks = blocks
        self.block_size = blocks.block_size
        self.model = model
        self.draft_lag = draft_lag
        self.stats = PrefixCacheStats()
        self._namespaces: dict[str | None, int] = {}

    def admit(self, req: Request) -> int:
        """Start a block-less request at its longest cached prefix; -> tokens reused."""
        if self.blocks.table(req.request_id) or req.num_computed_tokens:
            return 0
        hashes = self._hashes(req)
        reused = self.blocks.allocate_cached(req.request_id, hashes, max_blocks=(req.num_tokens - 1) // self.block_size)
        req.num_computed_tokens = reused
        self.stats.queries += req.num_tokens
        self.stats.hits += reused
        return reused

    def cancel(self, req: Request, reused: int) -> None:
        """Undo `admit` for a request that could not be admitted after all (its blocks go back)."""
        self.blocks.free(req.request_id)
        req.num_computed_tokens = 0
        self.stats.queries -= req.num_tokens
        self.stats.hits -= reused

    def progress(self, req: Request) -> int:
        """Register the request's blocks whose KV is now final; -> blocks newly cached."""
        final = req.num_computed_tokens - self.draft_lag
        if final < self.block_size:
            return 0
        return self.blocks.cache_blocks(req.request_id, self._hashes(req), final)

    def _hashes(self, req: Request) -> list[int]:
        salt = req.params.cache_salt
        ns = self._namespaces.get(salt)
        if ns is None:
            ns = self._namespaces[salt] = namespace_hash(self.model, salt)
        return extend_hashes(req.block_hashes, req.token_ids, self.block_size, ns)
