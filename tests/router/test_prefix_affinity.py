"""router/prefix_affinity.py: the router hashes a prompt as the engine does and finds it in a replica's
reported BlockFilter; prompts sharing a new prefix follow the first to its replica before any report says
so; a view that cannot be trusted (no report, unreadable, stale, its replica gone) routes by load alone and
is counted; with prefix-aware routing off, equal replicas take turns."""
from __future__ import annotations

import pytest

from cluster.protocol.block_filter import BlockFilter
from cluster.protocol.load import PrefillLoad
from engine.core.block_manager import BlockManager
from engine.core.prefix_cache import PrefixCache
from engine.core.request import Request
from engine.sampling_params import SamplingParams
from router.prefix_affinity import (MEMORY_S, STALE_AFTER_S, PrefillRouting, PromptKey, ReplicaState,
                                    prefill_prompt, prompt_hashes, routing_counts)

BLOCK = 16
MODEL = "/models/tiny"
PREFIX = list(range(1000, 1000 + 40 * BLOCK))  # 640 tokens: 40 full blocks


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def engine_cache(*prompts: list[int], salt: str | None = None) -> PrefixCache:
    """A prefill engine's prefix cache after computing `prompts` (what the engine does for each)."""
    cache = PrefixCache(BlockManager(256, BLOCK), MODEL)
    for i, tokens in enumerate(prompts):
        req = Request(f"r{i}", list(tokens), SamplingParams(max_tokens=1, cache_salt=salt), seed=0,
                      max_total_tokens=4096)
        cache.admit(req)
        assert cache.blocks.allocate(req.request_id, req.num_tokens)
        req.num_computed_tokens = req.num_tokens
        cache.progress(req)
    return cache


def report(replica: str, cache: PrefixCache | None = None, seq: int = 1, waiting: int = 0) -> dict:
    hashes = cache.blocks.pool.cached_hashes() if cache is not None else []
    return PrefillLoad(replica, 2048, 0, waiting, 0, 0, 0, 256, (), (), block_size=BLOCK, prefix_model=MODEL,
                       cached_blocks=BlockFilter.build(iter(hashes), len(hashes)).bits, report_seq=seq).to_wire()


def wire(tokens: list[int], salt: str | None = None) -> tuple:
    """A PrefillRequest's wire form, as the router's prefill call carries it."""
    return (2, "req", tuple(tokens), {"max_tokens": 1, "cache_salt": salt}, None)


def prompt(tokens: list[int], salt: str | None = None) -> PromptKey:
    return prefill_prompt("prefill", [wire(tokens, salt), None])


def delta(before: dict, kind: str, key: str) -> int:
    return routing_counts().get((kind, key), 0) - before.get((kind, key), 0)


def test_the_router_hashes_a_prompt_as_the_engine_does():
    cache = engine_cache(PREFIX + [1, 2, 3])
    held = BlockFilter.build(iter(cache.blocks.pool.cached_hashes()), cache.blocks.pool.num_cached)
    assert held.leading_matches(prompt_hashes(prompt(PREFIX + [7, 8]), BLOCK, MODEL)) == 40
    assert held.leading_matches(prompt_hashes(prompt(PREFIX + [7, 8], salt="s"), BLOCK, MODEL)) == 0
    # a prompt of whole blocks: its last block is always computed, so it is never counted as held
    assert len(prompt_hashes(prompt(PREFIX), BLOCK, MODEL)) == 39


def test_a_prompt_goes_to_the_replica_holding_its_prefix():
    routing, before = PrefillRouting(clock=Clock()), routing_counts()
    states = [ReplicaState("a", report("a", engine_cache(list(range(5000, 5700)))), 0),
              ReplicaState("b", report("b", engine_cache(PREFIX + [1])), 0)]
    for i in range(4):
        assert routing.rank(states, prompt(PREFIX + [i, i]), f"k{i}")[0] == "b"
        routing.completed(f"k{i}")
    assert delta(before, "decision", "prefix") == 4
    assert delta(before, "expected_hit_tokens", "") == 4 * 40 * BLOCK


def test_prompts_sharing_a_new_prefix_follow_the_first_before_any_report():
    """n > 1 children, or users sharing a system prompt, arrive together: no report holds the prefix
    yet, the first goes by load, the rest follow it (and wait for its blocks there)."""
    routing = PrefillRouting(clock=Clock())
    states = [ReplicaState("a", report("a"), 0), ReplicaState("b", report("b"), 0)]
    first = routing.rank(states, prompt(PREFIX + [0]), "k0")[0]
    states = [ReplicaState(s.replica, s.stats, int(s.replica == first)) for s in states]  # one open there
    for i in range(1, 4):
        assert routing.rank(states, prompt(PREFIX + [i]), f"k{i}")[0] == first
    other_prefix = list(range(9000, 9000 + 40 * BLOCK))
    assert routing.rank(states, prompt(other_prefix), "k9")[0] != first  # the other replica is less loaded


def test_the_memory_of_a_route_expires():
    clock = Clock()
    routing = PrefillRouting(clock=clock)
    states = [ReplicaState("a", report("a"), 0), ReplicaState("b", report("b"), 0)]
    first = routing.rank(states, prompt(PREFIX + [0]), "k0")[0]
    routing.completed("k0")
    clock.now += MEMORY_S + 1
    states = [ReplicaState(s.replica, report(s.replica, seq=2), 0) for s in states]  # fresh, holding nothing
    assert routing.rank(states, prompt(PREFIX + [1]), "k1")[0] != first  # its turn goes to the other


@pytest.mark.parametrize("reason", ["no_report", "unreadable", "stale"])
def test_an_untrusted_view_routes_by_load_and_is_counted(reason):
    clock = Clock()
    routing, before = PrefillRouting(clock=clock), routing_counts()
    holder = report("b", engine_cache(PREFIX + [1]), waiting=500)
    states = [ReplicaState("a", report("a"), 0), ReplicaState("b", holder, 0)]
    if reason == "no_report":
        states[0] = ReplicaState("a", {}, 0)
    elif reason == "unreadable":
        states[0] = ReplicaState("a", {**report("a"), "version": 0}, 0)
    else:
        routing.rank(states, None, None)  # the reports are first seen now ...
        clock.now += STALE_AFTER_S + 1  # ... and never change again: Serve no longer hears from the replicas
    assert routing.rank(states, prompt(PREFIX + [5]), "k")[0] == "a"  # the less loaded, though b holds it
    assert delta(before, "fallback", reason) == 1 and delta(before, "decision", "load") == 1


def test_a_prefix_whose_replica_left_is_counted():
    routing, before = PrefillRouting(clock=Clock()), routing_counts()
    states = [ReplicaState("a", report("a"), 0), ReplicaState("b", report("b"), 0)]
    first = routing.rank(states, prompt(PREFIX + [0]), "k0")[0]
    routing.completed("k0")
    routing.keep_only({"a", "b"} - {first})
    left = [s for s in states if s.replica != first]
    assert routing.rank(left, prompt(PREFIX + [1]), "k1") == [left[0].replica]
    assert delta(before, "fallback", "replica_gone") == 1


def test_this_routers_open_prompts_weigh_until_they_complete():
    routing = PrefillRouting(prefix_aware=False, clock=Clock())
    states = [ReplicaState("a", report("a"), 0), ReplicaState("b", report("b"), 0)]
    assert routing.rank(states, prompt(list(range(3000))), "big")[0] == "a"  # ties: never picked, by id
    # Serve's queue-length cache may not count it yet; the router's own record of its tokens does
    assert routing.rank(states, prompt(list(range(50))), "s1")[0] == "b"
    assert routing.rank(states, prompt(list(range(60))), "s2")[0] == "b"  # still lighter than a's 3000
    routing.completed("big")
    routing.completed("s1")
    routing.completed("s2")
    assert routing.rank(states, prompt(list(range(60))), "s3")[0] == "a"  # equal again: a's turn


def test_calls_sharing_a_request_key_each_count_until_each_completes():
    """Calls made in one HTTP request's context share Serve's internal request id: one call's completion must
    not drop the other's tokens, and a call routed again (Serve's backoff) is counted once."""
    clock = Clock()
    routing = PrefillRouting(prefix_aware=False, clock=clock)
    states = [ReplicaState("a", report("a"), 0), ReplicaState("b", report("b"), 0)]
    first = routing.rank(states, prompt(list(range(3000))), "same", call=1)[0]
    clock.now += 1
    first = routing.rank(states, prompt(list(range(3000))), "same", call=1)[0]  # routed again
    clock.now += 1
    second = routing.rank(states, prompt(list(range(5000, 8000))), "same", call=2)[0]
    assert second != first  # the first call's 3,000 tokens count once, on its latest replica
    routing.completed("same")  # the older call is done; the other is still open
    clock.now += 1
    # one request in flight on `first` as Serve counts it: lighter than 3,000 open tokens, heavier than nothing
    states = [ReplicaState(s.replica, s.stats, int(s.replica == first)) for s in states]
    assert routing.rank(states, prompt(list(range(10))), "small", call=3)[0] == first


def test_with_prefix_awareness_off_equal_replicas_take_turns_whatever_they_hold():
    routing, before = PrefillRouting(prefix_aware=False, clock=Clock()), routing_counts()
    states = [ReplicaState("a", report("a", engine_cache(PREFIX + [1])), 0), ReplicaState("b", report("b"), 0)]
    picks = []
    for i in range(4):
        picks.append(routing.rank(states, prompt(PREFIX + [i]), f"k{i}")[0])
        routing.completed(f"k{i}")
    assert picks == ["a", "b", "a", "b"]
    assert delta(before, "decision", "prefix") == 0 and sum(delta(before, "fallback", r) for r in
                                                            ("no_report", "unreadable", "stale")) == 0


def test_other_calls_are_routed_by_load_and_not_counted():
    routing, before = PrefillRouting(clock=Clock()), routing_counts()
    states = [ReplicaState("a", report("a", waiting=900), 0), ReplicaState("b", report("b"), 0)]
    assert routing.rank(states, prefill_prompt("model_info", []), None) == ["b", "a"]
    assert prefill_prompt("prefill", [("garbage",), None]) is None
    assert routing_counts() == before
