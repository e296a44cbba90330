"""Routing stats: what each worker replica reports of its load for the routers' policy (router/policy.py).

Serve polls a replica's `record_routing_stats()` and hands the value to every router's request router, so
it must be a dict: the wire form is a map of exactly the record's fields plus "version" and "role". The
router reads it back with `from_wire`, which checks every field: a replica of another version, or one
whose stats lack a field the policy scores by, is a typed error (the policy then scores that replica as
one it knows nothing of), not a KeyError in Serve's routing loop.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from cluster.errors import ProtocolError, ProtocolVersionError
from cluster.protocol import wire
from cluster.protocol.block_filter import read_bits

ROUTING_STATS_VERSION = 4  # bump on any change to the fields below (3: a prefill replica's prefix view;
# 4: a decode replica's)

# The engine's prefix-cache figures a worker reports (engine stats()["prefix_cache"], less its hit rate):
# running totals of prompt tokens looked up and reused, and the pool's cached and evicted blocks.
PREFIX_CACHE_COUNTS = ("query_tokens", "hit_tokens", "cached_blocks", "evicted_blocks")


def prefix_cache_counts(engine_stats: dict) -> tuple[tuple[str, int], ...]:
    """An engine's prefix-cache counters as (name, count) pairs; () with prefix caching off."""
    pc = engine_stats.get("prefix_cache")
    return () if pc is None else tuple((name, pc[name]) for name in PREFIX_CACHE_COUNTS)


def _counts(value, name: str, field: str) -> tuple[tuple[str, int], ...]:
    wire.check(type(value) is dict and all(type(k) is str and type(v) is int for k, v in value.items()), name,
               field, "a map of names to counts", value)
    return tuple(sorted(value.items()))


def _rank_loads(value, name: str, field: str) -> tuple[tuple[int, int, int, int], ...]:
    ranks = wire.array(value, name, field)
    wire.check(all((type(r) is tuple or type(r) is list) and len(r) == 4 and all(type(x) is int for x in r)
                   for r in ranks), name, field, "an array of (placed, used, total, running) int rows", value)
    return tuple(tuple(r) for r in ranks)


class _Load:
    """Shared by both records: the map wire form, read strictly by each field's reader in READERS."""
    __slots__ = ()
    ROLE = ""
    READERS: dict = {}

    def to_wire(self) -> dict:
        out = {"version": ROUTING_STATS_VERSION, "role": self.ROLE}
        for f in fields(self):
            value = getattr(self, f.name)
            out[f.name] = dict(value) if self.READERS[f.name] is _counts else value
        return out

    @classmethod
    def from_wire(cls, raw) -> "_Load":
        name = f"{cls.ROLE} routing stats"
        if type(raw) is not dict:
            raise ProtocolError(f"{name} must be a map, got {type(raw).__name__}")
        if raw.get("version") != ROUTING_STATS_VERSION:
            raise ProtocolVersionError(f"{name} version {raw.get('version')!r}, this router speaks "
                                       f"{ROUTING_STATS_VERSION}: the deployments run different Tandem versions")
        expected = {"version", "role", *cls.READERS}
        missing, unknown = expected - raw.keys(), raw.keys() - expected
        if missing or unknown:
            raise ProtocolError(f"{name} lack field(s) {sorted(missing)} / have unknown field(s) "
                                f"{sorted(map(str, unknown))}")
        wire.check(raw["role"] == cls.ROLE, name, "role", repr(cls.ROLE), raw["role"])
        return cls(**{key: read(raw[key], name, key) for key, read in cls.READERS.items()})


@dataclass(frozen=True, slots=True)
class PrefillLoad(_Load):
    replica: str  # the Serve replica id
    max_num_batched_tokens: int  # one step's token budget: the unit a queue is measured in
    num_prompts: int  # prompts queued or running
    prompt_tokens_waiting: int
    handovers_queued: int  # hand-overs packed and not yet sent (they share the CPU)
    handovers_total: int
    kv_blocks_used: int
    kv_blocks_total: int
    grammar: tuple[tuple[str, int], ...]  # the engine's grammar counters (compiles, cache hits, ...)
    handovers_by_transport: tuple[tuple[str, int], ...]  # gloo, nccl, ipc: what carried the payloads
    prefix_cache: tuple[tuple[str, int], ...] = ()  # PREFIX_CACHE_COUNTS of its engine; empty with prefix caching off
    # Its prefix view, for cache-aware routing (router/prefix_affinity.py): a router hashes a prompt as this
    # engine does (block_size tokens a block, namespaced by prefix_model and the request's cache salt) and
    # looks the hashes up in cached_blocks, a BlockFilter's bits (cluster/protocol/block_filter.py). Block
    # size 0 and no bits: prefix caching is off there.
    block_size: int = 0
    prefix_model: str = ""  # the model name the engine's block hashes are namespaced by
    cached_blocks: bytes = b""
    report_seq: int = 0  # counts this replica's reports: a router that sees it stand still knows its view is stale

    ROLE = "prefill"
    READERS = {"replica": wire.text, "max_num_batched_tokens": wire.integer, "num_prompts": wire.integer,
               "prompt_tokens_waiting": wire.integer, "handovers_queued": wire.integer,
               "handovers_total": wire.integer, "kv_blocks_used": wire.integer, "kv_blocks_total": wire.integer,
               "grammar": _counts, "handovers_by_transport": _counts, "prefix_cache": _counts,
               "block_size": wire.integer, "prefix_model": wire.text, "cached_blocks": read_bits,
               "report_seq": wire.integer}


@dataclass(frozen=True, slots=True)
class DecodeLoad(_Load):
    replica: str  # the Serve replica id
    group_id: str | None  # None while the replica rebuilds its rank group (a rank or its node was lost)
    last_error: str | None  # why no group is up, while group_id is None
    max_num_seqs: int
    num_requests: int  # open here: expected hand-overs and running requests
    num_running: int
    kv_blocks_used: int
    kv_blocks_total: int
    steps: int
    dp_ranks: tuple[tuple[int, int, int, int], ...]  # per rank: (placed since start, KV used, KV total, running)
    grammar: tuple[tuple[str, int], ...]
    prefix_cache: tuple[tuple[str, int], ...] = ()  # PREFIX_CACHE_COUNTS of the group (summed over ADP ranks)
    # Its group's prefix view (PrefillLoad's three fields; under ADP the union of its ranks' filters): the
    # router sends a prompt to the replica holding its prefix, whose rank then pins it (router/policy.py).
    block_size: int = 0
    prefix_model: str = ""
    cached_blocks: bytes = b""

    ROLE = "decode"
    READERS = {"replica": wire.text, "group_id": wire.text_or_none, "last_error": wire.text_or_none,
               "max_num_seqs": wire.integer, "num_requests": wire.integer, "num_running": wire.integer,
               "kv_blocks_used": wire.integer, "kv_blocks_total": wire.integer, "steps": wire.integer,
               "dp_ranks": _rank_loads, "grammar": _counts, "prefix_cache": _counts,
               "block_size": wire.integer, "prefix_model": wire.text, "cached_blocks": read_bits}


LOADS = {"prefill": PrefillLoad, "decode": DecodeLoad}
