"""The routing policy: pick the prefill replica by prefix overlap and load, the decode group by load and the
prompt blocks its ranks hold (`rank_decode`).

Load comes from two places: each replica's `record_routing_stats()` (a PrefillLoad or DecodeLoad record's
wire form, cluster/protocol/load.py: queued prompt tokens, KV usage, running requests; polled by Serve every
`STATS_PERIOD_S`) and this router's own count of requests it has in flight to each replica, which covers the
gap until the next poll. Scores are pure functions of those records so they can be tested alone;
`LoadAwareRequestRouter` plugs them into Serve's request routing (router/request_router.py; it runs inside
the router process, beside the handle).

The prefill score (`rank_prefill`) is the replica's expected work, in tokens of prompt compute, once it
also has this prompt (the shape of Dynamo's KV router cost: blocks to prefill plus blocks queued):

    cost(r) = queued(r) + PROMPT_OVERHEAD_TOKENS * prompts(r) + HANDOVER_BATCHES * budget(r) * handovers(r)
              + prompt tokens - OVERLAP_WEIGHT * overlap(r)         [then divided by budget(r): steps]

- overlap(r): the prompt's leading tokens r holds or will hold (its reported cache, or prompts this router
  sent there recently: router/prefix_affinity.py); 0 with prefix-aware routing off or a view not trusted;
- queued(r): the larger of the prompt tokens this router sent r that are not done (less their overlap) and
  r's reported queued prompt tokens less its cumulative hit share (other routers' prompts count there);
- prompts(r): the larger of this router's requests open there and r's reported prompt count: a prompt
  costs a step's fixed share besides its tokens.
A cached token weighs OVERLAP_WEIGHT queued tokens (Dynamo's overlap weight): recomputing a prefix costs
the deployment that compute for good, queueing behind it costs only this prompt's time. A cached prefix
thus wins while the replica holding it has no more than OVERLAP_WEIGHT times that prefix's worth of work
more than another; past that, a hot prefix spills to a second replica (which then caches it too). The
weight above 1 is also what keeps prompts that share a new prefix together while the first of them is
still computing it (the others wait for its blocks there, engine/core/prefix_cache.py): n > 1 children.
A guard caps this for very long prefixes, as SGLang's balance thresholds and Ray Serve's imbalance
threshold do: when the cheapest replica's queued work exceeds BALANCE_REL times the least loaded's plus
BALANCE_ABS_BATCHES steps, overlap is ignored for that request.
Ties (equal cost, e.g. idle replicas and no overlap) go to the replica this router chose longest ago, so
load-only routing of equal replicas is round robin.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from cluster.errors import ProtocolError
from cluster.protocol.block_filter import BlockFilter
from cluster.protocol.load import LOADS, DecodeLoad, PrefillLoad

log = logging.getLogger(__name__)

STATS_PERIOD_S = 0.5
REBUILDING_PENALTY = 100.0  # a decode replica rebuilding its rank group gets requests only if no other can
UNKNOWN_MAX_NUM_SEQS = 64  # a decode replica not heard from yet: its in-flight requests weigh as on a default one
DEFAULT_BUDGET = 2048  # a prefill replica not heard from yet: its step's token budget, as the default config's
PROMPT_OVERHEAD_TOKENS = 64  # a prompt's fixed share of a step (scheduling, sampling, packing its hand-over)
HANDOVER_BATCHES = 0.25  # a queued hand-over's share of a step (packing shares the CPU)
OVERLAP_WEIGHT = 2.0
BALANCE_ABS_BATCHES = 4.0
BALANCE_REL = 2.0


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


@dataclass(frozen=True, slots=True)
class PrefillCandidate:
    """A prefill replica as the policy scores it for one prompt."""
    replica: str
    load: PrefillLoad | None  # its latest report; None before its first, or unreadable
    in_flight: int  # this router's requests open there
    own_tokens: int  # prompt tokens this router sent there that it computes (not cached) and are not done
    matched_tokens: int  # the prompt's leading tokens it holds or will hold (0: unknown or none)
    last_pick: int  # when this router last chose it (a pick count; -1 never): ties go to the oldest


def budget(c: PrefillCandidate) -> int:
    return max(1, c.load.max_num_batched_tokens) if c.load is not None else DEFAULT_BUDGET


def uncached_waiting(load: PrefillLoad) -> int:
    """Queued prompt tokens the replica will compute: its queue less its cumulative prefix hit share."""
    counts = dict(load.prefix_cache)
    queried = counts.get("query_tokens", 0)
    hit_share = counts.get("hit_tokens", 0) / queried if queried else 0.0
    return int(load.prompt_tokens_waiting * (1.0 - hit_share))


def prefill_work(c: PrefillCandidate) -> float:
    """The replica's queued work in tokens, before this prompt (see the module docstring)."""
    if c.load is None:
        return c.own_tokens + PROMPT_OVERHEAD_TOKENS * c.in_flight
    queued = max(c.own_tokens, uncached_waiting(c.load))
    prompts = max(c.in_flight, c.load.num_prompts)
    return queued + PROMPT_OVERHEAD_TOKENS * prompts + HANDOVER_BATCHES * budget(c) * c.load.handovers_queued


def prefill_cost(c: PrefillCandidate, prompt_tokens: int, use_overlap: bool = True) -> float:
    """Steps of work the replica has once it also has this prompt."""
    overlap = min(c.matched_tokens, prompt_tokens) if use_overlap else 0
    return (prefill_work(c) + prompt_tokens - OVERLAP_WEIGHT * overlap) / budget(c)


def rank_prefill(cands: list[PrefillCandidate], prompt_tokens: int) -> tuple[list[PrefillCandidate], str]:
    """Candidates cheapest first, and the outcome: "prefix" (the first holds part of the prompt), "load"
    (nobody holds any: least work first) or "balance" (the guard overrode the overlap)."""
    def order(use_overlap: bool) -> list[PrefillCandidate]:
        return sorted(cands, key=lambda c: (prefill_cost(c, prompt_tokens, use_overlap), c.last_pick, c.replica))

    ranked = order(True)
    if not ranked or ranked[0].matched_tokens <= 0:
        return ranked, "load"
    best, lightest = prefill_work(ranked[0]), min(prefill_work(c) for c in cands)
    if best > BALANCE_REL * lightest + BALANCE_ABS_BATCHES * budget(ranked[0]):
        return order(False), "balance"
    return ranked, "prefix"


def decode_score(load: DecodeLoad | None, in_flight: int) -> float:
    """KV pressure dominates (a full cache stalls new hand-overs); running requests slow every step."""
    if load is None:
        return in_flight / UNKNOWN_MAX_NUM_SEQS
    rebuilding = REBUILDING_PENALTY if load.group_id is None else 0.0
    return (2.0 * load.kv_blocks_used / max(1, load.kv_blocks_total)
            + (load.num_requests + in_flight) / max(1, load.max_num_seqs) + rebuilding)


# A decode replica whose group holds a prompt's leading blocks pins them (the hand-over leaves them out and they
# take no new KV): each held block counts against the replica's score twice its share of the KV pool, which
# decode_score weighs 2 (rank_prefill's and the ADP placement's rule). Unless the holder's load score exceeds the
# least loaded's by DECODE_BALANCE (a quarter of a pool's KV, or half a pool's worth of requests).
DECODE_HELD_WEIGHT = 4.0
DECODE_BALANCE = 0.5


def rank_decode(cands: list[tuple[str, DecodeLoad | None, int]], prompt_hashes_of) -> tuple[list[str], str]:
    """Decode replica ids best first, and what decided ("prefix", "load", "balance"). cands: (replica id, its
    load or None, this router's requests in flight there); prompt_hashes_of(block_size, model) -> the
    prompt's block hashes in that namespace, or None without a prompt (its open call carried none)."""
    base = {rid: decode_score(load, n) for rid, load, n in cands}
    held: dict[str, float] = {}
    for rid, load, _ in cands:
        if load is None or load.block_size <= 0 or not load.cached_blocks:
            continue
        hashes = prompt_hashes_of(load.block_size, load.prefix_model)
        if hashes:
            blocks = BlockFilter(load.cached_blocks).leading_matches(hashes)
            if blocks:
                held[rid] = DECODE_HELD_WEIGHT * blocks / max(1, load.kv_blocks_total)
    by_load = sorted(base, key=lambda rid: (base[rid], rid))
    if not held:
        return by_load, "load"
    ranked = sorted(base, key=lambda rid: (base[rid] - held.get(rid, 0.0), rid))
    if ranked[0] == by_load[0]:
        return ranked, "load"
    if base[ranked[0]] > base[by_load[0]] + DECODE_BALANCE:
        return by_load, "balance"
    return ranked, "prefix"


def demote(ranked: list[str], avoid: str | None) -> list[str]:
    """`ranked` with `avoid` last: the decode replica a resumed request's worker died on (router/generation.py)
    is rebuilding its group, which its routing stats say only at their next poll; any other replica takes the
    request at once. Kept (last) when it is the only one: its open waits for the new group."""
    if avoid is None or avoid not in ranked or len(ranked) < 2:
        return ranked
    return [r for r in ranked if r != avoid] + [avoid]


def decode_unavailable(by_replica: dict[str, DecodeLoad | None]) -> str | None:
    """Why no decode replica can take a request now (every one is rebuilding its rank group: a rank or its
    node was lost), or None; None too before any stats arrived."""
    known = [load for load in by_replica.values() if load is not None]
    if known and all(load.group_id is None for load in known):
        return f"no decode group is up; rebuilding after: {known[0].last_error}"
    return None


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

