"""OpenAI response bodies and SSE chunks for completions and chat completions (plain dicts)."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from engine.outputs import SpecUsage
from router.token_text import TokenText


@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int = 0
    # Speculative decoding's counts over the choices the decode side reported them for (vLLM's and SGLang's
    # per-request acceptance), the extension object `usage.speculative`; absent without speculation, and
    # for a choice the router ended itself (a stop string) or that finished with its first token.
    speculative: SpecUsage | None = None

    def body(self) -> dict:
        body = {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}
        if self.speculative is not None:
            body["speculative"] = self.speculative.body()
        return body


@dataclass(slots=True)
class LogprobsBuilder:
    """Collects per-token logprobs in the completions (`tokens/token_logprobs/top_logprobs/text_offset`) or
    chat (`content`) shape; tokens as text and bytes (router/token_text.py)."""
    text: TokenText
    chat: bool
    entries: list = field(default_factory=list)  # (token id, logprob, {top id: logprob} | None, text offset)

    def add(self, items, offsets) -> dict | None:
        """Items: (token id, logprob, {top id: logprob} | None); offsets: where each token starts in the
        response's text. Returns this chunk's logprobs body."""
        start = len(self.entries)
        self.entries += [(t, lp, top, at) for (t, lp, top), at in zip(items, offsets, strict=True)]
        return self.body(self.entries[start:]) if items else None

    def body(self, entries=None) -> dict | None:
        entries = self.entries if entries is None else entries
        text, raw = self.text.text_of, self.text.bytes_of
        if self.chat:
            return {"content": [{"token": text(t), "logprob": lp, "bytes": list(raw(t)),
                                 "top_logprobs": [{"token": text(i), "logprob": v, "bytes": list(raw(i))}
                                                  for i, v in (top or {}).items()]}
                                for t, lp, top, _ in entries]}
        # The legacy API always lists the sampled token among the top ones (up to logprobs + 1 entries).
        # An echoed prompt's first token has no logprob (nothing predicts it): null, and null top_logprobs.
        return {"tokens": [text(t) for t, _, _, _ in entries], "token_logprobs": [lp for _, lp, _, _ in entries],
                "top_logprobs": [None if lp is None else
                                 _by_likelihood({text(t): lp, **{text(i): v for i, v in (top or {}).items()}})
                                 for t, lp, top, _ in entries],
                "text_offset": [at for _, _, _, at in entries]}


def _by_likelihood(top: dict[str, float]) -> dict[str, float]:
    return dict(sorted(top.items(), key=lambda kv: -kv[1]))


def completion_chunk(rid: str, model: str, created: int, text: str, finish_reason: str | None,
                     logprobs: dict | None = None, index: int = 0) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [completion_choice(index, text, finish_reason, logprobs)]}


def chat_chunk(rid: str, model: str, created: int, delta: dict, finish_reason: str | None,
               logprobs: dict | None = None, index: int = 0) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]}


def usage_chunk(rid: str, model: str, created: int, chat: bool, usage: Usage) -> dict:
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model, "choices": [], "usage": usage.body()}


def completion_choice(index: int, text: str, finish_reason: str | None, logprobs: dict | None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_choice(index: int, text: str | None, finish_reason: str | None, logprobs: dict | None,
                tool_calls: list[dict] | None = None) -> dict:
    message = {"role": "assistant", "content": text}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}


def whole_body(rid: str, model: str, created: int, chat: bool, choices: list[dict], usage: Usage) -> dict:
    """A whole (non-streamed) response: its choices in index order, usage over all of them."""
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": model, "choices": sorted(choices, key=lambda c: c["index"]), "usage": usage.body()}


def sse(body: dict) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def now() -> int:
    return int(time.time())
