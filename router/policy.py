"""The routing policy: pick the prefill replica and the decode group with the least load.

Load comes from two places: each replica's `record_routing_stats()` (queued prompt tokens, KV usage,
running requests; polled by Serve every `STATS_PERIOD_S`) and this router's own count of requests
it has in flight to each replica, which covers the gap until the next poll. Scores are pure functions
of those numbers so they can be tested alone; `LoadAwareRequestRouter` plugs them into Serve's
request routing (it runs inside the router process, beside the deployment handle).
"""
from __future__ import annotations

import threading
from typing import Any

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

STATS_PERIOD_S = 0.5


def prefill_score(stats: dict, in_flight: int) -> float:
    """Expected wait in units of 'one batch': queued prompt tokens over a step's token budget, plus
    prompts this router sent since the stats were taken, plus pending hand-overs (they share the CPU)."""
    budget = max(1, stats.get("max_num_batched_tokens", 2048))
    return (stats.get("prompt_tokens_waiting", 0) / budget + stats.get("num_prompts", 0)
            + in_flight + 0.25 * stats.get("handovers_queued", 0))


def decode_score(stats: dict, in_flight: int) -> float:
    """KV pressure dominates (a full cache stalls new hand-overs); running requests slow every step."""
    total = max(1, stats.get("kv_blocks_total", 1))
    seqs = max(1, stats.get("max_num_seqs", 64))
    return 2.0 * stats.get("kv_blocks_used", 0) / total + (stats.get("num_requests", 0) + in_flight) / seqs


_SCORES = {"prefill": prefill_score, "decode": decode_score}

# Latest routing stats per role and replica, as seen by the routers of this process (for /metrics).
_latest: dict[str, dict[str, dict]] = {"prefill": {}, "decode": {}}
_latest_lock = threading.Lock()


def latest_stats(role: str) -> dict[str, dict]:
    with _latest_lock:
        return dict(_latest.get(role, {}))


class LoadAwareRequestRouter(FIFOMixin, RequestRouter):
    """Orders replicas by score (least loaded first); Serve then takes the first that accepts."""

    def initialize_state(self, role: str = "decode", **kwargs: Any) -> None:
        if role not in _SCORES:
            raise ValueError(f"unknown role {role!r}; expected one of {sorted(_SCORES)}")
        self.role = role
        self._score = _SCORES[role]

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        scored = []
        snapshot = {}
        for r in candidate_replicas:
            stats = r.routing_stats or {}
            snapshot[r.replica_id.unique_id] = stats
            in_flight = self.replica_queue_len_cache.get(r.replica_id) or 0
            scored.append((self._score(stats, in_flight), r.replica_id.unique_id, r))
        with _latest_lock:
            _latest[self.role] = snapshot
        scored.sort(key=lambda x: (x[0], x[1]))
        return [[r] for _, _, r in scored]

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        with _latest_lock:
            _latest[getattr(self, "role", "decode")] = {r.replica_id.unique_id: (r.routing_stats or {})
                                                        for r in replicas}
