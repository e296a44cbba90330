"""The `openai` client's own helpers against the served model (tests/router/conftest.py's `served`: the tiny
model, and marked slow the real default model), as their users call them (issue 32): `parse`
with a Pydantic model (chat and Responses), `pydantic_function_tool` (strict) tool calls parsed back into
the model, and the chat stream helper's accumulated final message. They judge protocol, not prose: the tiny
model writes what the grammar lets it."""
from __future__ import annotations

from typing import Literal

import openai
import pytest
from pydantic import BaseModel

pytestmark = pytest.mark.ray


class Pet(BaseModel):
    kind: Literal["cat", "dog"]
    legs: Literal[3, 4]


class Weather(BaseModel):
    city: Literal["Paris", "Oslo"]


ASK = [{"role": "user", "content": "A pet?"}]


def test_chat_parse_with_a_pydantic_model(served):
    got = served.openai().chat.completions.parse(model=served.model, messages=ASK, temperature=0,
                                                 max_tokens=40, response_format=Pet)
    message = got.choices[0].message
    assert got.choices[0].finish_reason == "stop" and isinstance(message.parsed, Pet)
    assert Pet.model_validate_json(message.content) == message.parsed


def test_strict_function_tools_parse_back_into_their_model(served):
    got = served.openai().chat.completions.parse(
        model=served.model, messages=[{"role": "user", "content": "Weather?"}], temperature=0,
        max_tokens=120, tools=[openai.pydantic_function_tool(Weather)], tool_choice="required",
        parallel_tool_calls=False)
    (call,) = got.choices[0].message.tool_calls
    assert got.choices[0].finish_reason == "tool_calls" and call.function.name == "Weather"
    assert isinstance(call.function.parsed_arguments, Weather)


def test_the_chat_stream_helper_accumulates_the_whole_message(served):
    client = served.openai()
    kw = dict(model=served.model, messages=ASK, temperature=0, max_tokens=40, response_format=Pet)
    with client.chat.completions.stream(**kw) as stream:
        deltas = "".join(e.delta for e in stream if e.type == "content.delta")
        final = stream.get_final_completion()
    whole = client.chat.completions.parse(**kw)
    assert deltas == final.choices[0].message.content == whole.choices[0].message.content
    assert final.choices[0].message.parsed == whole.choices[0].message.parsed


def test_responses_parse_with_a_pydantic_model(served):
    got = served.openai().responses.parse(model=served.model, input="A pet?", temperature=0,
                                          max_output_tokens=40, text_format=Pet)
    assert got.status == "completed" and isinstance(got.output_parsed, Pet)
