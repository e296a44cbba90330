"""LoadAwareRequestRouter: Serve's request-routing hook for the policy in router/policy.py.

Serve pickles this module by value into every process that holds a handle, so it keeps no module state of
its own: scores, the per-replica load snapshot and the routing counters live in router.policy and
router.prefix_affinity (pickled by reference); the one instance per handle holds its PrefillRouting.
"""
from __future__ import annotations

from typing import Any

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

from router.policy import demote, load_of, rank_decode, record_stats
from router.prefix_affinity import (PrefillRouting, ReplicaState, count_decode_decision, decode_prompt,
                                    prefill_prompt, prompt_hashes)


class LoadAwareRequestRouter(FIFOMixin, RequestRouter):
    """Orders replicas by score (prefill: prefix overlap and load; decode: load and the prompt blocks its group
    holds); Serve then takes the first that accepts."""

    def initialize_state(self, role: str = "decode", prefix_aware: bool = True, **kwargs: Any) -> None:
        self.role = role
        self.prefix_aware = prefix_aware
        self._prefill = PrefillRouting(prefix_aware) if role == "prefill" else None

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        # A call about one request already placed (its cancel) or a replica's feed names that replica: it goes
        # there while Serve lists it, else anywhere (a replica that never held the request ignores the cancel,
        # and refuses a feed meant for another replica: the router then ends the lost replica's requests).
        pinned = pending_request.kwargs.get("replica") if pending_request is not None else None
        if pinned:
            chosen = [r for r in candidate_replicas if r.replica_id.unique_id == pinned]
            if chosen:
                return [chosen]
        snapshot = {r.replica_id.unique_id: r.routing_stats or {} for r in candidate_replicas}
        record_stats(self.role, snapshot, replace=False)
        if self._prefill is not None:
            return self._rank_prefill(candidate_replicas, pending_request)
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        cands = [(rid, load_of(self.role, snapshot[rid]), self.replica_queue_len_cache.get(r.replica_id) or 0)
                 for rid, r in by_id.items()]
        prompt = None
        if pending_request is not None and self.prefix_aware:
            prompt = decode_prompt(pending_request.metadata.call_method, pending_request.args)
        hashes: dict[tuple[int, str], list[int]] = {}

        def hashes_of(block_size: int, model: str) -> list[int] | None:
            if prompt is None:
                return None
            if (block_size, model) not in hashes:
                hashes[block_size, model] = prompt_hashes(prompt, block_size, model)
            return hashes[block_size, model]

        ranked, outcome = rank_decode(cands, hashes_of)
        if prompt is not None:
            count_decode_decision(outcome)
        if pending_request is not None:
            ranked = demote(ranked, pending_request.kwargs.get("avoid"))
        return [[by_id[rid]] for rid in ranked]

    def _rank_prefill(self, candidate_replicas: list[RunningReplica],
                      pending_request: PendingRequest | None) -> list[list[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        states = [ReplicaState(rid, r.routing_stats, self.replica_queue_len_cache.get(r.replica_id) or 0)
                  for rid, r in by_id.items()]
        prompt, key = None, None
        if pending_request is not None:
            prompt = prefill_prompt(pending_request.metadata.call_method, pending_request.args)
            key = pending_request.metadata.internal_request_id
        return [[by_id[rid]] for rid in self._prefill.rank(states, prompt, key, id(pending_request))]

    def _fulfill_next_pending_request(self, replica: RunningReplica, request_metadata=None) -> None:
        """Which waiting call gets the replica just chosen. A prompt's replica was chosen for that prompt: it
        goes to it (Serve's default, by request id), not to the oldest waiting call as FIFOMixin would, which
        under a burst hands prompt A the replica holding prompt B's prefix. Decode calls stay FIFO."""
        if (getattr(self, "_prefill", None) is not None
                and self._get_pending_request_matching_internal_request_id(request_metadata) is not None):
            return RequestRouter._fulfill_next_pending_request(self, replica, request_metadata)
        # Serve indexes waiting calls by internal request id, the first of equal ids only (calls made in one
        # request's context share its id unless the caller gives each its own, router/choices.py): a call
        # not found by its id is served in arrival order, never left waiting.
        return FIFOMixin._fulfill_next_pending_request(self, replica, request_metadata)

    def on_request_completed(self, replica_id, internal_request_id: str) -> None:
        if self._prefill is not None:
            self._prefill.completed(internal_request_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        stats = {r.replica_id.unique_id: (r.routing_stats or {}) for r in replicas}
        record_stats(getattr(self, "role", "decode"), stats, replace=True)
        prefill = getattr(self, "_prefill", None)
        if prefill is not None:
            for rid, s in stats.items():
                prefill.observe(rid, load_of("prefill", s))
            prefill.keep_only(set(stats))
