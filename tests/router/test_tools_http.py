"""Tool calling through the served path (router -> prefill compiles the structural tag -> hand-over ->
tp=2 decode) with the unmodified `openai` client. The tiny target has no skill: schema-valid arguments
come from the grammar, so every call must validate (jsonschema) against its tool's parameters."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

pytestmark = pytest.mark.ray

WEATHER = {"type": "function", "function": {"name": "weather", "description": "Forecast.", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"enum": [1, 2, 3]}},
    "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "time", "parameters": {
    "type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"]}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "Weather in Oslo?"}]


def _ask(server, **kw):
    kw.setdefault("max_tokens", 120)
    return server.openai().chat.completions.create(model=server.model, messages=kw.pop("messages", ASK),
                                                   tools=TOOLS, temperature=0, **kw)


def _calls(message) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


def _assert_valid_calls(choice, names: set[str]) -> None:
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def _streamed(server, **kw):
    """The stream reassembled as the openai client's users do it: content, calls by index, finish."""
    content, calls, finish = "", {}, None
    for chunk in _ask(server, stream=True, **kw):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            entry = calls.setdefault(call.index, ["", ""])
            if call.function.name:
                entry[0] = call.function.name
            entry[1] += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return content or None, [tuple(calls[i]) for i in sorted(calls)], finish


@pytest.mark.parametrize("choice,names", [
    ("required", {"weather", "time"}),
    ({"type": "function", "function": {"name": "time"}}, {"time"}),
])
def test_a_forced_call_validates_and_streams_the_same(tandem_server, choice, names):
    whole = _ask(tandem_server, tool_choice=choice).choices[0]
    _assert_valid_calls(whole, names)
    assert not whole.message.content
    if isinstance(choice, dict):
        assert len(whole.message.tool_calls) == 1
    assert _streamed(tandem_server, tool_choice=choice) == (None, _calls(whole.message), "tool_calls")


def test_one_call_when_parallel_calls_are_off(tandem_server):
    whole = _ask(tandem_server, tool_choice="required", parallel_tool_calls=False).choices[0]
    _assert_valid_calls(whole, {"weather", "time"})
    assert len(whole.message.tool_calls) == 1


def test_auto_answers_in_text_or_with_a_well_formed_call(tandem_server):
    whole = _ask(tandem_server).choices[0]
    if whole.message.tool_calls:
        _assert_valid_calls(whole, {"weather", "time"})
    else:
        assert whole.finish_reason in ("stop", "length") and isinstance(whole.message.content, str)
    content, calls, finish = _streamed(tandem_server)
    assert (content, calls, finish) == (whole.message.content, _calls(whole.message), whole.finish_reason)


def test_a_conversation_with_tool_results_continues(tandem_server):
    first = _ask(tandem_server, tool_choice={"type": "function", "function": {"name": "weather"}}).choices[0]
    call = first.message.tool_calls[0]
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                         "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    second = _ask(tandem_server, messages=history, tool_choice="none", max_tokens=8).choices[0]
    assert second.finish_reason in ("stop", "length") and not second.message.tool_calls


@pytest.mark.parametrize("kw,param", [
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "array", "uniqueItems": True}}}}}]}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
     "tools[0].function.parameters"),
    ({"tool_choice": {"type": "function", "function": {"name": "nowhere"}}}, "tool_choice"),
    ({"tool_choice": "always"}, "tool_choice"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"$ref": "#/nowhere"}}}}}], "tool_choice": "required"}, "tools"),  # the prefill compile refuses it
])
def test_bad_tool_requests_are_400_and_the_server_keeps_serving(tandem_server, kw, param):
    client = tandem_server.openai()
    args = {"model": tandem_server.model, "messages": ASK, "max_tokens": 8, "tools": TOOLS, **kw}
    if args["tools"] is None:
        del args["tools"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**args)
    assert e.value.body["param"] == param, e.value.body
    ok = client.chat.completions.create(model=tandem_server.model, messages=ASK, max_tokens=4, temperature=0)
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_completions_refuse_tools(tandem_server):
    with pytest.raises(openai.BadRequestError) as e:
        tandem_server.openai().completions.create(model=tandem_server.model, prompt="hi", max_tokens=4,
                                                  extra_body={"tools": TOOLS})
    assert e.value.body["param"] == "tools"


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "weather"}}])
def test_calls_cut_by_max_tokens_keep_the_complete_ones_stream_and_whole_alike(tandem_server, choice):
    """Pins issue 32 (1): a later call (or only the closing `</tool_call>`) cut by max_tokens made the whole
    response `tool_calls: null` with the raw markup as content, while the stream delivered the calls."""
    full = _ask(tandem_server, tool_choice=choice).choices[0]
    spent = _ask(tandem_server, tool_choice=choice).usage.completion_tokens
    full_calls = _calls(full.message)
    assert full_calls
    for max_tokens in sorted({1, 3, spent // 3, spent // 2, spent - 2, spent - 1}):
        whole = _ask(tandem_server, tool_choice=choice, max_tokens=max_tokens).choices[0]
        calls = _calls(whole.message)
        assert whole.finish_reason == "length", max_tokens
        assert whole.message.content is None, (max_tokens, whole.message.content)  # no markup as content
        assert calls == full_calls[:len(calls)], max_tokens  # complete calls only, as generated
        for name, arguments in calls:
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])
        assert _streamed(tandem_server, tool_choice=choice, max_tokens=max_tokens) == (None, calls, "length")
    if isinstance(choice, dict):  # one call: the last token cut is in `</tool_call>`, after the arguments
        assert _calls(_ask(tandem_server, tool_choice=choice, max_tokens=spent - 1).choices[0].message) == full_calls
