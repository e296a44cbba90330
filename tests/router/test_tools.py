"""router/tools.py and router/tool_parser.py without Ray: tools and tool_choice validated (each bad input
an APIError 400 naming the parameter), the structural tag each choice builds (compiled and walked with
real xgrammar), the prompt a template without tool support sees, and generated text parsed into
tool_calls whole and as streaming deltas (which reassemble to the whole parse)."""
from __future__ import annotations

import json

import pytest

from router.errors import APIError
from router.protocol import ChatCompletionRequest, CompletionRequest
from router.tool_parser import ToolCallStream, parse_tool_calls
from router.tools import chat_messages, tools_preamble

WEATHER = {"type": "function", "function": {"name": "weather", "description": "Forecast for a city.",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "time"}}
NAMES = frozenset({"weather", "time"})


def _chat(**extra) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], **extra)


def _tool(name="f", **function) -> dict:
    return {"type": "function", "function": {"name": name, **function}}


# ------------------------------------------------------------------------------------------ validation
@pytest.mark.parametrize("extra,param", [
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [WEATHER, {"type": "function"}]}, "tools[1].function"),
    ({"tools": [_tool("")]}, "tools[0].function.name"),
    ({"tools": [_tool("has space")]}, "tools[0].function.name"),
    ({"tools": [_tool("x" * 65)]}, "tools[0].function.name"),
    ({"tools": [_tool(description=3)]}, "tools[0].function.description"),
    ({"tools": [_tool(strict="yes")]}, "tools[0].function.strict"),
    ({"tools": [WEATHER, _tool("weather")]}, "tools[1].function.name"),
    ({"tools": [WEATHER, _tool(parameters="{}")]}, "tools[1].function.parameters"),
    ({"tools": [WEATHER, _tool(parameters={"type": "string"})]}, "tools[1].function.parameters"),
    ({"tools": [_tool(parameters={"type": "object", "properties": []})]}, "tools[0].function.parameters"),
    ({"tools": [_tool(parameters={"type": "object", "properties": {"a": {"type": "text"}}})]},
     "tools[0].function.parameters"),
    ({"tools": [_tool(parameters={"type": "object", "required": "a"})]}, "tools[0].function.parameters"),
    ({"tools": [_tool(parameters={"type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}})]},
     "tools[0].function.parameters"),  # enforce or refuse: neither backend enforces uniqueItems
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "time"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"name": "weather"}}, "tool_choice"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "weather"}}}, "tool_choice"),
    ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "response_format"),
])
def test_bad_tools_are_400_naming_the_parameter(extra, param):
    with pytest.raises(APIError) as e:
        _chat(**extra).sampling_params(8, None)
    assert e.value.status == 400 and e.value.param == param, e.value.message


@pytest.mark.parametrize("name", ["tools", "tool_choice", "parallel_tool_calls"])
def test_tools_on_completions_are_400(name):
    value = {"tools": [WEATHER], "tool_choice": "auto", "parallel_tool_calls": True}[name]
    with pytest.raises(APIError) as e:
        CompletionRequest(model="m", prompt="hi", **{name: value}).sampling_params(8, None)
    assert e.value.status == 400 and e.value.param == name


def test_tool_choice_none_constrains_nothing_and_a_response_format_may_apply():
    body = _chat(tools=[WEATHER], tool_choice="none", response_format={"type": "json_object"})
    assert body.sampling_params(8, None)["structured_output"]["json_object"] is True
    assert "structured_output" not in _chat(tools=[WEATHER], tool_choice="none").sampling_params(8, None)


def _tag(**extra) -> dict:
    return _chat(tools=[WEATHER, TIME], **extra).sampling_params(8, None)["structured_output"]["structural_tag"]


def test_each_tool_choice_builds_its_structural_tag():
    call_w = {"type": "tag", "begin": '<tool_call>\n{"name": "weather", "arguments": ',
              "content": {"type": "json_schema", "json_schema": WEATHER["function"]["parameters"]},
              "end": "}\n</tool_call>"}
    call_t = {**call_w, "begin": '<tool_call>\n{"name": "time", "arguments": ',
              "content": {"type": "json_schema", "json_schema": {"type": "object"}}}
    assert _tag() == _tag(tool_choice="auto") == {"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": ["<tool_call>"], "tags": [call_w, call_t], "stop_after_first": False}}
    assert _tag(tool_choice="required", parallel_tool_calls=False)["format"] == {
        "type": "tags_with_separator", "tags": [call_w, call_t], "separator": "\n", "at_least_one": True,
        "stop_after_first": True}
    assert _tag(tool_choice={"type": "function", "function": {"name": "weather"}})["format"] == call_w


@pytest.mark.parametrize("choice,text,ok", [
    ("required", '<tool_call>\n{"name": "time", "arguments": {}}\n</tool_call>', True),
    ("required", '<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
                 '<tool_call>\n{"name": "time", "arguments": {}}\n</tool_call>', True),
    ("required", "just text", False),
    ("required", '<tool_call>\n{"name": "weather", "arguments": {"city": "Rome"}}\n</tool_call>', False),
    ({"type": "function", "function": {"name": "weather"}},
     '<tool_call>\n{"name": "time", "arguments": {}}\n</tool_call>', False),
    ("auto", "just text", True),
    ("auto", 'see: <tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>', True),
    ("auto", 'see: <tool_call>\n{"name": "weather", "arguments": {"town": "Paris"}}\n</tool_call>', False),
])
def test_the_structural_tags_accept_calls_of_the_offered_tools_only(xgr_compiler, choice, text, ok):
    """The tags compile with the engine's compiler (compact JSON arguments) and the matcher accepts
    exactly the well-formed calls the tool_choice allows."""
    import xgrammar as xgr

    from structured.compiler import compile_structured
    from structured.request import StructuredOutput

    compiler = xgr_compiler
    matcher = xgr.GrammarMatcher(compile_structured(compiler, StructuredOutput(**_chat(
        tools=[WEATHER, TIME], tool_choice=choice).sampling_params(8, None)["structured_output"])))
    assert (matcher.accept_string(text) and matcher.is_completed()) == ok


@pytest.fixture(scope="module")
def xgr_compiler(tmp_path_factory):
    import xgrammar as xgr

    from tests.support.tiny import VOCAB, tiny_tokenizer

    tok = tiny_tokenizer(tmp_path_factory.mktemp("tok"))
    return xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok, vocab_size=VOCAB))


# ------------------------------------------------------------------------------------------ the prompt
def test_history_with_calls_renders_for_a_template_without_tools():
    body = ChatCompletionRequest(model="m", tools=[WEATHER], messages=[
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}])
    tools = body.tool_request()
    got = chat_messages(body.messages, tools, template_knows_tools=False)
    assert got == [
        {"role": "system", "content": "Be brief.\n\n" + tools_preamble(tools)},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": '<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n'
                                         '</tool_call>'},
        {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}]
    assert '"name":"weather"' in tools_preamble(tools)
    knows = chat_messages(body.messages, tools, template_knows_tools=True)
    assert knows[2]["tool_calls"] == [{"id": "call_1", "type": "function",
                                       "function": {"name": "weather", "arguments": {"city": "Oslo"}}}]
    assert knows[3] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}
    assert knows[0] == {"role": "system", "content": "Be brief."}  # the template renders the tools itself


def test_the_developer_role_is_a_system_message_unless_the_template_knows_it():
    """Pins issue 32 (4): `developer` passed validation, then a chat template without it refused it (400)."""
    body = ChatCompletionRequest(model="m", tools=[WEATHER], messages=[
        {"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"}])
    tools = body.tool_request()
    assert chat_messages(body.messages, None, template_knows_tools=False) == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert chat_messages(body.messages, tools, template_knows_tools=False)[0] == {
        "role": "system", "content": "Be brief.\n\n" + tools_preamble(tools)}
    assert chat_messages(body.messages, None, template_knows_tools=False, template_knows_developer=True)[0] == {
        "role": "developer", "content": "Be brief."}


@pytest.mark.parametrize("message,param", [
    ({"role": "tool", "content": "sunny"}, "messages[1].tool_call_id"),
    ({"role": "assistant", "tool_calls": [{"type": "function"}]}, "messages[1].tool_calls[0]"),
    ({"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                           "function": {"name": "weather", "arguments": "{oops"}}]},
     "messages[1].tool_calls[0].function.arguments"),
    ({"role": "user", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "weather"}}]},
     "messages[1].tool_calls"),
])
def test_bad_history_is_400_naming_the_message(message, param):
    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}, message])
    with pytest.raises(APIError) as e:
        chat_messages(body.messages, None, template_knows_tools=False)
    assert e.value.status == 400 and e.value.param == param


# ------------------------------------------------------------------------------------------ parsing
CALL_W = '<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
CALL_T = '<tool_call>\n{"name": "time", "arguments": {}}\n</tool_call>'


CUT_T = '<tool_call>\n{"name": "time", "arguments": {"utc": tr'


@pytest.mark.parametrize("text,content,calls", [
    (CALL_W, None, [("weather", '{"city": "Oslo"}')]),
    (CALL_W + "\n" + CALL_T, None, [("weather", '{"city": "Oslo"}'), ("time", "{}")]),
    ("Let me check. " + CALL_W + " done", "Let me check. ", [("weather", '{"city": "Oslo"}')]),
    ('<tool_call>\n{"name": "weather", "arguments": {"q": "a}\\"}", "n": {"m": [1]}}}\n</tool_call>', None,
     [("weather", '{"q": "a}\\"}", "n": {"m": [1]}}')]),
    ('<tool_call>\n{"name": "weather", "arguments": {"q": "tab\there"}}\n</tool_call>', None,
     [("weather", '{"q": "tab\\there"}')]),  # a raw control character in a string is escaped
    ("no call at all", "no call at all", []),
    ("", None, []),
    # malformed: the whole text is content, no call is invented
    ('<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>', '<tool_call>\n{"name": "nope", "arguments": '
                                                                      '{}}\n</tool_call>', []),
    ('<tool_call>\n{"name": "weather", "arguments": [1]}\n</tool_call>',
     '<tool_call>\n{"name": "weather", "arguments": [1]}\n</tool_call>', []),
    ("<tool_call>\nnot json\n</tool_call>", "<tool_call>\nnot json\n</tool_call>", []),
    # a malformed call after a complete one ends the calls
    (CALL_W + '\n<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>', None,
     [("weather", '{"city": "Oslo"}')]),
])
def test_parse_tool_calls(text, content, calls):
    got = parse_tool_calls(text, NAMES)
    assert [(c.name, c.arguments) for c in got.tool_calls] == calls
    assert got.content == content
    for call in got.tool_calls:
        assert call.id.startswith("call_") and len(call.id) == 29 and isinstance(json.loads(call.arguments), dict)


@pytest.mark.parametrize("text,content,calls", [
    # cut inside the arguments: the call is dropped, its markup is not content
    ('<tool_call>\n{"name": "weather", "arguments": {"city": "Os', None, []),
    ("Let me check. <tool_call>\n{\"na", "Let me check. ", []),
    ("<tool_call>", None, []),
    ("<", None, []),
    ("Let me check. <tool_c", "Let me check. ", []),
    # complete calls before the cut one are kept
    (CALL_W + "\n" + CUT_T, None, [("weather", '{"city": "Oslo"}')]),
    (CALL_W + "\n<tool_call>\n{\"name\": \"ti", None, [("weather", '{"city": "Oslo"}')]),
    (CALL_W + "\n<tool_", None, [("weather", '{"city": "Oslo"}')]),
    # cut after the arguments were whole (in the outer brace or `</tool_call>`): the call is complete
    ('<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}', None, [("weather", '{"city": "Oslo"}')]),
    ('<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}', None, [("weather", '{"city": "Oslo"}')]),
    ('<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_', None,
     [("weather", '{"city": "Oslo"}')]),
    (CALL_W + "\n" + CALL_T[:-3], None, [("weather", '{"city": "Oslo"}'), ("time", "{}")]),
    # the arguments' own closing brace inside a string does not complete them
    ('<tool_call>\n{"name": "weather", "arguments": {"q": "}', None, []),
])
def test_a_call_cut_by_the_end_of_the_output_is_dropped_and_complete_ones_are_kept(text, content, calls):
    """Pins issue 32 (1): a call cut by max_tokens made the whole response raw markup with tool_calls null,
    although earlier calls were complete; the stream, which had sent them, disagreed."""
    got = parse_tool_calls(text, NAMES)
    assert (got.content, [(c.name, c.arguments) for c in got.tool_calls]) == (content, calls)
    for piece in (1, 4, 1000):
        stream = ToolCallStream(NAMES)
        deltas = [d for i in range(0, len(text), piece) for d in stream.push(text[i:i + piece])] + stream.finish()
        assert _reassemble(deltas) == (content, calls)


def _reassemble(deltas: list[dict]) -> tuple[str | None, list[tuple[str, str]]]:
    """What the openai client does with a stream's deltas."""
    content, calls = "", {}
    for delta in deltas:
        content += delta.get("content") or ""
        for call in delta.get("tool_calls", []):
            entry = calls.setdefault(call["index"], {"name": None, "arguments": ""})
            if "id" in call:
                assert call["type"] == "function" and call["id"].startswith("call_") and entry["name"] is None
                entry["name"] = call["function"]["name"]
            entry["arguments"] += call["function"]["arguments"]
    return content or None, [(c["name"], c["arguments"]) for _, c in sorted(calls.items())]


@pytest.mark.parametrize("text", [
    CALL_W, CALL_W + "\n" + CALL_T, "Let me check. " + CALL_W + " done", "plain <tool text", "<tool_c",
    '<tool_call>\n{"name": "weather", "arguments": {"q": "a}\\"} \t", "n": {"m": [1]}}}\n</tool_call>',
    '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>', "x <tool_call>\n{\"na",
])
@pytest.mark.parametrize("piece", [1, 2, 3, 5, 1000])
def test_streamed_deltas_reassemble_to_the_whole_parse(text, piece):
    stream = ToolCallStream(NAMES)
    deltas = []
    for i in range(0, len(text), piece):
        deltas += stream.push(text[i:i + piece])
    deltas += stream.finish()
    whole = parse_tool_calls(text, NAMES)
    assert _reassemble(deltas) == (whole.content, [(c.name, c.arguments) for c in whole.tool_calls])
    assert [c.arguments for c in stream.calls] == [c.arguments for c in whole.tool_calls]
    assert not stream.open_call


def test_a_stream_sends_a_call_only_once_it_is_complete():
    """A partial call cannot be taken back once sent, so none is: the call arrives whole, in one delta."""
    stream = ToolCallStream(NAMES)
    assert stream.push(CALL_W[:-4]) == [] and stream.open_call
    (delta,) = stream.push(CALL_W[-4:])
    call = delta["tool_calls"][0]
    assert (call["index"], call["type"], call["function"]) == (0, "function", {"name": "weather",
                                                                              "arguments": '{"city": "Oslo"}'})
    assert not stream.open_call


@pytest.mark.parametrize("strict", [True, False, None])
def test_every_call_is_constrained_strict_or_not(strict):
    """Issue 32: strict is the default and the only mode; `strict: false` constrains the arguments too."""
    function = {**WEATHER["function"], **({} if strict is None else {"strict": strict})}
    got = _chat(tools=[{"type": "function", "function": function}], tool_choice="required").sampling_params(8, None)
    want = _chat(tools=[WEATHER], tool_choice="required").sampling_params(8, None)
    assert got["structured_output"] == want["structured_output"]
    assert '"city"' in json.dumps(got["structured_output"])
