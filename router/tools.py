"""Tool calling over the OpenAI chat API: `tools`, `tool_choice` and `parallel_tool_calls` validated,
turned into the grammar that constrains the output, and rendered into the prompt.

The tool-call text format (Hermes / Qwen 2.5 style, which many open chat models are trained on):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one block per call; under tool_choice "required" several calls are separated by a newline. The
constraint is an xgrammar structural tag (engine StructuredOutput.structural_tag, compiled on the
prefill side like any grammar): each call's arguments are constrained by the tool's `parameters` schema
(compact JSON, like response_format's) whatever the function's `strict` says. Strict is the default, and
the only mode: OpenAI's `strict: false` promises nothing about the arguments, so constraining them
breaks no client, while an open model left unconstrained writes arguments its schema rejects. By choice:
  "required": one or more calls and nothing else (one if parallel_tool_calls is false);
  named:      exactly one call of that function;
  "auto":     free text, in which `<tool_call>` starts a constrained call (xgrammar's triggered tags);
  "none":     no constraint from the tools (the model still sees them, as vLLM does).
router/tool_parser.py turns the generated text back into OpenAI `tool_calls`.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from engine.errors import InvalidRequestError
from router.errors import invalid
from structured.schema.support import check_enforceable

CALL_BEGIN = "<tool_call>"
CALL_END = "</tool_call>"
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_SCHEMA_KINDS = ("object", "array", "string", "number", "integer", "boolean", "null")


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    description: str | None
    parameters: dict  # a JSON schema of an object; {"type": "object"} when the tool gave none

    def openai(self) -> dict:
        function = {"name": self.name, "parameters": self.parameters}
        if self.description:
            function = {"name": self.name, "description": self.description, "parameters": self.parameters}
        return {"type": "function", "function": function}


@dataclass(frozen=True, slots=True)
class ToolRequest:
    tools: tuple[Tool, ...]
    choice: str  # "none" | "auto" | "required" | "named"
    named: str | None = None  # the function tool_choice names
    parallel: bool = True  # parallel_tool_calls: more than one call allowed

    @property
    def constrains(self) -> bool:
        return self.choice != "none"

    @property
    def names(self) -> frozenset[str]:
        return frozenset(t.name for t in self.tools)

    def structural_tag(self) -> dict:
        """The xgrammar structural tag for this choice (engine StructuredOutput(structural_tag=...))."""
        assert self.constrains
        if self.choice == "named":
            return _tag(next(_call_tag(t) for t in self.tools if t.name == self.named))
        calls = [_call_tag(t) for t in self.tools]
        if self.choice == "required":
            return _tag({"type": "tags_with_separator", "tags": calls, "separator": "\n", "at_least_one": True,
                         "stop_after_first": not self.parallel})
        return _tag({"type": "triggered_tags", "triggers": [CALL_BEGIN], "tags": calls,
                     "stop_after_first": not self.parallel})


def call_head(name: str) -> str:
    """What a call of `name` starts with, up to its arguments (the grammar writes exactly this)."""
    return f'{CALL_BEGIN}\n{{"name": "{name}", "arguments": '


CALL_TAIL = "}\n" + CALL_END


def _call_tag(tool: Tool) -> dict:
    return {"type": "tag", "begin": call_head(tool.name),
            "content": {"type": "json_schema", "json_schema": tool.parameters}, "end": CALL_TAIL}


def _tag(fmt: dict) -> dict:
    return {"type": "structural_tag", "format": fmt}


# ---------------------------------------------------------------------------------------------- validation
def tool_request(tools, tool_choice, parallel_tool_calls) -> ToolRequest | None:
    """The validated tool request of a chat body (None: no tools). Raises APIError 400 naming the parameter."""
    if tools is None or tools == []:
        if tool_choice is not None:
            raise invalid("tool_choice is only allowed when tools are given", param="tool_choice")
        return None
    if not isinstance(tools, list):
        raise invalid("tools must be a list of {type: function, function: {name, description, parameters}}",
                      param="tools")
    parsed = tuple(_tool(t, f"tools[{i}]") for i, t in enumerate(tools))
    seen: set[str] = set()
    for i, tool in enumerate(parsed):
        if tool.name in seen:
            raise invalid(f"two tools are named {tool.name!r}; function names must be unique",
                          param=f"tools[{i}].function.name")
        seen.add(tool.name)
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise invalid("parallel_tool_calls must be true or false", param="parallel_tool_calls")
    parallel = True if parallel_tool_calls is None else parallel_tool_calls
    choice = "auto" if tool_choice is None else tool_choice
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise invalid(f"tool_choice must be none, auto, required or {{type: function, function: {{name}}}}, "
                          f"got {choice!r}", param="tool_choice")
        return ToolRequest(parsed, choice, None, parallel)
    function = choice.get("function") if isinstance(choice, dict) else None
    if not (isinstance(choice, dict) and choice.get("type") == "function" and isinstance(function, dict)
            and isinstance(function.get("name"), str)):
        raise invalid("a named tool_choice is {type: function, function: {name}}", param="tool_choice")
    if function["name"] not in seen:
        raise invalid(f"tool_choice names function {function['name']!r}, which is not among the tools "
                      f"{sorted(seen)}", param="tool_choice")
    return ToolRequest(parsed, "named", function["name"], parallel)


def _tool(raw, where: str) -> Tool:
    if not isinstance(raw, dict) or raw.get("type") != "function":
        raise invalid("a tool is {type: function, function: {name, description, parameters}}", param=f"{where}.type")
    function = raw.get("function")
    if not isinstance(function, dict):
        raise invalid("a tool needs a function object {name, description, parameters}", param=f"{where}.function")
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise invalid("a function name is 1-64 characters of a-z, A-Z, 0-9, _ and -", param=f"{where}.function.name")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise invalid("a function description is a string", param=f"{where}.function.description")
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise invalid("strict is true or false", param=f"{where}.function.strict")
    parameters = function.get("parameters")
    param = f"{where}.function.parameters"
    if parameters is None:
        parameters = {"type": "object"}
    _check_parameters(parameters, param)
    return Tool(name, description, parameters)


def _check_parameters(schema, param: str) -> None:
    """A JSON schema of the arguments object, which the grammar can enforce (enforce or refuse)."""
    if not isinstance(schema, dict):
        raise invalid("parameters must be a JSON schema object", param=param)
    if schema.get("type", "object") != "object":
        raise invalid(f"parameters must describe a JSON object (type: object), got type {schema.get('type')!r}",
                      param=param)
    _check_shape(schema, param)
    try:
        check_enforceable(schema)
    except InvalidRequestError as e:
        raise invalid(e.message, param=param) from None


def _check_shape(schema, param: str, path: str = "#") -> None:
    """The structural mistakes a JSON schema can have that a compile would only report vaguely."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise invalid(f"{path} must be a schema (an object or a boolean), got {type(schema).__name__}", param=param)
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind] if kind is not None else []
    if not all(k in _SCHEMA_KINDS for k in kinds):
        raise invalid(f"{path}/type must be one of {list(_SCHEMA_KINDS)}, got {kind!r}", param=param)
    props = schema.get("properties")
    if props is not None:
        if not isinstance(props, dict):
            raise invalid(f"{path}/properties must be an object of schemas", param=param)
        for name, sub in props.items():
            _check_shape(sub, param, f"{path}/properties/{name}")
    required = schema.get("required")
    if required is not None and not (isinstance(required, list) and all(isinstance(r, str) for r in required)):
        raise invalid(f"{path}/required must be a list of property names", param=param)
    items = schema.get("items")
    if items is not None:
        _check_shape(items, param, f"{path}/items")
    enum = schema.get("enum")
    if enum is not None and not (isinstance(enum, list) and enum):
        raise invalid(f"{path}/enum must be a non-empty list", param=param)


# ---------------------------------------------------------------------------------------------- the prompt
def chat_messages(messages, tools: ToolRequest | None, template_knows_tools: bool,
                  template_knows_developer: bool = False) -> list[dict]:
    """The chat template's messages. History with tool calls (assistant `tool_calls`, `tool` results)
    goes to a template that knows tools in transformers' shape; for one that does not (the zoo's and
    the test models' templates know only system/user/assistant), this renders the tools into a system
    preamble, past calls into the assistant's text in the tool-call format, and tool results into user
    turns, so any template can show them. OpenAI's `developer` role (its newer name for the system
    message) is a `system` message unless the template names `developer` itself: most open models'
    templates refuse a role they do not know."""
    out = []
    for i, m in enumerate(messages):
        text = m.text()
        if m.role == "developer" and not template_knows_developer:
            m = m.model_copy(update={"role": "system"})
        if m.role == "tool":
            if not m.tool_call_id:
                raise invalid("a tool message needs the tool_call_id it answers", param=f"messages[{i}].tool_call_id")
            out.append({"role": "tool", "content": text, "tool_call_id": m.tool_call_id} if template_knows_tools
                       else {"role": "user", "content": f"<tool_response>\n{text}\n</tool_response>"})
            continue
        calls = _history_calls(m.tool_calls, i) if m.tool_calls else []
        if calls and m.role != "assistant":
            raise invalid("only assistant messages carry tool_calls", param=f"messages[{i}].tool_calls")
        if not calls:
            out.append({"role": m.role, "content": text})
        elif template_knows_tools:
            out.append({"role": "assistant", "content": text, "tool_calls": [
                {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}
                for cid, name, args in calls]})
        else:
            rendered = "\n".join(f"{call_head(name)}{json.dumps(args, ensure_ascii=False)}{CALL_TAIL}"
                                 for _, name, args in calls)
            out.append({"role": "assistant", "content": f"{text}{rendered}"})
    if tools is not None and not template_knows_tools:
        preamble = tools_preamble(tools)
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{preamble}"}
        else:
            out.insert(0, {"role": "system", "content": preamble})
    return out


def tools_preamble(tools: ToolRequest) -> str:
    """The tools as a system message (for templates without tool support): short, as context is dear."""
    listed = "\n".join(json.dumps(t.openai(), ensure_ascii=False, separators=(",", ":")) for t in tools.tools)
    return (f"You can call these functions:\n<tools>\n{listed}\n</tools>\nTo call one, reply with\n"
            f'{CALL_BEGIN}\n{{"name": <name>, "arguments": <arguments object>}}\n{CALL_END}')


def template_tools(tools: ToolRequest | None) -> list[dict] | None:
    """The `tools` argument for a template that knows tools."""
    return None if tools is None else [t.openai() for t in tools.tools]


def _history_calls(tool_calls, i: int) -> list[tuple[str, str, object]]:
    """(id, name, arguments as a value) of an assistant message's past calls."""
    if not isinstance(tool_calls, list):
        raise invalid("tool_calls must be a list", param=f"messages[{i}].tool_calls")
    calls = []
    for j, call in enumerate(tool_calls):
        where = f"messages[{i}].tool_calls[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not (isinstance(call, dict) and call.get("type", "function") == "function" and isinstance(function, dict)
                and isinstance(function.get("name"), str) and isinstance(call.get("id", ""), str)):
            raise invalid("a tool call is {id, type: function, function: {name, arguments}}", param=where)
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                raise invalid("tool call arguments must be a JSON object (as a string)",
                              param=f"{where}.function.arguments") from None
        if not isinstance(arguments, dict):
            raise invalid("tool call arguments must be a JSON object", param=f"{where}.function.arguments")
        calls.append((call.get("id", ""), function["name"], arguments))
    return calls
