"""router/structured.py: every spelling of a structured output becomes the engine's StructuredOutput
fields; malformed ones are 400s naming the parameter (no Ray here: the body models alone)."""
from __future__ import annotations

import pytest

from router.errors import APIError
from router.protocol import ChatCompletionRequest, CompletionRequest

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def _chat(**extra) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], **extra)


@pytest.mark.parametrize("extra,want", [
    ({}, None),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, {"json_object": True}),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
     {"json_schema": SCHEMA}),
    ({"structured_outputs": {"json": SCHEMA}}, {"json_schema": SCHEMA}),
    ({"structured_outputs": {"regex": "[a-z]+"}}, {"regex": "[a-z]+"}),
    ({"structured_outputs": {"choice": ["a", "b"]}}, {"choice": ["a", "b"]}),
    ({"structured_outputs": {"grammar": 'root ::= "x"'}}, {"grammar": 'root ::= "x"'}),
    ({"structured_outputs": {"json_object": True}}, {"json_object": True}),
    ({"guided_json": '{"type": "object"}'}, {"json_schema": {"type": "object"}}),
    ({"guided_regex": "[0-9]+"}, {"regex": "[0-9]+"}),
    ({"guided_choice": ["x", "y"]}, {"choice": ["x", "y"]}),
    ({"guided_grammar": 'root ::= "y"'}, {"grammar": 'root ::= "y"'}),
])
def test_each_spelling_becomes_a_structured_output(extra, want):
    got = _chat(**extra).sampling_params(8, None).get("structured_output")
    if want is None:
        assert got is None
    else:
        assert {k: v for k, v in got.items() if v not in (None, False) and k != "compact"} == want
    completion = CompletionRequest(model="m", prompt="hi", **extra).sampling_params(8, None).get("structured_output")
    assert completion == got


@pytest.mark.parametrize("extra,param", [
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"response_format": {"kind": "json_object"}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "[1,"}}},
     "response_format.json_schema.schema"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs"),
    ({"guided_choice": ["a", ""]}, "guided_choice"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
    ({"tool_choice": "required"}, "tool_choice"),  # no tools (tests/router/test_tools.py has the rest)
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "response_format": {"type": "json_object"}},
     "response_format"),
])
def test_malformed_requests_are_400_naming_the_parameter(extra, param):
    with pytest.raises(APIError) as e:
        _chat(**extra).sampling_params(8, None)
    assert e.value.status == 400 and e.value.param == param
