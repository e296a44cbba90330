"""Generated text -> OpenAI `tool_calls`, whole (`parse_tool_calls`) or as streaming deltas
(`ToolCallStream`), for the format of router/tools.py:

    [text before the first call] <tool_call>\n{"name": NAME, "arguments": ARGS}\n</tool_call> [...]

`arguments` is the ARGS text as generated (what a client json.loads), with one repair: raw control
characters inside its strings (xgrammar's length-bounded JSON strings admit them; JSON does not) are
escaped. Both paths cut and repair the ARGS text the same way, so a stream reassembled by a client
equals the whole response. Text before the first call is the message content; text after the calls is
dropped (as vLLM's Hermes parser does). A call that is malformed, or names a function that was not
offered, makes the whole text plain content with no calls: nothing is invented.
"""
from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field

from router.tools import CALL_BEGIN, CALL_END

_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([A-Za-z0-9_-]{1,64})"\s*,\s*"arguments"\s*:\s*')
_MAX_HEAD = 160  # a head not matched within this many characters is not a call
# What may still close the current call's arguments: the outer "}", whitespace, a prefix of CALL_END.
_CLOSING = re.compile(r"\s*(\}\s*)?(" + "|".join(re.escape(CALL_END[:n]) for n in range(len(CALL_END), 0, -1))
                      + r")?$")


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=new_call_id)

    def body(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True, slots=True)
class ParsedMessage:
    content: str | None
    tool_calls: tuple[ToolCall, ...]


class _Escaper:
    """Escapes raw control characters inside JSON strings, fed piece by piece (state carries over)."""

    def __init__(self):
        self.in_string = False
        self.escaped = False

    def __call__(self, text: str) -> str:
        out = []
        for ch in text:
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
                elif ch < " ":
                    ch = json.dumps(ch)[1:-1]  # \n, \t, \u0001 ...
            elif ch == '"':
                self.in_string = True
            out.append(ch)
        return "".join(out)


def _close_arguments(segment: str) -> str | None:
    """The ARGS text of a call body's remainder `ARGS}` (whitespace allowed around the outer brace)."""
    stripped = segment.rstrip()
    if not stripped.endswith("}"):
        return None
    return stripped[:-1].rstrip()


def parse_tool_calls(text: str, names: frozenset[str]) -> ParsedMessage:
    """The whole text as content and calls; any malformed call makes it all content."""
    start = text.find(CALL_BEGIN)
    if start < 0:
        return ParsedMessage(text or None, ())
    calls, pos = [], start
    while True:
        begin = text.find(CALL_BEGIN, pos)
        if begin < 0:
            break
        end = text.find(CALL_END, begin)
        if end < 0:
            return ParsedMessage(text, ())  # cut short (length): no call is invented
        body = text[begin + len(CALL_BEGIN):end]
        head = _HEAD.match(body)
        arguments = _close_arguments(body[head.end():]) if head is not None else None
        if head is None or arguments is None or head.group(1) not in names:
            return ParsedMessage(text, ())
        arguments = _Escaper()(arguments)
        try:
            if not isinstance(json.loads(arguments), dict):
                return ParsedMessage(text, ())
        except json.JSONDecodeError:
            return ParsedMessage(text, ())
        calls.append(ToolCall(head.group(1), arguments))
        pos = end + len(CALL_END)
    return ParsedMessage(text[:start] or None, tuple(calls))


class ToolCallStream:
    """Streaming twin of parse_tool_calls: text deltas in, OpenAI chat `delta` dicts out.

    A call's first delta carries its index, id, type and name (arguments ""), later ones `arguments`
    fragments; content is streamed until a call begins, holding back what may be the start of
    `<tool_call>`. What has been sent cannot be taken back: a call cut short by `length` stays a partial
    call in the stream (finish_reason "length" says so), where the whole response returns the raw text.
    A malformed first call turns the rest into content, as the whole response does; after a sent call,
    anything malformed is dropped."""

    def __init__(self, names: frozenset[str]):
        self.names = names
        self.calls: list[ToolCall] = []
        # text -> head -> arguments -> text ...; a malformed call: "passthrough" (content) or, after a sent
        # call, "dropped"
        self._state = "text"
        self._buffer = ""  # received, not yet sent or consumed
        self._escape = _Escaper()
        self._handlers = {"text": self._text, "head": self._head, "arguments": self._in_arguments,
                          "dropped": self._dropped, "passthrough": self._passthrough}

    @property
    def open_call(self) -> bool:
        """A call has begun and not ended (generation was cut inside it)."""
        return self._state in ("head", "arguments")

    def push(self, text: str) -> list[dict]:
        self._buffer += text
        deltas: list[dict] = []
        while True:
            before = (self._state, self._buffer)
            deltas += self._handlers[self._state]()
            if (self._state, self._buffer) == before:
                return deltas

    def finish(self) -> list[dict]:
        """What is still held back, at the end of generation."""
        if self._state in ("text", "passthrough") and self._buffer and not self.calls:
            text, self._buffer = self._buffer, ""
            return [{"content": text}]
        if self._state == "head" and not self.calls:  # a call cut before its name: it was text
            self._malformed()
            return self._passthrough()
        return []

    def _text(self) -> list[dict]:
        found = self._buffer.find(CALL_BEGIN)
        if found >= 0:
            text, self._buffer = self._buffer[:found], self._buffer[found + len(CALL_BEGIN):]
            self._state = "head"
        else:
            keep = next((n for n in range(len(CALL_BEGIN) - 1, 0, -1) if self._buffer.endswith(CALL_BEGIN[:n])), 0)
            cut = len(self._buffer) - keep
            text, self._buffer = self._buffer[:cut], self._buffer[cut:]
        return [{"content": text}] if text and not self.calls else []  # text after calls is dropped

    def _head(self) -> list[dict]:
        head = _HEAD.match(self._buffer)
        if head is None:
            if len(self._buffer) >= _MAX_HEAD or CALL_END in self._buffer:
                return self._malformed()
            return []
        if head.end() == len(self._buffer):
            return []  # wait: whitespace may follow, which the head takes
        if head.group(1) not in self.names:
            return self._malformed()
        self._buffer = self._buffer[head.end():]
        call = ToolCall(head.group(1), "")
        self.calls.append(call)
        self._state, self._escape = "arguments", _Escaper()
        return [{"tool_calls": [{"index": len(self.calls) - 1, "id": call.id, "type": "function",
                                 "function": {"name": call.name, "arguments": ""}}]}]

    def _in_arguments(self) -> list[dict]:
        end = self._buffer.find(CALL_END)
        if end >= 0:
            last = _close_arguments(self._buffer[:end])
            if last is None:
                return self._malformed()
            self._buffer = self._buffer[end + len(CALL_END):]
            self._state = "text"
            return self._fragment(last)
        hold = _CLOSING.search(self._buffer).start()
        piece, self._buffer = self._buffer[:hold], self._buffer[hold:]
        return self._fragment(piece)

    def _passthrough(self) -> list[dict]:
        text, self._buffer = self._buffer, ""
        return [{"content": text}] if text else []

    def _dropped(self) -> list[dict]:
        self._buffer = ""
        return []

    def _malformed(self) -> list[dict]:
        if self.calls:
            self._state, self._buffer = "dropped", ""
            return []
        self._buffer, self._state = CALL_BEGIN + self._buffer, "passthrough"
        return []

    def _fragment(self, raw: str) -> list[dict]:
        if not raw:
            return []
        piece = self._escape(raw)
        self.calls[-1].arguments += piece
        return [{"tool_calls": [{"index": len(self.calls) - 1, "function": {"arguments": piece}}]}]
