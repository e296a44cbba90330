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
  one, and a request that reuses it drafts exactly as it would have after computing it. Where the head's pass
  was deferred (engine/speculative/deferred_kv.py), blocks are final only once it caught up.

Grammar state is per request and not cached; preemption frees a request's references (free blocks stay
cached), so a preempted request usually gets its own prefix back on re-admission.

In-batch sharing (SGLang defers in the same spirit): requests that arrive together with the same prefix would
all compute it, none being cached yet. A request whose next uncached block is being computed right now by a
running request waits (`admit` says DEFER) and is admitted once that block is registered, as a hit: the
prefix is computed once (this is also how `n` children of one prompt share it). Waiting costs the request a
step or more of latency, so it waits only for a shared run of at least `min_wait_tokens` (SGLang checks a
threshold too): a chat template's few shared tokens are cheaper to compute again than to wait for.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.core.block_manager import BlockManager
from engine.core.prefix_hash import extend_hashes, namespace_hash
from engine.core.request import Request, RequestStatus

DEFER = -1  # admit(): not now, a running request is computing this one's next blocks
MIN_WAIT_TOKENS = 128  # the shortest shared run being computed that a request waits for


@dataclass(slots=True)
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up at admission
    hits: int = 0  # of those, tokens whose KV was reused
    deferred: int = 0  # admissions put off until a running request's blocks were cached

    @property
    def hit_rate(self) -> float | None:
        return self.hits / self.queries if self.queries else None


class PrefixCache:
    def __init__(self, blocks: BlockManager, model: str, draft_lag: int = 0, min_wait_tokens: int = MIN_WAIT_TOKENS):
        self.blocks = blocks
        self.min_wait_blocks = max(1, -(-min_wait_tokens // blocks.block_size))
        self.block_size = blocks.block_size
        self.model = model
        self.draft_lag = draft_lag
        self.stats = PrefixCacheStats()
        self._namespaces: dict[str | None, int] = {}
        self._computing: dict[int, Request] = {}  # hash of a block not cached yet -> the running request computing it

    def admit(self, req: Request) -> int:
        """Start a block-less request at its longest cached prefix; -> tokens reused, or DEFER when a running
        request is computing its next block (it is admitted later, with that block as a hit)."""
        if self.blocks.table(req.request_id) or req.num_computed_tokens:
            return 0
        usable = self._hashes(req)[: (req.num_tokens - 1) // self.block_size]
        hit = len(self.blocks.pool.lookup(usable))
        if self._worth_waiting(usable, hit, req):
            self.stats.deferred += 1
            return DEFER
        reused = self.blocks.allocate_cached(req.request_id, usable, max_blocks=len(usable))
        req.num_computed_tokens = reused
        req.num_cached_blocks = reused // self.block_size
        for h in usable[hit:]:  # the blocks this request computes; others with the same prefix wait for them
            self._computing.setdefault(h, req)
        self.stats.queries += req.num_tokens
        self.stats.hits += reused
        return reused

    def _worth_waiting(self, usable: list[int], hit: int, req: Request) -> bool:
        """Running requests are computing at least min_wait_blocks of this request's next blocks."""
        end = hit + self.min_wait_blocks
        return end <= len(usable) and all(self._being_computed(h, req) for h in usable[hit:end])

    def _being_computed(self, block_hash: int, req: Request) -> bool:
        owner = self._computing.get(block_hash)
        if owner is None or owner is req:
            return False
        if owner.status is not RequestStatus.RUNNING:  # finished, parked, preempted: it will not register it now
            del self._computing[block_hash]
            return False
        return True

    def cancel(self, req: Request, reused: int) -> None:
        """Undo `admit` for a request that could not be admitted after all (its blocks go back)."""
        self.forget(req)
        self.blocks.free(req.request_id)
        req.num_computed_tokens = req.num_cached_blocks = 0
        self.stats.queries -= req.num_tokens
        self.stats.hits -= reused

    def progress(self, req: Request) -> int:
        """Register the request's blocks whose KV is now final; -> blocks newly cached."""
        if req.status is RequestStatus.RESERVED:  # a hand-over whose KV has not landed: its blocks hold nothing yet
            return 0
        final = req.num_computed_tokens - self.draft_lag
        if req.draft_holes_from is not None:  # the head's KV deferred from there (deferred_kv.py): not final yet
            final = min(final, req.draft_holes_from)
        if final < self.block_size:
            return 0
        done, upto = req.num_cached_blocks, final // self.block_size
        if upto <= done:
            return 0
        hashes = self._hashes(req)
        new = self.blocks.cache_blocks(req.request_id, hashes, final, start=done)
        req.num_cached_blocks = upto
        if self._computing:
            for h in hashes[done:upto]:
                if self._computing.get(h) is req:
                    del self._computing[h]
        return new

    def forget(self, req: Request) -> None:
        """The request stops computing (finished, preempted): nobody waits on its blocks any more."""
        if self._computing:
            for h in req.block_hashes[req.num_cached_blocks:]:
                if self._computing.get(h) is req:
                    del self._computing[h]

    def prompt_hashes(self, token_ids: list[int], cache_salt: str | None = None) -> list[int]:
        """The chain hashes of a prompt's full blocks, as a request with that salt would have them (a decode
        side looking up what it holds of a prompt before its hand-over comes)."""
        return extend_hashes([], list(token_ids), self.block_size, self._namespace(cache_salt))

    def _hashes(self, req: Request) -> list[int]:
        return extend_hashes(req.block_hashes, req.token_ids, self.block_size, self._namespace(req.params.cache_salt))

    def _namespace(self, salt: str | None) -> int:
        ns = self._namespaces.get(salt)
        if ns is None:
            ns = self._namespaces[salt] = namespace_hash(self.model, salt)
        return ns
