"""Handovers: the engine's side of disaggregated serving. On the prefill side a prefill-only request
parks after its first token and is taken (its description and KV blocks, engine/handover.py) and then
released; on the decode side a hand-over is reserved (blocks for its KV, its matcher), filled by the
caller, and committed into the running batch, where it joins the engine's next step.
"""
from __future__ import annotations

from typing import Callable

import torch

from engine.core.block_manager import BlockManager
from engine.core.request import Request, RequestStatus
from engine.core.scheduler import Scheduler
from engine.errors import CapacityError, InvalidRequestError
from engine.handover import Handover, HandoverRequest
from engine.masking.guided import GuidedRequests
from engine.outputs import TokenLogprob
from engine.speculative.drafter import Drafter
from structured.request import SerializedGrammar


class Handovers:
    def __init__(self, requests: dict[str, Request], blocks: BlockManager, scheduler: Scheduler, drafter: Drafter,
                 guided: GuidedRequests, new_request: Callable[..., Request], block_size: int, cache_layers: int):
        """requests: the engine's requests by id (shared); new_request: the engine's validated Request
        factory (id, prompt ids, params, prefill_only, seed=...); cache_layers: layers of the engine's KV
        cache (target and shared draft layers), which both sides must agree on."""
        self._requests = requests
        self._blocks = blocks
        self._scheduler = scheduler
        self._drafter = drafter
        self._guided = guided
        self._new_request = new_request
        self._block_size = block_size
        self._cache_layers = cache_layers

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
            block_size=self._block_size, cache_layers=self._cache_layers, speculative_method=self._drafter.method)
        compiled = None
        if req.params.structured_output is not None:
            compiled = self._guided.serialized(req.params.structured_output)
        return Handover(state, list(self._blocks.table(request_id)), req.draft_hidden, compiled)

    def release(self, request_id: str) -> None:
        req = self._requests.pop(request_id, None)
        if req is not None:
            self._blocks.free(request_id)
            self._guided.release(request_id)

    def reserve(self, handover: HandoverRequest, compiled_grammar: SerializedGrammar | None = None,
                block_ids: list[int] | None = None) -> list[int]:
        """Decode side: allocate blocks for an incoming request's prompt KV; raises CapacityError if full.
        compiled_grammar: Handover.compiled_grammar of a guided request (else its grammar is compiled here).
        block_ids: blocks set aside earlier (BlockManager.set_aside) that already hold the KV: they become
        the request's table instead of allocating; if reserve raises they are the caller's again."""
        if handover.cache_layers != self._cache_layers:
            raise InvalidRequestError(f"the hand-over carries KV for {handover.cache_layers} cache layers but this "
                                      f"engine's cache has {self._cache_layers} (speculation differs "
                                      f"between the two sides)", param="handover")
        if handover.block_size != self._block_size:
            raise InvalidRequestError(f"the hand-over's KV blocks hold {handover.block_size} tokens, this engine's "
                                      f"{self._block_size}", param="handover")
        req = self._new_request(handover.request_id, list(handover.prompt_token_ids), handover.params, False,
                                seed=handover.seed)
        n = handover.num_computed_tokens
        if block_ids is not None:
            self._blocks.adopt(req.request_id, block_ids, n)
        elif not self._blocks.allocate(req.request_id, n):
            raise CapacityError(f"no room for {n} tokens of KV ({self._blocks.pool.num_free} free blocks)")
        req.num_computed_tokens = n
        req.logprobs = [TokenLogprob(t, lp, top) for t, lp, top in handover.logprobs]
        req.token_ids.extend(handover.output_token_ids)
        if req.detokenizer is not None:
            req.detokenizer.push(handover.output_token_ids)
        try:
            self._guided.add(req, compiled_grammar)
        except InvalidRequestError:
            if block_ids is not None:
                self._blocks.disown(req.request_id)
            else:
                self._blocks.free(req.request_id)
            raise
        req.metrics.num_output_tokens = req.num_output_tokens
        req.status = RequestStatus.RESERVED
        self._requests[req.request_id] = req
        return list(self._blocks.table(req.request_id))

    def commit(self, request_id: str, hidden: torch.Tensor | None = None) -> None:
        """Decode side: the received KV is in place; the request joins the running batch. `hidden` is
        the hand-over's draft-head input (Handover.hidden): with it, the request's first step already
        verifies a full set of drafts."""
        req = self._requests[request_id]
        assert req.status is RequestStatus.RESERVED, req.status
        self._scheduler.add_running(req)
        self._drafter.arrive(req, hidden)
