"""cluster.protocol.load: the routing stats each worker replica reports come back equal through the dict
Serve carries, and stats of another version or with a missing, unknown or mistyped field are refused with a
typed error naming it."""
from __future__ import annotations

import pickle

import pytest

from cluster.errors import ProtocolError, ProtocolVersionError
from cluster.protocol.block_filter import BlockFilter
from cluster.protocol.load import ROUTING_STATS_VERSION, DecodeLoad, PrefillLoad

PREFILL = PrefillLoad("p1", 2048, 3, 700, 1, 40, 12, 256, (("compiles", 2), ("hits", 9)), (("gloo", 40),),
                      (("cached_blocks", 4), ("evicted_blocks", 0), ("hit_tokens", 48), ("query_tokens", 80)),
                      block_size=16, prefix_model="/models/smollm2", cached_blocks=BlockFilter.build(
                          iter([11, 22, 33, 44]), 4).bits, report_seq=9)
NO_PREFIX_CACHE = PrefillLoad("p2", 2048, 0, 0, 0, 0, 0, 256, (), ())
DECODE = DecodeLoad("d1", "g7", None, 64, 5, 4, 30, 512, 1234, ((3, 10, 256, 2), (2, 20, 256, 2)), (("hits", 1),))
REBUILDING = DecodeLoad("d2", None, "rank 1 died", 64, 0, 0, 0, 0, 0, (), ())


@pytest.mark.parametrize("load", [PREFILL, NO_PREFIX_CACHE, DECODE, REBUILDING])
def test_round_trip_through_serve(load):
    raw = pickle.loads(pickle.dumps(load.to_wire()))  # Serve pickles the dict between replica and router
    assert isinstance(raw, dict) and raw["version"] == ROUTING_STATS_VERSION
    assert type(load).from_wire(raw) == load


def test_the_other_version_is_refused():
    with pytest.raises(ProtocolVersionError, match=f"decode routing stats version 0, this router speaks "
                                                   f"{ROUTING_STATS_VERSION}"):
        DecodeLoad.from_wire({**DECODE.to_wire(), "version": 0})


def test_stats_of_the_other_role_are_refused():
    with pytest.raises(ProtocolError, match="field 'role' must be 'prefill'"):
        PrefillLoad.from_wire({**PREFILL.to_wire(), "role": "decode"})


@pytest.mark.parametrize("change, message", [
    (lambda w: w.pop("kv_blocks_used"), r"lack field\(s\) \['kv_blocks_used'\]"),
    (lambda w: w.update(tp_size=2), r"unknown field\(s\) \['tp_size'\]"),
    (lambda w: w.update(num_requests="5"), "field 'num_requests' must be an int"),
    (lambda w: w.update(group_id=7), "field 'group_id' must be a str or nil"),
    (lambda w: w.update(dp_ranks=((1, 2, 3),)), "field 'dp_ranks' must be an array of"),
    (lambda w: w.update(grammar={"hits": 1.5}), "field 'grammar' must be a map of names to counts"),
])
def test_a_malformed_field_is_named(change, message):
    raw = DECODE.to_wire()
    change(raw)
    with pytest.raises(ProtocolError, match=message):
        DecodeLoad.from_wire(raw)


@pytest.mark.parametrize("change, message", [
    (lambda w: w.update(cached_blocks=[1, 2]), "field 'cached_blocks' must be bytes"),
    (lambda w: w.update(cached_blocks=b"x" * 5), "field 'cached_blocks' must be a power of two of bits"),
    (lambda w: w.update(block_size="16"), "field 'block_size' must be an int"),
    (lambda w: w.pop("report_seq"), r"lack field\(s\) \['report_seq'\]"),
])
def test_a_malformed_prefix_view_is_named(change, message):
    raw = PREFILL.to_wire()
    change(raw)
    with pytest.raises(ProtocolError, match=message):
        PrefillLoad.from_wire(raw)


def test_the_prefix_view_survives_the_trip():
    back = PrefillLoad.from_wire(pickle.loads(pickle.dumps(PREFILL.to_wire())))
    held = BlockFilter(back.cached_blocks)
    assert all(h in held for h in (11, 22, 33, 44)) and (back.block_size, back.report_seq) == (16, 9)


def test_a_non_map_is_refused():
    with pytest.raises(ProtocolError, match="prefill routing stats must be a map, got list"):
        PrefillLoad.from_wire([1, 2])
