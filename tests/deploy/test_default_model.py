"""`tandem serve` with no flags, as `make serve` runs it: SmolLM2-135M-Instruct with its MTP head (when the
prebuilt head is present), answered through the unmodified openai client: chat, streaming, a json_schema
response format (valid against the schema) and a forced tool call (its arguments valid against the function)."""
from __future__ import annotations

import json

import pytest

from tests.support.served import DEFAULT_SERVER

pytestmark = [pytest.mark.slow, pytest.mark.default_model_server]

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}


@pytest.fixture
def client(smollm2_dir):
    """On `tandem serve` with no flags (smollm2_dir: the default model's conversion is cached before it starts)."""
    from openai import OpenAI

    return OpenAI(base_url=f"{DEFAULT_SERVER.get()}/v1", api_key="none", timeout=300)


def test_the_default_is_smollm2(client):
    assert [m.id for m in client.models.list().data] == ["smollm2-135m-instruct"]
    assert client.models.retrieve("smollm2-135m-instruct").id == "smollm2-135m-instruct"


def test_chat_whole_and_streamed_agree(client):
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    whole = client.chat.completions.create(model="smollm2-135m-instruct", messages=messages, max_tokens=16,
                                           temperature=0)
    stream = client.chat.completions.create(model="smollm2-135m-instruct", messages=messages, max_tokens=16,
                                            temperature=0, stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert whole.choices[0].message.content == text and "Paris" in text


def test_json_schema_response_is_valid(client):
    import jsonschema

    out = client.chat.completions.create(
        model="smollm2-135m-instruct", messages=[{"role": "user", "content": "A person as JSON."}], max_tokens=64,
        temperature=0, response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}})
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMA)


def test_a_required_tool_call_has_valid_arguments(client):
    import jsonschema

    out = client.chat.completions.create(
        model="smollm2-135m-instruct", messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER], tool_choice="required", max_tokens=96, temperature=0)
    calls = out.choices[0].message.tool_calls
    assert out.choices[0].finish_reason == "tool_calls" and calls and calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER["function"]["parameters"])
