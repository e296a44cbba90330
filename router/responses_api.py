"""OpenAI's Responses API (POST /v1/responses), stateless, as a shape of the chat path.

A request becomes a ChatCompletionRequest (`to_chat`): `instructions` a system message, `input` (text, or
items: messages with text parts, `function_call` items and their `function_call_output`s) the conversation,
`tools` (function tools, flat) and `tool_choice` the chat ones, `text.format` the response_format,
`max_output_tokens` max_completion_tokens. The chat path generates; `response_body` and `ResponseEvents`
reshape its answer into a Response object or the typed event stream (response.created ... response.completed).
Nothing is stored: `previous_response_id` is a 400 (there is no store to read it from), `store` is accepted
and ignored. Fields this server does not serve are a 400 naming them.
"""
from __future__ import annotations

import json
import time
import uuid

from pydantic import BaseModel, ConfigDict, Field

from router.errors import invalid
from router.protocol import ChatCompletionRequest

# Accepted and ignored: bookkeeping that changes no output (nothing is stored).
_NO_OP = frozenset({"metadata", "store", "user", "service_tier", "safety_identifier", "prompt_cache_key"})
# Accepted only at the value that asks for nothing.
_NEUTRAL = {"truncation": lambda v: v in (None, "disabled"), "include": lambda v: not v,
            "reasoning": lambda v: v is None, "background": lambda v: not v}


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str = Field(description="The served model's name.")
    input: str | list[dict] = Field(description="Text, or a list of input items (messages, function calls and "
                                                "their outputs).")
    instructions: str | None = Field(None, description="A system message put before the input.")
    max_output_tokens: int | None = Field(None, description="Most tokens to generate.")
    temperature: float | None = Field(None, description="Sampling temperature; 0 is greedy.")
    top_p: float | None = Field(None, description="Nucleus sampling mass in (0, 1].")
    tools: list[dict] | None = Field(None, description="Function tools: [{type: function, name, description, "
                                                       "parameters, strict}].")
    tool_choice: str | dict | None = Field(None, description="none | auto | required | {type: function, name}.")
    parallel_tool_calls: bool | None = Field(None, description="Allow more than one call (default true).")
    text: dict | None = Field(None, description="{format: {type: text | json_object | json_schema, name, schema}}.")
    stream: bool = Field(False, description="Stream typed events (server-sent events).")
    previous_response_id: str | None = Field(None, description="Refused: responses are not stored.")


def to_chat(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request this Responses request asks for. Raises APIError 400 naming the field."""
    for name, value in (body.model_extra or {}).items():
        neutral = _NEUTRAL.get(name)
        if (neutral is not None and not neutral(value)) or (neutral is None and name not in _NO_OP
                                                             and value is not None):
            raise invalid(f"{name} is not supported by this server's Responses API; leave it out", name)
    if body.previous_response_id is not None:
        raise invalid("previous_response_id needs stored responses, and this server stores none: send the "
                      "conversation as input items instead", "previous_response_id")
    messages = [{"role": "system", "content": body.instructions}] if body.instructions else []
    messages += _messages(body.input)
    fields = {"model": body.model, "messages": messages, "stream": body.stream}
    if body.stream:
        fields["stream_options"] = {"include_usage": True}  # the last event carries the usage
    for ours, theirs in (("max_output_tokens", "max_completion_tokens"), ("temperature", "temperature"),
                         ("top_p", "top_p"), ("parallel_tool_calls", "parallel_tool_calls")):
        if getattr(body, ours) is not None:
            fields[theirs] = getattr(body, ours)
    if body.tools:
        fields["tools"] = [_tool(t, i) for i, t in enumerate(body.tools)]
    if body.tool_choice is not None:
        fields["tool_choice"] = _tool_choice(body.tool_choice)
    fmt = _format(body.text)
    if fmt is not None:
        fields["response_format"] = fmt
    try:
        return ChatCompletionRequest(**fields)
    except ValueError as e:
        raise invalid(f"input: {e.errors()[0]['msg'] if hasattr(e, 'errors') else e}", "input") from None


def _messages(items) -> list[dict]:
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise invalid("a message item's role is user, assistant, system or developer", f"input[{i}].role")
            out.append({"role": role, "content": _text(item.get("content"), f"input[{i}].content")})
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise invalid("a function_call item has call_id, name and arguments (strings)", f"input[{i}]")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") is not None:
                out[-1]["tool_calls"].append(call)  # consecutive calls: one assistant turn
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str) or not isinstance(item.get("output"), str):
                raise invalid("a function_call_output item has call_id and output (strings)", f"input[{i}]")
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
        else:
            raise invalid(f"input items of type {kind!r} are not supported; use message, function_call or "
                          "function_call_output", f"input[{i}].type")
    return out


def _text(content, param: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid("content is text or a list of text parts", param)
    parts = []
    for j, part in enumerate(content):
        if not (isinstance(part, dict) and part.get("type") in ("input_text", "output_text", "text")
                and isinstance(part.get("text"), str)):
            raise invalid("only text parts (input_text, output_text) are supported", f"{param}[{j}]")
        parts.append(part["text"])
    return "".join(parts)


def _tool(tool, i: int) -> dict:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise invalid("only function tools are supported: {type: function, name, description, parameters}",
                      f"tools[{i}].type")
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
    return {"type": "function", "function": function}


def _tool_choice(choice):
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice  # none | auto | required, or a malformed one the chat path names


def _format(text: dict | None) -> dict | None:
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise invalid("text.format is {type: text | json_object | json_schema, ...}", "text.format")
    if fmt["type"] != "json_schema":
        return {"type": fmt["type"]}
    return {"type": "json_schema", "json_schema": {"name": fmt.get("name", "output"), "schema": fmt.get("schema"),
                                                   "strict": fmt.get("strict")}}


# --------------------------------------------------------------------------------------------- the answer
def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _usage(chat_usage: dict | None) -> dict | None:
    if chat_usage is None:
        return None
    return {"input_tokens": chat_usage["prompt_tokens"], "output_tokens": chat_usage["completion_tokens"],
            "total_tokens": chat_usage["total_tokens"], "input_tokens_details": {"cached_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0}}


def _message_item(item_id: str, text: str, status: str) -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def _call_item(item_id: str, call: dict, status: str) -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call["id"], "name": call["function"]["name"],
            "arguments": call["function"]["arguments"], "status": status}


class ResponseShape:
    """The Response object's fields that echo the request, for one request."""

    def __init__(self, body: ResponsesRequest, model: str):
        self.body, self.model = body, model
        self.id = _new_id("resp")
        self.created_at = int(time.time())

    def response(self, status: str, output: list[dict], usage: dict | None, finish_reason: str | None) -> dict:
        b = self.body
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if finish_reason == "length" else None,
                "instructions": b.instructions, "max_output_tokens": b.max_output_tokens, "model": self.model,
                "output": output, "parallel_tool_calls": b.parallel_tool_calls is not False,
                "previous_response_id": None, "temperature": b.temperature, "top_p": b.top_p,
                "tool_choice": b.tool_choice if b.tool_choice is not None else ("auto" if b.tools else "none"),
                "tools": b.tools or [], "text": b.text or {"format": {"type": "text"}}, "truncation": "disabled",
                "usage": usage, "metadata": (b.model_extra or {}).get("metadata") or {}, "store": False}

    @staticmethod
    def status(finish_reason: str | None) -> str:
        return "incomplete" if finish_reason == "length" else "completed"

    def whole(self, chat: dict) -> dict:
        """The Response for a whole chat completion body."""
        choice = chat["choices"][0]
        message, finish = choice["message"], choice["finish_reason"]
        status = self.status(finish)
        output = [_message_item(_new_id("msg"), message["content"], status)] if message.get("content") else []
        output += [_call_item(_new_id("fc"), call, "completed") for call in message.get("tool_calls") or []]
        return self.response(status, output, _usage(chat.get("usage")), finish)


class ResponseEvents:
    """The chat path's SSE chunks (router/output.py) in, the Responses API's typed events out."""

    def __init__(self, shape: ResponseShape):
        self.shape = shape
        self.seq = 0
        self.output: list[dict] = []
        self.text_item: dict | None = None  # the message item being written
        self.finish: str | None = None
        self.usage: dict | None = None

    def _event(self, kind: str, **fields) -> str:
        event = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n"

    async def sse(self, chat_sse):
        start = self.shape.response("in_progress", [], None, None)
        yield self._event("response.created", response=start)
        yield self._event("response.in_progress", response=start)
        async for raw in chat_sse:
            data = raw[len("data: "):].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                error = chunk["error"]
                yield self._event("error", code=error.get("code"), message=error.get("message"),
                                  param=error.get("param"))
                return
            if chunk.get("usage"):
                self.usage = _usage(chunk["usage"])
            for choice in chunk.get("choices") or []:
                for event in self._delta(choice["delta"]):
                    yield event
                self.finish = choice.get("finish_reason") or self.finish
        for event in self._close_text():
            yield event
        status = self.shape.status(self.finish)
        final = self.shape.response(status, self.output, self.usage, self.finish)
        yield self._event("response.completed" if status == "completed" else "response.incomplete", response=final)

    def _delta(self, delta: dict):
        if delta.get("content"):
            if self.text_item is None:
                self.text_item = _message_item(_new_id("msg"), "", "in_progress")
                self.output.append(self.text_item)
                index = len(self.output) - 1
                yield self._event("response.output_item.added", output_index=index,
                                  item={**self.text_item, "content": []})
                yield self._event("response.content_part.added", item_id=self.text_item["id"], output_index=index,
                                  content_index=0, part={"type": "output_text", "text": "", "annotations": []})
            self.text_item["content"][0]["text"] += delta["content"]
            yield self._event("response.output_text.delta", item_id=self.text_item["id"],
                              output_index=self.output.index(self.text_item), content_index=0,
                              delta=delta["content"])
        for call in delta.get("tool_calls") or []:  # the chat path sends each call whole, once complete
            for event in self._close_text():
                yield event
            item = _call_item(_new_id("fc"), call, "completed")
            self.output.append(item)
            index = len(self.output) - 1
            yield self._event("response.output_item.added", output_index=index,
                              item={**item, "arguments": "", "status": "in_progress"})
            yield self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                              delta=item["arguments"])
            yield self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                              arguments=item["arguments"])
            yield self._event("response.output_item.done", output_index=index, item=item)

    def _close_text(self):
        item, self.text_item = self.text_item, None
        if item is None:
            return
        item["status"] = self.shape.status(self.finish) if self.finish else "completed"
        index, part = self.output.index(item), item["content"][0]
        yield self._event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                          text=part["text"])
        yield self._event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                          part=part)
        yield self._event("response.output_item.done", output_index=index, item=item)
