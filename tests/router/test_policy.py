"""Routing scores: the least loaded replica wins, and this router's in-flight requests count."""
from cluster.protocol.load import DecodeLoad, PrefillLoad
from router.policy import decode_score, decode_unavailable, load_of, prefill_score


def prefill(waiting: int, prompts: int) -> PrefillLoad:
    return PrefillLoad("p", 2048, prompts, waiting, 0, 0, 0, 100, (), ())


def decode(used: int, total: int, requests: int, group_id: str | None = "g1", last_error: str | None = None):
    return DecodeLoad("d", group_id, last_error, 64, requests, requests, used, total, 0, (), ())


def test_prefill_prefers_fewer_queued_prompt_tokens_and_fewer_in_flight():
    idle, busy = prefill(0, 0), prefill(4096, 3)
    assert prefill_score(idle, 0) < prefill_score(busy, 0)
    assert prefill_score(idle, 5) > prefill_score(idle, 0)
    assert prefill_score(None, 0) == 0.0  # a replica without stats yet is not penalised
    assert prefill_score(None, 2) == 2.0  # but this router's own requests there count


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
