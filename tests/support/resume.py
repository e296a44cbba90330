"""What the resumption tests read from a response through the openai client: the whole output a client ends up
with (streamed chunks joined), so that an interrupted-and-resumed request can be compared with an uninterrupted
run of the same request byte for byte (router/generation.py's resumption)."""
from __future__ import annotations

import asyncio

import openai


async def completion(client: openai.AsyncOpenAI, model: str, prompt: str, stream: bool,
                     started: asyncio.Event | None = None, **kw) -> dict:
    """{"outcome": "finished" | "error", "text", "finish_reason", "tokens" (the logprobs' tokens, when asked),
    "logprobs", "error"}; `started` is set once a stream has had 3 chunks (or at once for a whole response)."""
    out = {"outcome": "finished", "text": "", "finish_reason": None, "tokens": [], "logprobs": [], "error": ""}
    try:
        if not stream:
            if started is not None:
                started.set()
            resp = await client.completions.create(model=model, prompt=prompt, stream=False, **kw)
            choice = resp.choices[0]
            out.update(text=choice.text, finish_reason=choice.finish_reason)
            if choice.logprobs is not None:
                out.update(tokens=list(choice.logprobs.tokens), logprobs=list(choice.logprobs.token_logprobs))
            return out
        chunks = 0
        async for chunk in await client.completions.create(model=model, prompt=prompt, stream=True, **kw):
            for choice in chunk.choices:
                out["text"] += choice.text
                out["finish_reason"] = choice.finish_reason or out["finish_reason"]
                if choice.logprobs is not None:
                    out["tokens"] += list(choice.logprobs.tokens)
                    out["logprobs"] += list(choice.logprobs.token_logprobs)
            chunks += 1
            if chunks == 3 and started is not None:
                started.set()
    except openai.APIError as e:
        out.update(outcome="error", error=str(e))
        if started is not None:
            started.set()
    return out


async def chat(client: openai.AsyncOpenAI, model: str, content: str, stream: bool,
               started: asyncio.Event | None = None, **kw) -> dict:
    """As `completion`, for /v1/chat/completions: the message's content, and its tool calls as (name, arguments)
    in index order (their ids are random per request)."""
    out = {"outcome": "finished", "text": "", "finish_reason": None, "tokens": [], "error": ""}
    messages = [{"role": "user", "content": content}]
    calls: dict[int, list[str]] = {}
    try:
        if not stream:
            if started is not None:
                started.set()
            resp = await client.chat.completions.create(model=model, messages=messages, stream=False, **kw)
            message = resp.choices[0].message
            out.update(text=message.content or "", finish_reason=resp.choices[0].finish_reason,
                       tokens=[(c.function.name, c.function.arguments) for c in message.tool_calls or []])
            return out
        chunks = 0
        async for chunk in await client.chat.completions.create(model=model, messages=messages, stream=True, **kw):
            for choice in chunk.choices:
                out["text"] += choice.delta.content or ""
                out["finish_reason"] = choice.finish_reason or out["finish_reason"]
                for call in choice.delta.tool_calls or []:
                    entry = calls.setdefault(call.index, ["", ""])
                    entry[0] = call.function.name or entry[0]
                    entry[1] += call.function.arguments or ""
            chunks += 1
            if chunks == 3 and started is not None:
                started.set()
        out["tokens"] = [tuple(calls[i]) for i in sorted(calls)]
    except openai.APIError as e:
        out.update(outcome="error", error=str(e))
        if started is not None:
            started.set()
    return out


def same_output(got: dict, want: dict) -> bool:
    """The whole output a client ends up with: outcome, text, finish reason and the logprobs' tokens (a chat's tool
    calls) exactly;
    the logprob values to 1e-4. (The token where a request resumed is scored by the prefill's prompt-sized
    forward instead of a decode step's: the same value up to float rounding, as across batch sizes.)"""
    exact = all(got.get(k) == want.get(k) for k in ("outcome", "text", "finish_reason", "tokens"))
    a, b = got.get("logprobs") or [], want.get("logprobs") or []
    return exact and len(a) == len(b) and all(abs(x - y) <= 1e-4 for x, y in zip(a, b))


def first_difference(got: dict, want: dict) -> str:
    """Where two outputs part (for an assertion's message)."""
    for k in ("outcome", "finish_reason", "error"):
        if got.get(k) != want.get(k):
            return f"{k}: {got.get(k)!r} != {want.get(k)!r}"
    for k in ("text", "tokens", "logprobs"):
        a, b = got.get(k) or [], want.get(k) or []
        i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        if a != b:
            return f"{k} differ at {i} of {len(a)}/{len(b)}: {a[max(0, i - 3):i + 3]!r} != {b[max(0, i - 3):i + 3]!r}"
    return "equal"
