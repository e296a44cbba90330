"""router/responses_api.py: the Responses API (POST /v1/responses, stateless) through the unmodified `openai`
client against the session's server: text and items in, the same output as the chat path, the typed event
stream ending in the whole response, function calls and their outputs, text.format, and 400s for what is
not served (previous_response_id, non-function tools, unknown fields)."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

pytestmark = pytest.mark.ray

WEATHER = {"type": "function", "name": "weather", "description": "Forecast.", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"]}}
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}


def _create(server, **kw):
    return server.openai().responses.create(model=server.model, temperature=0, **kw)


def test_text_in_text_out_as_the_chat_path_writes_it(tandem_server):
    got = _create(tandem_server, instructions="Be brief.", input="Hello", max_output_tokens=12)
    chat = tandem_server.openai().chat.completions.create(
        model=tandem_server.model, temperature=0, max_tokens=12,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}])
    assert got.id.startswith("resp_") and got.object == "response"
    assert got.output_text == (chat.choices[0].message.content or "")
    assert got.usage.input_tokens == chat.usage.prompt_tokens
    assert got.usage.output_tokens == chat.usage.completion_tokens
    finish = chat.choices[0].finish_reason
    assert got.status == ("incomplete" if finish == "length" else "completed")
    if finish == "length":
        assert got.incomplete_details.reason == "max_output_tokens"


def test_the_event_stream_ends_in_the_whole_response(tandem_server):
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Hello"}]}]
    whole = _create(tandem_server, input=items, max_output_tokens=10)
    events = list(_create(tandem_server, input=items, max_output_tokens=10, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert text == final.output_text == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens and final.status == whole.status
    if text:
        assert kinds.index("response.output_item.added") < kinds.index("response.output_text.delta") \
            < kinds.index("response.output_text.done") < kinds.index("response.output_item.done")


@pytest.mark.parametrize("stream", [False, True])
def test_function_calls_and_their_outputs(tandem_server, stream):
    kw = dict(input="Weather in Oslo?", tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
              max_output_tokens=120)
    if stream:
        events = list(_create(tandem_server, stream=True, **kw))
        assert "response.function_call_arguments.done" in [e.type for e in events]
        got = events[-1].response
    else:
        got = _create(tandem_server, **kw)
    calls = [item for item in got.output if item.type == "function_call"]
    assert calls and all(c.name == "weather" and c.call_id.startswith("call_") for c in calls)
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    follow = ([{"role": "user", "content": "Weather in Oslo?"}]
              + [{"type": "function_call", "call_id": c.call_id, "name": c.name, "arguments": c.arguments}
                 for c in calls]
              + [{"type": "function_call_output", "call_id": c.call_id, "output": "sunny"} for c in calls])
    after = _create(tandem_server, input=follow, tools=[WEATHER], tool_choice="none", max_output_tokens=6)
    assert after.status in ("completed", "incomplete") and not any(i.type == "function_call" for i in after.output)


def test_text_format_json_schema(tandem_server):
    got = _create(tandem_server, input="Answer", max_output_tokens=30,
                  text={"format": {"type": "json_schema", "name": "answer", "schema": SCHEMA, "strict": True}})
    assert got.status == "completed"
    jsonschema.validate(json.loads(got.output_text), SCHEMA)


@pytest.mark.parametrize("kw,param", [
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"extra_body": {"frobnicate": 1}}, "frobnicate"),
    ({"input": [{"type": "image", "url": "x"}]}, "input[0].type"),
])
def test_what_is_not_served_is_400_naming_it(tandem_server, kw, param):
    args = {"input": "Hello", "max_output_tokens": 4, **kw}
    with pytest.raises(openai.BadRequestError) as e:
        _create(tandem_server, **args)
    assert e.value.body["param"] == param, e.value.body
    ok = _create(tandem_server, input="Hello", max_output_tokens=2, metadata={"k": "v"}, store=False)
    assert ok.status in ("completed", "incomplete")
