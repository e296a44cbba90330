"""The routing policy: pick the prefill replica and the decode group with the least load.

Load comes from two places: each replica's `record_routing_stats()` (queued prompt tokens, KV usage,
running requests; polled by Serve every `STATS_PERIOD_S`) and this router's own count of requests
it has in flight to each replica, which covers the gap until the next poll. Scores are pure functions
of those numbers so they can be tested alone; `LoadAwareRequestRouter` plugs them into Serve's
request routing (router/request_router.py; it runs inside the router process, beside the handle).
"""
from __future__ import annotations

import threading

STATS_PERIOD_S = 0.5
REBUILDING_PENALTY = 100.0  # a decode replica rebuilding its rank group gets requests only if no other can


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
    rebuilding = REBUILDING_PENALTY if "group_id" in stats and stats["group_id"] is None else 0.0
    return (2.0 * stats.get("kv_blocks_used", 0) / total + (stats.get("num_requests", 0) + in_flight) / seqs
            + rebuilding)


def decode_unavailable(by_replica: dict[str, dict]) -> str | None:
    """Why no decode replica can take a request now (every one is rebuilding its rank group: a rank or its
    node was lost), or None; None too before any stats arrived."""
    known = [s for s in by_replica.values() if s and "group_id" in s]
    if known and all(s["group_id"] is None for s in known):
        return f"no decode group is up; rebuilding after: {known[0].get('last_error')}"
    return None


_SCORES = {"prefill": prefill_score, "decode": decode_score}

# Latest routing stats per role and replica, as seen by the routers of this process (for /metrics).
_latest: dict[str, dict[str, dict]] = {"prefill": {}, "decode": {}}
_latest_lock = threading.Lock()


def latest_stats(role: str) -> dict[str, dict]:
    with _latest_lock:
        return dict(_latest.get(role, {}))


def record_stats(role: str, by_replica: dict[str, dict], replace: bool) -> None:
    """`replace`: the full replica set (membership changed); else fresher stats for some replicas."""
    with _latest_lock:
        _latest[role] = dict(by_replica) if replace else {**_latest.get(role, {}), **by_replica}


def score_function(role: str):
    if role not in _SCORES:
        raise ValueError(f"unknown role {role!r}; expected one of {sorted(_SCORES)}")
    return _SCORES[role]
