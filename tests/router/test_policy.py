"""Routing scores: the least loaded replica wins, and this router's in-flight requests count."""
from router.policy import decode_score, decode_unavailable, prefill_score


def test_prefill_prefers_fewer_queued_prompt_tokens_and_fewer_in_flight():
    idle = {"prompt_tokens_waiting": 0, "num_prompts": 0, "max_num_batched_tokens": 2048}
    busy = {"prompt_tokens_waiting": 4096, "num_prompts": 3, "max_num_batched_tokens": 2048}
    assert prefill_score(idle, 0) < prefill_score(busy, 0)
    assert prefill_score(idle, 5) > prefill_score(idle, 0)
    assert prefill_score({}, 0) == 0.0  # a replica without stats yet is not penalised


def test_decode_prefers_free_kv_then_fewer_requests():
    empty = {"kv_blocks_used": 0, "kv_blocks_total": 100, "num_requests": 0, "max_num_seqs": 64}
    full = {"kv_blocks_used": 95, "kv_blocks_total": 100, "num_requests": 4, "max_num_seqs": 64}
    crowded = {"kv_blocks_used": 0, "kv_blocks_total": 100, "num_requests": 40, "max_num_seqs": 64}
    assert decode_score(empty, 0) < decode_score(crowded, 0) < decode_score(full, 0) + 1.0
    assert decode_score(empty, 0) < decode_score(full, 0)
    assert decode_score(empty, 3) > decode_score(empty, 0)


def test_a_decode_replica_rebuilding_its_group_is_avoided_and_reported():
    up = {"group_id": "g1", "kv_blocks_used": 95, "kv_blocks_total": 100, "num_requests": 60, "max_num_seqs": 64}
    rebuilding = {"group_id": None, "last_error": "node lost", "kv_blocks_used": 0, "kv_blocks_total": 0}
    assert decode_score(up, 8) < decode_score(rebuilding, 0)  # even a full group beats one that is not there
    assert decode_unavailable({"a": up, "b": rebuilding}) is None
    assert "node lost" in decode_unavailable({"b": rebuilding})
    assert decode_unavailable({}) is None and decode_unavailable({"a": {}}) is None  # no stats yet: no verdict
