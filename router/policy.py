"""The routing policy: pick the prefill replica and the decode group with the least load.

Load comes from two places: each replica's `record_routing_stats()` (a PrefillLoad or DecodeLoad record's
wire form, cluster/protocol/load.py: queued prompt tokens, KV usage, running requests; polled by Serve every
`STATS_PERIOD_S`) and this router's own count of requests it has in flight to each replica, which covers the
gap until the next poll. Scores are pure functions of those records so they can be tested alone;
`LoadAwareRequestRouter` plugs them into Serve's request routing (router/request_router.py; it runs inside
the router process, beside the handle).
"""
from __future__ import annotations

import logging
import threading

from cluster.errors import ProtocolError
from cluster.protocol.load import LOADS, DecodeLoad, PrefillLoad

log = logging.getLogger(__name__)

STATS_PERIOD_S = 0.5
REBUILDING_PENALTY = 100.0  # a decode replica rebuilding its rank group gets requests only if no other can
UNKNOWN_MAX_NUM_SEQS = 64  # a decode replica not heard from yet: its in-flight requests weigh as on a default one


def load_of(role: str, stats: dict | None) -> PrefillLoad | DecodeLoad | None:
    """A replica's routing stats as its record; None before its first report, or if it is unreadable (a
    replica of another version, logged): the policy then scores it by this router's in-flight count alone."""
    if not stats:
        return None
    try:
        return LOADS[role].from_wire(stats)
    except ProtocolError as e:
        log.warning("unreadable routing stats of a %s replica: %s", role, e)
        return None


def prefill_score(load: PrefillLoad | None, in_flight: int) -> float:
    """Expected wait in units of 'one batch': queued prompt tokens over a step's token budget, plus
    prompts this router sent since the stats were taken, plus pending hand-overs (they share the CPU)."""
    if load is None:
        return float(in_flight)
    return (load.prompt_tokens_waiting / max(1, load.max_num_batched_tokens) + load.num_prompts + in_flight
            + 0.25 * load.handovers_queued)


def decode_score(load: DecodeLoad | None, in_flight: int) -> float:
    """KV pressure dominates (a full cache stalls new hand-overs); running requests slow every step."""
    if load is None:
        return in_flight / UNKNOWN_MAX_NUM_SEQS
    rebuilding = REBUILDING_PENALTY if load.group_id is None else 0.0
    return (2.0 * load.kv_blocks_used / max(1, load.kv_blocks_total)
            + (load.num_requests + in_flight) / max(1, load.max_num_seqs) + rebuilding)


def decode_unavailable(by_replica: dict[str, DecodeLoad | None]) -> str | None:
    """Why no decode replica can take a request now (every one is rebuilding its rank group: a rank or its
    node was lost), or None; None too before any stats arrived."""
    known = [load for load in by_replica.values() if load is not None]
    if known and all(load.group_id is None for load in known):
        return f"no decode group is up; rebuilding after: {known[0].last_error}"
    return None


_SCORES = {"prefill": prefill_score, "decode": decode_score}

# Latest routing stats per role and replica, as seen by the routers of this process (for /metrics): their
# wire forms, which the metrics page shows as they came.
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
