"""cluster.protocol's hand-over header: what goes out comes back equal, and every way a header can be
wrong (version, fields, types, bytes cut short) is a HandoverHeaderError that says what is wrong."""
from __future__ import annotations

import dataclasses

import msgpack
import pytest
import torch

from cluster.errors import HandoverHeaderError
from cluster.protocol import (HANDOVER_VERSION, DraftsHandover, GrammarHandover, HandoverHeader, HandoverPayload,
                              PayloadPart)
from engine import HandoverRequest, SamplingParams

KV, PROBS = PayloadPart.KV, PayloadPart.DRAFT_PROBS
CHAIN = DraftsHandover((11, 12, 13))
TREE = DraftsHandover((11, 12, 13), ((0, 0, 1), (0, 1, 1, 2), (1, 3, 5, 11)))
FORCED_CHAIN = DraftsHandover((11, 12, 13), forced=0b011)  # the grammar forced the first two drafts
FORCED_TREE = dataclasses.replace(TREE, forced=0b101)  # nodes 1 and 3


def request(rid: str = "req-1") -> HandoverRequest:
    return HandoverRequest(request_id=rid, prompt_token_ids=(5, 6, 7, 8), output_token_ids=(9,),
                           num_computed_tokens=4, seed=1234, params=SamplingParams(max_tokens=8, temperature=0.7),
                           logprobs=((9, -0.25, {9: -0.25, 3: -2.5}),), block_size=16, cache_layers=3,
                           cache_planes=1, cache_head_dim=40, speculative_method="mtp")  # an MLA latent row


def wire_dict(header: HandoverHeader) -> dict:
    return msgpack.unpackb(header.to_wire(), raw=False, strict_map_key=False)


@pytest.mark.parametrize("grammar", [None, GrammarHandover("ab12", '{"vocab": [1, 2], "ü": "\\u0000"}'),
                                     GrammarHandover("ab12", None),
                                     GrammarHandover("cd34", '{"grammars": []}', "llguidance")])
@pytest.mark.parametrize("parts, drafts", [((KV,), None), ((KV,), CHAIN), ((KV, PROBS), CHAIN), ((KV,), TREE),
                                           ((KV, PROBS), FORCED_CHAIN), ((KV,), FORCED_TREE)])
def test_round_trip(grammar, parts, drafts):
    header = HandoverHeader(request(), parts, grammar, drafts)
    back = HandoverHeader.from_wire(header.to_wire())
    assert back == header and back.version == HANDOVER_VERSION and back.request_id == "req-1"
    assert back.request.params == SamplingParams(max_tokens=8, temperature=0.7)


def test_a_guided_request_keeps_its_structured_output():
    from structured.request import StructuredOutput

    guided = StructuredOutput(json_schema={"type": "object", "properties": {"a": {"type": "integer"}}})
    req = dataclasses.replace(request(), params=SamplingParams(max_tokens=8, structured_output=guided))
    header = HandoverHeader(req, (KV,), GrammarHandover(guided.key(), '{"compiled": true}'))
    back = HandoverHeader.from_wire(header.to_wire())
    assert back == header and back.request.params.structured_output.key() == back.grammar.cache_key


def test_the_wire_carries_only_fields_that_are_read():
    assert set(wire_dict(HandoverHeader(request(), (KV,)))) == {"version", "request", "parts", "grammar", "drafts"}


def test_forced_bits_are_on_the_wire_as_one_int():
    """Version 8: which first drafts the grammar forced, bit j for draft j (a tree's node j + 1), so the decode side
    counts them in usage; every draft set is one int that fits msgpack's int64 (a tree has at most 63 nodes)."""
    assert wire_dict(HandoverHeader(request(), (KV,), drafts=FORCED_TREE))["drafts"]["forced"] == 0b101
    assert wire_dict(HandoverHeader(request(), (KV,), drafts=TREE))["drafts"]["forced"] == 0
    full = DraftsHandover(tuple(range(63)), forced=(1 << 63) - 1)
    assert HandoverHeader.from_wire(HandoverHeader(request(), (KV,), drafts=full).to_wire()).drafts == full
    assert FORCED_CHAIN.with_probs(None).forced == 0b011
    assert DraftsHandover.of(FORCED_TREE.with_probs(None)) == FORCED_TREE


def test_wrong_version_is_refused_naming_both_versions():
    raw = wire_dict(HandoverHeader(request(), (KV,)))
    raw["version"] = HANDOVER_VERSION + 1
    with pytest.raises(HandoverHeaderError, match=f"version {HANDOVER_VERSION + 1}.*speaks {HANDOVER_VERSION}") as e:
        HandoverHeader.from_wire(msgpack.packb(raw))
    assert e.value.request_id == "req-1"  # the decode side can still fail that request's stream


@pytest.mark.parametrize("field", ["version", "request", "parts", "grammar", "drafts"])
def test_missing_field_is_named(field):
    raw = wire_dict(HandoverHeader(request(), (KV,)))
    del raw[field]
    with pytest.raises(HandoverHeaderError, match=f"lacks field.*{field}"):
        HandoverHeader.from_wire(msgpack.packb(raw))


@pytest.mark.parametrize("field, value, message", [
    ("parts", ["hidden", "kv"], "parts"),
    ("parts", [], "parts"),
    ("parts", ["kv", "kv"], "parts"),
    ("parts", ["kv", "draft_kv"], "parts"),  # a part of version 3 that no draft ever sent
    ("parts", ["kv", "draft_hidden"], "parts"),  # version 6's: the decode side no longer drafts for an arrival
    ("parts", ["kv", "draft_probs"], "draft distributions but no drafts"),
    ("drafts", [1, 2], "drafts must be a map"),
    ("drafts", {"token_ids": [1, "x"], "tree": None, "forced": 0}, "drafts.token_ids"),
    ("drafts", {"token_ids": [1, True], "tree": None, "forced": 0}, "drafts.token_ids"),
    ("drafts", {"token_ids": [1, 2], "tree": [[0], [0, 1]], "forced": 0}, "drafts.tree"),
    ("drafts", {"token_ids": [1, 2], "forced": 0}, "drafts lacks"),
    ("drafts", {"token_ids": [1, 2], "tree": None}, r"drafts lacks field\(s\) \['forced'\]"),  # a version 7 map
    ("drafts", {"token_ids": [1, 2], "tree": None, "forced": "1"}, "drafts.forced"),
    ("drafts", {"token_ids": [1, 2], "tree": None, "forced": True}, "drafts.forced"),
    ("drafts", {"token_ids": [1, 2], "tree": None, "forced": None}, "drafts.forced"),
    ("drafts", {"token_ids": [1, 2], "tree": None, "forced": -1}, "drafts.forced"),
    ("drafts", {"token_ids": [1, 2], "tree": None, "forced": 0b100}, "drafts.forced"),  # a bit past the drafts
    ("drafts", {"token_ids": [], "tree": None, "forced": 1}, "drafts.forced"),
    ("drafts", {"token_ids": [1, 2], "tree": None, "forced": 0, "forced_nodes": [1]}, "drafts has unknown"),
    ("parts", "kv", "parts"),
    ("request", [1, 2], "'request' must be a map"),
    ("grammar", {"cache_key": 7, "backend": "xgrammar", "compiled": None}, "grammar.cache_key"),
    ("grammar", {"cache_key": "k", "backend": "xgrammar", "compiled": b"bytes"}, "grammar.compiled"),
    ("grammar", {"cache_key": "k", "backend": "outlines", "compiled": None}, "grammar.backend"),
    ("grammar", {"cache_key": "k", "compiled": None}, "grammar lacks"),
    ("grammar", {"cache_key": "k", "backend": "xgrammar", "compiled": None, "accepted_tokens": [1]},
     "grammar has unknown"),
])
def test_mistyped_field_is_named(field, value, message):
    raw = wire_dict(HandoverHeader(request(), (KV,)))
    raw[field] = value
    with pytest.raises(HandoverHeaderError, match=message):
        HandoverHeader.from_wire(msgpack.packb(raw))


@pytest.mark.parametrize("field, value", [("num_computed_tokens", "4"), ("prompt_token_ids", [1, "x"]),
                                          ("seed", None), ("cache_planes", "1"), ("cache_head_dim", 40.0)])
def test_malformed_request_inside_the_header(field, value):
    raw = wire_dict(HandoverHeader(request("r9"), (KV,)))
    raw["request"][field] = value
    with pytest.raises(HandoverHeaderError, match=field) as e:
        HandoverHeader.from_wire(msgpack.packb(raw))
    assert e.value.request_id == "r9"


@pytest.mark.parametrize("field", ["cache_planes", "cache_head_dim"])
def test_a_request_without_its_cache_row_is_refused(field):
    """Version 6: the per-token cache row (planes, head width) is stated, never assumed to be K and V heads."""
    raw = wire_dict(HandoverHeader(request("r7"), (KV,)))
    del raw["request"][field]
    with pytest.raises(HandoverHeaderError, match=f"lacks field '{field}'") as e:
        HandoverHeader.from_wire(msgpack.packb(raw))
    assert e.value.request_id == "r7"


def test_unknown_field_is_refused():
    raw = wire_dict(HandoverHeader(request(), (KV,)))
    raw["sent_at"] = 1.5
    with pytest.raises(HandoverHeaderError, match="unknown field.*sent_at"):
        HandoverHeader.from_wire(msgpack.packb(raw))


@pytest.mark.parametrize("cut", [1, 10, -1])
def test_truncated_bytes(cut):
    wire = HandoverHeader(request(), (KV, PROBS), drafts=CHAIN).to_wire()
    with pytest.raises(HandoverHeaderError, match="not valid msgpack"):
        HandoverHeader.from_wire(wire[:cut])


@pytest.mark.parametrize("data", [b"", b"\xc1", msgpack.packb([1, 2, 3]), {"version": 1}])
def test_not_a_header_at_all(data):
    with pytest.raises(HandoverHeaderError):
        HandoverHeader.from_wire(data)


def test_payload_parts_are_reached_by_name():
    kv, probs = torch.zeros(2, 2, 1, 16, 1, 8), torch.rand(3, 24)
    payload = HandoverPayload(kv=kv, draft_probs=probs)
    assert payload.parts == (KV, PROBS) and payload.tensors == [kv, probs]
    back = HandoverPayload.assemble(HandoverHeader(request(), payload.parts, drafts=CHAIN).parts, payload.tensors)
    assert back.kv is kv and back.draft_probs is probs
    assert CHAIN.with_probs(back.draft_probs).probs is probs and CHAIN.with_probs(None).token_ids == (11, 12, 13)
    assert HandoverPayload(kv=kv).parts == (KV,)
    with pytest.raises(HandoverHeaderError, match="2 payload parts but 1"):
        HandoverPayload.assemble((KV, PROBS), [kv])
