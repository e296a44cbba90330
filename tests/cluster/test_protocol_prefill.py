"""cluster.protocol.prefill: the prefill request crosses the router -> prefill call as its versioned wire
form; it comes back equal, with its SamplingParams, and a request of another version or a malformed one is
refused with a typed error naming what is wrong."""
from __future__ import annotations

import pickle

import pytest

from cluster.errors import ProtocolError, ProtocolVersionError
from cluster.protocol import PREFILL_VERSION, PrefillRequest
from engine import InvalidRequestError, SamplingParams, StructuredOutput


def request(**params) -> PrefillRequest:
    return PrefillRequest("cmpl-1", (3, 4, 5), SamplingParams(**params))


@pytest.mark.parametrize("params", [
    {},
    {"max_tokens": 7, "temperature": 0.0, "stop": ["\n"], "stop_token_ids": [2], "seed": 11, "logprobs": 3},
    {"logit_bias": {5: -100.0, 9: 2.5}, "min_tokens": 2, "top_k": 40, "top_p": 0.9},
    {"structured_output": StructuredOutput(json_schema={"type": "object"})},
])
def test_round_trip_through_the_call(params):
    sent = request(**params)
    # Serve pickles what crosses the call; the wire form is plain values, so that is all it carries.
    back = PrefillRequest.from_wire(pickle.loads(pickle.dumps(sent.to_wire())))
    assert back == sent and isinstance(back.params, SamplingParams)


def test_another_version_is_refused_naming_both_versions():
    raw = (PREFILL_VERSION + 1,) + request().to_wire()[1:]
    expected = f"PrefillRequest version {PREFILL_VERSION + 1}, this side speaks {PREFILL_VERSION}"
    with pytest.raises(ProtocolVersionError, match=expected):
        PrefillRequest.from_wire(raw)


def test_an_unknown_sampling_field_is_named():
    version, rid, prompt, params = request().to_wire()
    with pytest.raises(ProtocolError, match=r"'params' must be SamplingParams fields only \(unknown: \['best_of'\]\)"):
        PrefillRequest.from_wire((version, rid, prompt, {**params, "best_of": 2}))


def test_a_sampling_value_the_engine_refuses_is_an_invalid_request_naming_its_parameter():
    version, rid, prompt, params = request().to_wire()
    with pytest.raises(InvalidRequestError, match="temperature must be >= 0") as e:
        PrefillRequest.from_wire((version, rid, prompt, {**params, "temperature": -1.0}))
    assert e.value.param == "temperature"


@pytest.mark.parametrize("index, value, message", [
    (1, 7, "'request_id' must be a str"),
    (2, (), "'prompt_token_ids' must be a non-empty array of ints"),
    (2, (1, "2"), "'prompt_token_ids' must be an array of ints"),
    (3, [("max_tokens", 1)], "'params' must be a map of SamplingParams fields"),
])
def test_a_malformed_field_is_named(index, value, message):
    raw = list(request().to_wire())
    raw[index] = value
    with pytest.raises(ProtocolError, match=message):
        PrefillRequest.from_wire(tuple(raw))


def test_a_request_cut_short_is_refused():
    with pytest.raises(ProtocolError, match="PrefillRequest must have 4 fields"):
        PrefillRequest.from_wire(request().to_wire()[:3])
