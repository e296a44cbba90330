"""cluster.protocol.prefill: the prefill request crosses the router -> prefill call as its versioned wire
form; it comes back equal, with its SamplingParams, and a request of another version or a malformed one is
refused with a typed error naming what is wrong."""
from __future__ import annotations

import pickle

import pytest

from cluster.errors import ProtocolError, ProtocolVersionError
from cluster.protocol import PREFILL_VERSION, PrefillRequest
from engine import Continuation, InvalidRequestError, SamplingParams, StructuredOutput
from router.prefix_affinity import prefill_prompt


def request(continuation: Continuation | None = None, **params) -> PrefillRequest:
    return PrefillRequest("cmpl-1", (3, 4, 5), SamplingParams(**params), continuation)


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


@pytest.mark.parametrize("continuation", [
    Continuation((7, 8), seed=2**62),
    Continuation((7,), seed=0, logprobs=((7, -0.25, {7: -0.25, 9: -2.0}),)),
])
def test_a_continuation_round_trips_and_routes_by_prompt_and_output(continuation):
    sent = request(continuation, logprobs=1 if continuation.logprobs else None)
    raw = pickle.loads(pickle.dumps(sent.to_wire()))
    assert PrefillRequest.from_wire(raw) == sent
    # The prefill replica that holds the prompt and the output streamed so far is the one to resume it on.
    assert prefill_prompt("prefill", [raw, None]).token_ids == (3, 4, 5) + continuation.output_token_ids


@pytest.mark.parametrize("value, message", [
    ((), "must have 3 fields"),
    (((), 1, ()), "'output_token_ids' must be a non-empty array of ints"),
    (((7,), "1", ()), "'seed' must be"),
    (((7,), 1, ((7, "x", None),)), "'logprobs' must be"),
])
def test_a_malformed_continuation_is_named(value, message):
    raw = list(request().to_wire())
    raw[4] = value
    with pytest.raises(ProtocolError, match=message):
        PrefillRequest.from_wire(tuple(raw))


def test_another_version_is_refused_naming_both_versions():
    raw = (PREFILL_VERSION + 1,) + request().to_wire()[1:]
    expected = f"PrefillRequest version {PREFILL_VERSION + 1}, this side speaks {PREFILL_VERSION}"
    with pytest.raises(ProtocolVersionError, match=expected):
        PrefillRequest.from_wire(raw)


def test_an_unknown_sampling_field_is_named():
    version, rid, prompt, params, cont = request().to_wire()
    with pytest.raises(ProtocolError, match=r"'params' must be SamplingParams fields only \(unknown: \['best_of'\]\)"):
        PrefillRequest.from_wire((version, rid, prompt, {**params, "best_of": 2}, cont))


def test_a_sampling_value_the_engine_refuses_is_an_invalid_request_naming_its_parameter():
    version, rid, prompt, params, cont = request().to_wire()
    with pytest.raises(InvalidRequestError, match="temperature must be >= 0") as e:
        PrefillRequest.from_wire((version, rid, prompt, {**params, "temperature": -1.0}, cont))
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
    with pytest.raises(ProtocolError, match="PrefillRequest must have 5 fields"):
        PrefillRequest.from_wire(request().to_wire()[:3])
