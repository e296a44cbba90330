"""OpenAI response bodies and SSE chunks for completions and chat completions (plain dicts)."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field


@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int = 0

    def body(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}


@dataclass(slots=True)
class LogprobsBuilder:
    """Collects per-token logprobs in the completions (`tokens/token_logprobs/...`) or chat (`content`) shape."""
    tokenizer: object
    chat: bool
    entries: list = field(default_factory=list)

    def add(self, items) -> dict | None:
        """Items: (token id, logprob, {top id: logprob} | None). Returns this chunk's logprobs body."""
        start = len(self.entries)
        for token_id, logprob, top in items:
            self.entries.append((token_id, logprob, top))
        return self.body(self.entries[start:]) if items else None

    def body(self, entries=None) -> dict | None:
        entries = self.entries if entries is None else entries
        tok = self.tokenizer
        name = lambda i: tok.convert_ids_to_tokens(int(i))  # noqa: E731
        if self.chat:
            return {"content": [{"token": name(t), "logprob": lp, "bytes": list(name(t).encode()),
                                 "top_logprobs": [{"token": name(i), "logprob": v, "bytes": list(name(i).encode())}
                                                  for i, v in (top or {}).items()]}
                                for t, lp, top in entries]}
        return {"tokens": [name(t) for t, _, _ in entries], "token_logprobs": [lp for _, lp, _ in entries],
                "top_logprobs": [{name(i): v for i, v in (top or {}).items()} if top is not None else None
                                 for _, _, top in entries],
                "text_offset": []}


def completion_chunk(rid: str, model: str, created: int, text: str, finish_reason: str | None,
                     logprobs: dict | None = None) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}]}


def chat_chunk(rid: str, model: str, created: int, delta: dict, finish_reason: str | None,
               logprobs: dict | None = None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]}


def usage_chunk(rid: str, model: str, created: int, chat: bool, usage: Usage) -> dict:
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model, "choices": [], "usage": usage.body()}


def completion_body(rid: str, model: str, created: int, text: str, finish_reason: str | None, usage: Usage,
                    logprobs: dict | None) -> dict:
    body = completion_chunk(rid, model, created, text, finish_reason, logprobs)
    body["usage"] = usage.body()
    return body


def chat_body(rid: str, model: str, created: int, text: str | None, finish_reason: str | None, usage: Usage,
              logprobs: dict | None, tool_calls: list[dict] | None = None) -> dict:
    message = {"role": "assistant", "content": text}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}],
            "usage": usage.body()}


def sse(body: dict) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def now() -> int:
    return int(time.time())
