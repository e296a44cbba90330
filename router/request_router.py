"""LoadAwareRequestRouter: Serve's request-routing hook for the policy in router/policy.py.

Serve pickles this module by value into every process that holds a handle, so it keeps no state of its
own: scores and the per-replica load snapshot live in router.policy (pickled by reference).
"""
from __future__ import annotations

from typing import Any

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

from router.policy import load_of, record_stats, score_function


class LoadAwareRequestRouter(FIFOMixin, RequestRouter):
    """Orders replicas by score (least loaded first); Serve then takes the first that accepts."""

    def initialize_state(self, role: str = "decode", **kwargs: Any) -> None:
        self.role = role
        self._score = score_function(role)

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
        scored = []
        snapshot = {}
        for r in candidate_replicas:
            stats = r.routing_stats or {}
            snapshot[r.replica_id.unique_id] = stats
            in_flight = self.replica_queue_len_cache.get(r.replica_id) or 0
            scored.append((self._score(load_of(self.role, stats), in_flight), r.replica_id.unique_id, r))
        record_stats(self.role, snapshot, replace=False)
        scored.sort(key=lambda x: (x[0], x[1]))
        return [[r] for _, _, r in scored]

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        record_stats(getattr(self, "role", "decode"),
                     {r.replica_id.unique_id: (r.routing_stats or {}) for r in replicas}, replace=True)
