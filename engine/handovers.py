"""Handovers: the engine's side of disaggregated serving. On the prefill side a prefill-only request
parks after its first token and is taken (its description and KV blocks, engine/handover.py) and then
released; on the decode side a hand-over is reserved (blocks for its KV, its matcher), filled by the
caller, and committed into the running batch, where it joins the engine's next step.

Prefix caching through the hand-over (vLLM's KV connectors ask the decode side's cache the same way before
pulling): before the payload moves, the decode side `pin`s the leading blocks of the prompt its own prefix
cache holds (a reference each, so no eviction can take them while the payload is coming) and says how many;
the prefill sends only the rest (HandoverRequest.reused_blocks), and `reserve` builds the table from the
pinned blocks and new ones for the payload. A pin is consumed by `reserve` (kept or given back) or dropped by
`unpin` (the request was cancelled, or its hand-over failed before reserving). Handed-over full blocks join
the cache as the request's first steps make their KV final (PrefixCache.progress), so later requests and next
turns find them. Pinned blocks come from this engine's own cache, registered with their draft head's KV
final (PrefixCache's draft_lag), so reusing them is as valid for speculation as for the target.
"""
from __future__ import annotations

from typing import Callable

from engine.core.block_manager import BlockManager
from engine.core.request import Request, RequestStatus
from engine.core.scheduler import Scheduler
from engine.errors import CapacityError, InvalidRequestError
from engine.handover import Handover, HandoverDrafts, HandoverRequest, max_reusable_blocks
from engine.layers.kv_spec import KVCacheSpec
from engine.masking.guided import GuidedRequests
from engine.outputs import TokenLogprob
from engine.speculative.drafter import Drafter
from structured.request import SerializedGrammar


class Handovers:
    def __init__(self, requests: dict[str, Request], blocks: BlockManager, scheduler: Scheduler, drafter: Drafter,
                 guided: GuidedRequests, new_request: Callable[..., Request], block_size: int, cache_layers: int,
                 cache_spec: KVCacheSpec):
        """requests: the engine's requests by id (shared); new_request: the engine's validated Request
        factory (id, prompt ids, params, prefill_only, seed=...); cache_layers: layers of the engine's KV
        cache (target and shared draft layers) and cache_spec what each caches per token (planes, head width),
        which both sides must agree on."""
        self._requests = requests
        self._blocks = blocks
        self._scheduler = scheduler
        self._drafter = drafter
        self._guided = guided
        self._new_request = new_request
        self._block_size = block_size
        self._cache_layers = cache_layers
        self._cache_spec = cache_spec
        self._pinned: dict[str, list[int]] = {}  # request id -> leading prompt blocks held for its hand-over
        self.blocks_reused = 0  # hand-over blocks found here instead of received
        self.blocks_received = 0  # hand-over blocks whose KV came with a payload

    def take(self, request_id: str) -> Handover:
        """A parked (prefilled) request's description and blocks; they stay held until release()."""
        req = self._requests.get(request_id)
        if req is None or req.status is not RequestStatus.PARKED:
            raise InvalidRequestError(f"request {request_id!r} is not parked for a hand-over")
        if not self._drafter.shares_cache:
            raise InvalidRequestError("this engine's draft model keeps its KV in a cache of its own; "
                                      "hand-overs need the draft's KV layers in the target's cache")
        state = HandoverRequest(
            request_id=req.request_id, prompt_token_ids=tuple(req.prompt_token_ids),
            output_token_ids=tuple(req.output_token_ids), num_computed_tokens=req.num_computed_tokens,
            seed=req.seed, params=req.params, logprobs=tuple((lp.token_id, lp.logprob, lp.top) for lp in req.logprobs),
            block_size=self._block_size, cache_layers=self._cache_layers, cache_planes=self._cache_spec.planes,
            cache_head_dim=self._cache_spec.head_dim, speculative_method=self._drafter.method)
        compiled = None
        if req.params.structured_output is not None:
            compiled = self._guided.serialized(req.params.structured_output)
        return Handover(state, list(self._blocks.table(request_id)), compiled, req.handover_drafts)

    def release(self, request_id: str) -> None:
        req = self._requests.pop(request_id, None)
        if req is not None:
            self._blocks.free(request_id)
            self._guided.release(request_id)

    # ------------------------------------------------------------------ decode side
    def pin(self, request_id: str, prompt_token_ids: list[int], cache_salt: str | None = None) -> int:
        """Hold the leading blocks of an expected hand-over's prompt that this engine's prefix cache has (all
        but the block with the last prompt token, at most); -> how many. 0 without prefix caching."""
        if request_id in self._pinned or request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use on this engine")
        prefix_cache = self._scheduler.prefix_cache
        if prefix_cache is None or len(prompt_token_ids) <= self._block_size:
            return 0
        usable = prefix_cache.prompt_hashes(prompt_token_ids[:max_reusable_blocks(len(prompt_token_ids),
                                                                                   self._block_size) * self._block_size],
                                            cache_salt)
        hits = self._blocks.pool.lookup(usable)
        if hits:
            self._blocks.pool.touch(hits)
            self._pinned[request_id] = hits
        return len(hits)

    def unpin(self, request_id: str) -> None:
        """Give back what `pin` holds for a request whose hand-over will not be reserved (idempotent)."""
        held = self._pinned.pop(request_id, None)
        if held:
            self._blocks.pool.give_back(list(reversed(held)))

    @property
    def num_pinned(self) -> int:
        """Requests holding pinned blocks that no hand-over has reserved yet."""
        return len(self._pinned)

    def reserve(self, handover: HandoverRequest, compiled_grammar: SerializedGrammar | None = None,
                block_ids: list[int] | None = None) -> list[int]:
        """Decode side: allocate blocks for an incoming request's prompt KV; raises CapacityError if full.
        compiled_grammar: Handover.compiled_grammar of a guided request (else its grammar is compiled here).
        block_ids: blocks set aside earlier (BlockManager.set_aside) that already hold the KV: they become
        the request's table (after its reused blocks) instead of allocating; if reserve raises they are the
        caller's again. -> the blocks the payload fills: the table past its `reused_blocks` pinned ones.
        The request's pin is consumed: its first `reused_blocks` blocks are kept, the rest given back."""
        pinned = self._pinned.pop(handover.request_id, [])
        try:
            return self._reserve(handover, compiled_grammar, block_ids, pinned)
        except BaseException:
            self._blocks.pool.give_back(list(reversed(pinned)))
            raise

    def _reserve(self, handover: HandoverRequest, compiled_grammar: SerializedGrammar | None,
                 block_ids: list[int] | None, pinned: list[int]) -> list[int]:
        if handover.cache_layers != self._cache_layers:
            raise InvalidRequestError(f"the hand-over carries KV for {handover.cache_layers} cache layers but this "
                                      f"engine's cache has {self._cache_layers} (speculation differs "
                                      f"between the two sides)", param="handover")
        spec = self._cache_spec
        if (handover.cache_planes, handover.cache_head_dim) != (spec.planes, spec.head_dim):
            raise InvalidRequestError(f"the hand-over's KV is {handover.cache_planes} plane(s) of "
                                      f"{handover.cache_head_dim}-wide heads per token and layer, this engine caches "
                                      f"{spec.planes} of {spec.head_dim} (another model)", param="handover")
        if handover.block_size != self._block_size:
            raise InvalidRequestError(f"the hand-over's KV blocks hold {handover.block_size} tokens, this engine's "
                                      f"{self._block_size}", param="handover")
        req = self._new_request(handover.request_id, list(handover.prompt_token_ids), handover.params, False,
                                seed=handover.seed)
        reused = self._reused(handover, pinned)
        self._blocks.pool.give_back(list(reversed(pinned[reused:])))  # pinned beyond what the prefill skipped
        del pinned[reused:]
        n = handover.num_computed_tokens
        if block_ids is not None:
            self._blocks.adopt(req.request_id, pinned + block_ids, n)
        else:
            self._blocks.attach(req.request_id, pinned)
        pinned.clear()  # the table holds them now: failures below release them through it
        if block_ids is None and not self._blocks.allocate(req.request_id, n):
            self._blocks.free(req.request_id)
            raise CapacityError(f"no room for {n} tokens of KV ({self._blocks.pool.num_free} free blocks)")
        req.num_computed_tokens = n
        req.num_cached_blocks = reused  # registered already: the prefix cache registers the received ones
        req.logprobs = [TokenLogprob(t, lp, top) for t, lp, top in handover.logprobs]
        req.token_ids.extend(handover.output_token_ids)
        if req.detokenizer is not None:
            req.detokenizer.push(handover.output_token_ids)
        try:
            self._guided.add(req, compiled_grammar)
        except InvalidRequestError:
            if block_ids is not None:
                self._blocks.disown(req.request_id, held=reused)
            else:
                self._blocks.free(req.request_id)
            raise
        req.metrics.num_output_tokens = req.num_output_tokens
        req.status = RequestStatus.RESERVED
        self._requests[req.request_id] = req
        self.blocks_reused += reused
        self.blocks_received += handover.num_blocks - reused
        return list(self._blocks.table(req.request_id)[reused:])

    def _reused(self, handover: HandoverRequest, pinned: list[int]) -> int:
        """How many pinned blocks the hand-over relies on; InvalidRequestError if it relies on more than are
        pinned or on blocks that hold another prompt (the prefill and this side disagree: a protocol bug)."""
        reused = handover.reused_blocks
        if reused > len(pinned):
            raise InvalidRequestError(f"the hand-over of {handover.request_id!r} reuses {reused} leading blocks but "
                                      f"this engine holds {len(pinned)} of its prompt", param="handover")
        if reused:
            prefix_cache = self._scheduler.prefix_cache
            hashes = prefix_cache.prompt_hashes(list(handover.prompt_token_ids[:reused * self._block_size]),
                                                handover.params.cache_salt)
            if [self._blocks.pool.hash_of(b) for b in pinned[:reused]] != hashes:
                raise InvalidRequestError(f"the blocks pinned for {handover.request_id!r} hold another prompt than "
                                          f"its hand-over's", param="handover")
        return reused

    def commit(self, request_id: str, drafts: HandoverDrafts | None = None) -> None:
        """Decode side: the received KV is in place; the request joins the running batch. `drafts` are the
        hand-over's first drafts (Handover.drafts): its first step verifies them, as any request's (without
        them it starts with none)."""
        req = self._requests[request_id]
        assert req.status is RequestStatus.RESERVED, req.status
        self._scheduler.add_running(req)
        if drafts is not None:
            self._drafter.received(req, drafts)
