"""Generated text -> OpenAI `tool_calls`, whole (`parse_tool_calls`) or as streaming deltas
(`ToolCallStream`), for the format of router/tools.py:

    [text before the first call] <tool_call>\n{"name": NAME, "arguments": ARGS}\n</tool_call> [...]

`arguments` is the ARGS text as generated (what a client json.loads), with one repair: raw control
characters inside its strings (xgrammar's length-bounded JSON strings admit them; JSON does not) are
escaped. Text before the first call is the message content; text after the calls is dropped (as vLLM's
Hermes parser does).

Whatever ended the output (max_tokens, a stop string or token), the calls it completed are returned and a
call it cut is dropped, its markup never shown as content: a call is complete once its ARGS object is (a
cut `</tool_call>` or outer brace does not matter), and an output that ends in part of a `<tool_call>`
ends in a cut call. Both paths apply the one rule (`_call`), and the stream
sends each call whole once it is complete, never a partial call it could not take back, so the stream and
the whole response always agree. A malformed first call (one the grammar would not have let through: a
function that was not offered, ARGS that is not an object) makes the whole text plain content with no
calls; a malformed call after complete ones ends the calls. Nothing is invented.
"""
from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field

from router.tools import CALL_BEGIN, CALL_END

_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([A-Za-z0-9_-]{1,64})"\s*,\s*"arguments"\s*:\s*')
# What may close a call's arguments at the end of a cut output: the outer "}", whitespace, a prefix of CALL_END.
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

    def delta(self, index: int) -> dict:
        """The call as one streaming delta (sent once it is complete)."""
        return {"tool_calls": [{"index": index, **self.body()}]}


@dataclass(frozen=True, slots=True)
class ParsedMessage:
    content: str | None
    tool_calls: tuple[ToolCall, ...]


class _Escaper:
    """Escapes raw control characters inside JSON strings."""

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


def _call(body: str, names: frozenset[str], closed: bool) -> ToolCall | None:
    """The call in `body`, the text after a `<tool_call>`: up to its `</tool_call>` (`closed`), or to the
    end of an output that ended inside it. None: malformed (closed) or cut before its arguments were whole."""
    head = _HEAD.match(body)
    if head is None or head.group(1) not in names:
        return None
    rest = body[head.end():]
    if closed:
        stripped = rest.rstrip()
        candidates = [stripped[:-1].rstrip()] if stripped.endswith("}") else []
    else:  # cut: after the arguments at most the outer brace and part of `</tool_call>` may have come
        candidates = [rest[:_CLOSING.search(rest).start()], rest.rstrip()]
    for arguments in candidates:
        arguments = _Escaper()(arguments)
        try:
            if isinstance(json.loads(arguments), dict):
                return ToolCall(head.group(1), arguments)
        except json.JSONDecodeError:
            continue
    return None


def _partial_begin(text: str) -> int:
    """The length of the start of a `<tool_call>` that `text` ends with (0: none)."""
    return next((n for n in range(len(CALL_BEGIN) - 1, 0, -1) if text.endswith(CALL_BEGIN[:n])), 0)


def parse_tool_calls(text: str, names: frozenset[str]) -> ParsedMessage:
    """The whole text as content and calls (see the module docstring for cut and malformed calls)."""
    start = text.find(CALL_BEGIN)
    if start < 0:
        return ParsedMessage(text[:len(text) - _partial_begin(text)] or None, ())
    calls, pos = [], start
    while (begin := text.find(CALL_BEGIN, pos)) >= 0:
        end = text.find(CALL_END, begin)
        call = _call(text[begin + len(CALL_BEGIN):end if end >= 0 else len(text)], names, closed=end >= 0)
        if call is None:
            if end >= 0 and not calls:
                return ParsedMessage(text, ())  # a malformed first call: it was text
            break
        calls.append(call)
        if end < 0:
            break
        pos = end + len(CALL_END)
    return ParsedMessage(text[:start] or None, tuple(calls))


class ToolCallStream:
    """Streaming twin of parse_tool_calls: text deltas in, OpenAI chat `delta` dicts out.

    Content is streamed until a call begins, holding back what may be the start of `<tool_call>`; a call is
    held until it is complete and then sent as one delta (index, id, type, name and all its arguments), so a
    call the output's end cuts is never sent: the stream gives what the whole response gives."""

    def __init__(self, names: frozenset[str]):
        self.names = names
        self.calls: list[ToolCall] = []
        # text -> call -> text ...; a malformed first call: "passthrough" (content); after a call: "dropped"
        self._state = "text"
        self._buffer = ""  # received, not yet sent or consumed
        self._handlers = {"text": self._text, "call": self._in_call, "dropped": self._dropped,
                          "passthrough": self._passthrough}

    @property
    def open_call(self) -> bool:
        """A call has begun and not ended."""
        return self._state == "call"

    def push(self, text: str) -> list[dict]:
        self._buffer += text
        deltas: list[dict] = []
        while True:
            before = (self._state, self._buffer)
            deltas += self._handlers[self._state]()
            if (self._state, self._buffer) == before:
                return deltas

    def finish(self) -> list[dict]:
        """What is still held back at the end of the output: a call its arguments made complete (a started
        `<tool_call>` held back as text is a cut call too)."""
        text, self._buffer = self._buffer, ""
        state, self._state = self._state, "dropped"
        call = _call(text, self.names, closed=False) if state == "call" else None
        return self._sent(call) if call is not None else []

    def _text(self) -> list[dict]:
        found = self._buffer.find(CALL_BEGIN)
        if found >= 0:
            text, self._buffer = self._buffer[:found], self._buffer[found + len(CALL_BEGIN):]
            self._state = "call"
        else:
            cut = len(self._buffer) - _partial_begin(self._buffer)
            text, self._buffer = self._buffer[:cut], self._buffer[cut:]
        return [{"content": text}] if text and not self.calls else []  # text after calls is dropped

    def _in_call(self) -> list[dict]:
        end = self._buffer.find(CALL_END)
        if end < 0:
            return []
        call = _call(self._buffer[:end], self.names, closed=True)
        if call is None:
            if self.calls:
                self._state, self._buffer = "dropped", ""
            else:
                self._state, self._buffer = "passthrough", CALL_BEGIN + self._buffer
            return []
        self._buffer, self._state = self._buffer[end + len(CALL_END):], "text"
        return self._sent(call)

    def _sent(self, call: ToolCall) -> list[dict]:
        self.calls.append(call)
        return [call.delta(len(self.calls) - 1)]

    def _passthrough(self) -> list[dict]:
        text, self._buffer = self._buffer, ""
        return [{"content": text}] if text else []

    def _dropped(self) -> list[dict]:
        self._buffer = ""
        return []
