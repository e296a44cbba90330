"""Cache-aware routing of prompts to prefill replicas: what a router knows of where each prompt's prefix is
cached, and the counters of its choices for /metrics.

A router learns what a prefill replica holds from two places:
- the replica's report (PrefillLoad: its block size, the model its block hashes are namespaced by, and a
  BlockFilter of its cached blocks), polled by Serve every STATS_PERIOD_S;
- its own memory of what it routed there recently (RecentRoutes), which covers the gap until the replica
  has computed those blocks and reported them: requests arriving together with a new shared prefix, and the
  n > 1 children of one request, which send the same prompt at once, all follow the first to its replica
  (whose engine then computes the prefix once and the others wait for it, engine/core/prefix_cache.py).
A prompt's overlap with a replica is the longer of the two leading-block matches. The choice among replicas
weighs that overlap against their load (router/policy.py's rank_prefill, which documents the score).

Fallback: when its view cannot be trusted the router routes by load alone and counts why on /metrics
(tandem_routing_fallback_total{reason}): "no_report" (a replica has not reported yet, or reports no prefix
view), "unreadable" (its report is of another version or malformed), "stale" (its report has not changed
for STALE_AFTER_S: Serve stopped hearing from it) and "replica_gone" (the prompt's prefix was last routed to
a replica that has left). A request never fails for it.

The state lives in PrefillRouting, one per request router (router/request_router.py); the counters are
process-wide (one router replica per process) so that router/metrics.py can read them.
"""
from __future__ import annotations

import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass

from cluster.protocol.block_filter import BlockFilter
from cluster.protocol.load import PrefillLoad
from engine.core.prefix_hash import reusable_prompt_hashes
from router.policy import PrefillCandidate, load_of, rank_prefill

STALE_AFTER_S = 10.0  # twenty stats periods without a new report: Serve no longer hears from the replica
MEMORY_S = 30.0  # how long a route is remembered: past queueing and the next report, even under load
MAX_REMEMBERED = 1 << 16  # block hashes remembered per replica (oldest forgotten first)
OPEN_MAX_S = 600.0  # a request whose completion never came (cancelled before dispatch) stops counting

_counts: Counter = Counter()  # ("decision" | "decode_decision", outcome) / ("fallback", reason) / ("expected_hit_tokens", "")
_counts_lock = threading.Lock()


def routing_counts() -> dict[tuple[str, str], int]:
    """This process's prefill routing counts since it started (for /metrics)."""
    with _counts_lock:
        return dict(_counts)


def count_decode_decision(outcome: str) -> None:
    """A decode replica chosen for a prompt: by the blocks its group holds ("prefix"), by load, or by the
    balance guard (router/policy.py rank_decode)."""
    _count("decode_decision", outcome)


def _count(kind: str, key: str, n: int = 1) -> None:
    with _counts_lock:
        _counts[(kind, key)] += n


@dataclass(frozen=True, slots=True)
class PromptKey:
    """What decides a prompt's block hashes besides the replica's block size and model."""
    token_ids: tuple[int, ...]
    cache_salt: str | None


def prefill_prompt(method: str, args: list) -> PromptKey | None:
    """The prompt of a `prefill(request wire form, target)` call (cluster/protocol/prefill.py's
    PrefillRequest: version, id, prompt token ids, sampling parameters, continuation); a resumed request's
    is its prompt and the output it continues (the prefill computes both); None for other calls, or a request
    too malformed to read (the replica refuses it with a typed error; routing it anywhere is fine)."""
    if method != "prefill" or not args:
        return None
    raw = args[0]
    if type(raw) is not tuple or len(raw) != 5 or type(raw[2]) is not tuple or type(raw[3]) is not dict:
        return None
    salt = raw[3].get("cache_salt")
    tokens = raw[2]
    if type(raw[4]) is tuple and raw[4] and type(raw[4][0]) is tuple:
        tokens = tokens + raw[4][0]
    return PromptKey(tokens, salt if isinstance(salt, str) else None)


def decode_prompt(method: str, args: list) -> PromptKey | None:
    """The prompt of a decode replica's `open(request id, prompt length, caller, prompt token ids, cache salt)`
    call (decode_worker/deployment.py); None for other calls or one that carries no token ids."""
    if method != "open" or len(args) < 4 or not isinstance(args[3], (list, tuple)) or not args[3]:
        return None
    salt = args[4] if len(args) > 4 and isinstance(args[4], str) else None
    return PromptKey(tuple(args[3]), salt)


def prompt_hashes(prompt: PromptKey, block_size: int, model: str) -> list[int]:
    """The chain hashes of the prompt's blocks an engine could reuse (engine/core/prefix_hash.py)."""
    return reusable_prompt_hashes(prompt.token_ids, block_size, model, prompt.cache_salt)


class RecentRoutes:
    """Block hashes of prompts this router sent to each replica, for MEMORY_S; and, for as long, those of
    replicas that left (to say why a prompt lost its affinity)."""

    def __init__(self):
        self._by_replica: dict[str, OrderedDict[int, float]] = {}  # replica -> hash -> expiry
        self._gone: OrderedDict[int, float] = OrderedDict()

    def remember(self, replica: str, hashes: list[int], now: float) -> None:
        held = self._by_replica.setdefault(replica, OrderedDict())
        for h in hashes:
            held[h] = now + MEMORY_S
            held.move_to_end(h)
        while len(held) > MAX_REMEMBERED:
            held.popitem(last=False)

    def leading(self, replica: str, hashes: list[int], now: float) -> int:
        held = self._by_replica.get(replica, {})
        for n, h in enumerate(hashes):
            if held.get(h, 0.0) < now:
                return n
        return len(hashes)

    def was_gone(self, hashes: list[int], now: float) -> bool:
        return bool(hashes) and self._gone.get(hashes[0], 0.0) >= now

    def keep_only(self, live: set[str], now: float) -> None:
        for replica in [r for r in self._by_replica if r not in live]:
            for h, expiry in self._by_replica.pop(replica).items():
                if expiry >= now:
                    self._gone[h] = expiry
        while len(self._gone) > MAX_REMEMBERED:
            self._gone.popitem(last=False)


@dataclass(frozen=True, slots=True)
class ReplicaState:
    """One candidate replica as Serve shows it to the request router."""
    replica: str
    stats: dict | None  # its routing stats' wire form, None/{} before its first report
    in_flight: int  # requests open there (Serve's queue-length cache)


class PrefillRouting:
    """A request router's view of its prefill replicas: it ranks them for a prompt and remembers its choices."""

    def __init__(self, prefix_aware: bool = True, clock=time.monotonic):
        self.prefix_aware = prefix_aware
        self.clock = clock
        self.recent = RecentRoutes()
        self._lock = threading.Lock()  # Serve reports completions from its callbacks' thread
        # request key -> call -> (replica, tokens it computes, when). Calls made in one request's context share
        # its key (Serve's internal request id) unless the caller gives each its own; a call routed again
        # (Serve's backoff) replaces its own entry.
        self._open: dict[str, dict[int, tuple[str, int, float]]] = {}
        self._seen: dict[str, tuple[int, float]] = {}  # replica -> (report_seq, when this router first saw it)
        self._last_pick: dict[str, int] = {}
        self._picks = 0

    # ---- Serve's hooks
    def observe(self, replica: str, load: PrefillLoad | None) -> None:
        """A replica's latest report: its sequence number's first sighting dates it."""
        if load is not None:
            with self._lock:
                seen = self._seen.get(replica)
                if seen is None or seen[0] != load.report_seq:
                    self._seen[replica] = (load.report_seq, self.clock())

    def keep_only(self, live: set[str]) -> None:
        with self._lock:
            self.recent.keep_only(live, self.clock())
            for replica in [r for r in self._seen if r not in live]:
                del self._seen[replica]
                self._last_pick.pop(replica, None)

    def completed(self, request_key: str) -> None:
        with self._lock:
            calls = self._open.get(request_key)
            if calls:  # Serve names the request, not the call: the oldest of that request's calls is done
                del calls[min(calls, key=lambda c: calls[c][2])]
            if not calls:
                self._open.pop(request_key, None)

    # ---- the choice
    def rank(self, replicas: list[ReplicaState], prompt: PromptKey | None, request_key: str | None,
             call: int = 0) -> list[str]:
        """Replica ids, preferred first, for a prefill call (`prompt`), or for any other call (None: by load).
        `call` tells apart calls under one request key (Serve's pending call's identity)."""
        loads = {r.replica: load_of("prefill", r.stats) for r in replicas}
        for r in replicas:
            self.observe(r.replica, loads[r.replica])
        with self._lock:
            now = self.clock()
            own = Counter()
            for key, calls in list(self._open.items()):
                for c, (replica, tokens, when) in list(calls.items()):
                    if now - when >= OPEN_MAX_S:
                        del calls[c]
                    elif (key, c) != (request_key, call):  # this call routed again: not in its own way
                        own[replica] += tokens
                if not calls:
                    del self._open[key]
            matched, hashes = self._overlaps(replicas, loads, prompt, now)
            n_tokens = len(prompt.token_ids) if prompt is not None else 0
            cands = [PrefillCandidate(r.replica, loads[r.replica], r.in_flight, own[r.replica],
                                      matched.get(r.replica, 0), self._last_pick.get(r.replica, -1))
                     for r in replicas]
            ranked, outcome = rank_prefill(cands, n_tokens)
            if prompt is not None and request_key is not None and ranked:
                first = ranked[0]
                self._picks += 1
                self._last_pick[first.replica] = self._picks
                self._open.setdefault(request_key, {})[call] = (first.replica, n_tokens - first.matched_tokens, now)
                if self.prefix_aware and hashes.get(first.replica):
                    self.recent.remember(first.replica, hashes[first.replica], now)
                _count("decision", outcome)
                _count("expected_hit_tokens", "", first.matched_tokens)
        return [c.replica for c in ranked]

    def _overlaps(self, replicas, loads, prompt, now) -> tuple[dict[str, int], dict[str, list[int]]]:
        """Tokens of the prompt each replica holds (or will), and the prompt's hashes in each one's
        namespace; no overlap anywhere when the view cannot be trusted (the fallback, counted)."""
        if prompt is None or not self.prefix_aware:
            return {}, {}
        reason = None
        hashes: dict[str, list[int]] = {}
        by_namespace: dict[tuple[int, str], list[int]] = {}
        for r in replicas:
            load = loads[r.replica]
            if load is None:
                reason = reason or ("no_report" if not r.stats else "unreadable")
                continue
            if load.block_size <= 0:
                reason = reason or "no_report"
                continue
            if now - self._seen[r.replica][1] > STALE_AFTER_S:
                reason = reason or "stale"
            ns = (load.block_size, load.prefix_model)
            if ns not in by_namespace:
                by_namespace[ns] = prompt_hashes(prompt, *ns)
            hashes[r.replica] = by_namespace[ns]
        if reason is None and not hashes:
            return {}, {}  # prefix caching is off everywhere: load-only routing is the design, not a fallback
        matched = {}
        if reason is None:
            for r in replicas:
                load, hs = loads[r.replica], hashes[r.replica]
                held = max(BlockFilter(load.cached_blocks).leading_matches(hs), self.recent.leading(r.replica, hs, now))
                matched[r.replica] = held * load.block_size
            if not any(matched.values()) and any(self.recent.was_gone(hs, now) for hs in hashes.values()):
                reason = "replica_gone"
        if reason is not None:
            _count("fallback", reason)
        return matched, hashes

