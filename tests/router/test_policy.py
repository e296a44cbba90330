"""Routing scores: the least loaded replica wins, and this router's in-flight requests count; a prefill
replica holding the prompt's prefix wins while its extra load stays below what the prefix saves, and the
balance guard overrides it beyond that."""
from cluster.protocol.load import DecodeLoad, PrefillLoad
from router.policy import (BALANCE_ABS_BATCHES, OVERLAP_WEIGHT, PROMPT_OVERHEAD_TOKENS, PrefillCandidate,
                           decode_score, decode_unavailable, load_of, prefill_work, rank_prefill, uncached_waiting)


def prefill(waiting: int, prompts: int, hits: tuple[int, int] | None = None) -> PrefillLoad:
    counts = () if hits is None else (("hit_tokens", hits[0]), ("query_tokens", hits[1]))
    return PrefillLoad("p", 2048, prompts, waiting, 0, 0, 0, 100, (), (), counts)


def cand(name, load=None, in_flight=0, own=0, matched=0, last_pick=-1) -> PrefillCandidate:
    return PrefillCandidate(name, load, in_flight, own, matched, last_pick)


def order(cands, prompt_tokens):
    ranked, outcome = rank_prefill(cands, prompt_tokens)
    return [c.replica for c in ranked], outcome


def decode(used: int, total: int, requests: int, group_id: str | None = "g1", last_error: str | None = None):
    return DecodeLoad("d", group_id, last_error, 64, requests, requests, used, total, 0, (), ())


def test_prefill_prefers_fewer_queued_prompt_tokens_and_fewer_in_flight():
    assert order([cand("a", prefill(4096, 3)), cand("b", prefill(0, 0))], 100) == (["b", "a"], "load")
    assert order([cand("a", prefill(0, 0), in_flight=5), cand("b", prefill(0, 0))], 100)[0] == ["b", "a"]
    assert prefill_work(cand("a")) == 0.0  # a replica without stats yet is not penalised
    assert prefill_work(cand("a", in_flight=2, own=300)) == 300 + 2 * PROMPT_OVERHEAD_TOKENS  # but ours count


def test_queued_tokens_are_discounted_by_the_replicas_hit_share_and_ours_cover_the_gap():
    assert uncached_waiting(prefill(1000, 2, hits=(750, 1000))) == 250
    assert uncached_waiting(prefill(1000, 2)) == 1000
    # the report predates the 3,000 tokens this router just sent: its own count is the larger, and wins
    assert prefill_work(cand("a", prefill(1000, 1), in_flight=1, own=3000)) == 3000 + PROMPT_OVERHEAD_TOKENS


def test_equal_replicas_take_turns():
    """Regression: ties went to the lowest replica id, so load-only routing of sequential prompts sent
    them all to one replica."""
    a, b = cand("a", prefill(0, 0), last_pick=7), cand("b", prefill(0, 0), last_pick=3)
    assert order([a, b], 500) == (["b", "a"], "load")


def test_the_replica_holding_the_prefix_wins_under_equal_load():
    holder, other = cand("b", prefill(0, 0), matched=1024), cand("a", prefill(0, 0))
    assert order([other, holder], 1100) == (["b", "a"], "prefix")


def test_a_hot_prefix_spills_once_the_holder_is_busier_than_recomputing_it():
    prefix = 1024
    spill_at = OVERLAP_WEIGHT * prefix  # extra queued tokens at the holder that outweigh the prefix
    near = cand("b", prefill(int(spill_at) - 200, 1), matched=prefix)
    far = cand("b", prefill(int(spill_at) + 200, 1), matched=prefix)
    idle = cand("a", prefill(0, 1))
    assert order([idle, near], 1100)[0][0] == "b"
    assert order([idle, far], 1100) == (["a", "b"], "load")


def test_the_balance_guard_overrides_a_very_long_prefix():
    prefix = 30_000  # recomputing it costs more than the holder's queue: only the guard moves the prompt
    lightest = 1000
    over = int(2.0 * lightest + BALANCE_ABS_BATCHES * 2048) + 1
    holder = cand("b", prefill(over, 0), matched=prefix)
    assert order([cand("a", prefill(lightest, 0)), holder], prefix + 50) == (["a", "b"], "balance")
    holder = cand("b", prefill(over - 2, 0), matched=prefix)
    assert order([cand("a", prefill(lightest, 0)), holder], prefix + 50) == (["b", "a"], "prefix")


def test_decode_prefers_free_kv_then_fewer_requests():
    empty, full, crowded = decode(0, 100, 0), decode(95, 100, 4), decode(0, 100, 40)
    assert decode_score(empty, 0) < decode_score(crowded, 0) < decode_score(full, 0) + 1.0
    assert decode_score(empty, 0) < decode_score(full, 0)
    assert decode_score(empty, 3) > decode_score(empty, 0)


def test_a_decode_replica_rebuilding_its_group_is_avoided_and_reported():
    up = decode(95, 100, 60)
    rebuilding = decode(0, 0, 0, group_id=None, last_error="node lost")
    assert decode_score(up, 8) < decode_score(rebuilding, 0)  # even a full group beats one that is not there
    assert decode_unavailable({"a": up, "b": rebuilding}) is None
    assert "node lost" in decode_unavailable({"b": rebuilding})
    assert decode_unavailable({}) is None and decode_unavailable({"a": None}) is None  # no stats yet: no verdict


def test_stats_are_read_as_records_and_an_unreadable_replica_scores_as_unknown():
    assert load_of("decode", decode(1, 2, 3).to_wire()) == decode(1, 2, 3)
    assert load_of("decode", {}) is None and load_of("prefill", None) is None  # not reported yet
    other_version = {**prefill(0, 1).to_wire(), "version": 0}
    assert load_of("prefill", other_version) is None  # logged; routed by in-flight counts only


def _holding(load: DecodeLoad, prompt: list[int], block_size: int = 16) -> DecodeLoad:
    """The same load with a prefix view holding the prompt's full blocks."""
    from dataclasses import replace

    from cluster.protocol.block_filter import BlockFilter
    from engine.core.prefix_hash import extend_hashes, namespace_hash

    hashes = extend_hashes([], prompt[: len(prompt) // block_size * block_size], block_size, namespace_hash("m"))
    return replace(load, block_size=block_size, prefix_model="m",
                   cached_blocks=BlockFilter.build(hashes, len(hashes)).bits)


def test_a_decode_group_holding_the_prompt_wins_within_the_balance_guard():
    from engine.core.prefix_hash import extend_hashes, namespace_hash

    from router.policy import rank_decode

    prompt = list(range(1000, 1000 + 16 * 100 + 3))  # 100 reusable blocks

    def hashes_of(block_size, model):
        usable = (len(prompt) - 1) // block_size
        return extend_hashes([], prompt[: usable * block_size], block_size, namespace_hash(model))

    light, busier = decode(10, 256, 1), decode(40, 256, 2)
    # the holder is busier, but 100 held blocks of 256 outweigh its extra 30 blocks and a request
    assert rank_decode([("a", light, 0), ("b", _holding(busier, prompt), 0)], hashes_of) == (["b", "a"], "prefix")
    # without a prompt (or no view) decode goes by load
    assert rank_decode([("a", light, 0), ("b", _holding(busier, prompt), 0)], lambda *_: None) == (["a", "b"], "load")
    # the least loaded holds it: load decides
    assert rank_decode([("a", _holding(light, prompt), 0), ("b", busier, 0)], hashes_of) == (["a", "b"], "load")
    # the prompt would outweigh 140 more blocks too, but that is past the guard (a quarter of the pool): by load
    crowded = decode(150, 256, 2)
    assert rank_decode([("a", light, 0), ("b", _holding(crowded, prompt), 0)], hashes_of) == (["a", "b"], "balance")


def test_a_resumed_request_avoids_the_decode_replica_its_worker_died_on():
    """router/policy.demote: the replica a resumed request failed on goes last (its routing stats say it is
    rebuilding only at their next poll), unless it is the only one (then its open waits for the new group)."""
    from router.policy import demote

    assert demote(["a", "b", "c"], "a") == ["b", "c", "a"]
    assert demote(["a", "b", "c"], "b") == ["a", "c", "b"]
    assert demote(["a", "b"], None) == ["a", "b"]
    assert demote(["a", "b"], "gone") == ["a", "b"]  # a replica Serve no longer lists
    assert demote(["a"], "a") == ["a"]
