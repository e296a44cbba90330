"""Incremental detokenization and stop strings.

Text grows by decoding a short window of ids (prefix_offset..end) and keeping what the window adds
beyond its already-read part, so each step costs O(window), not O(length). A window that ends inside
a multi-byte character (decodes to U+FFFD) waits for the next token.
"""
from __future__ import annotations

from engine.request import Request


def append_text(tokenizer, req: Request, final: bool = False) -> str:
    """Decode the request's newest tokens; returns the text they add (possibly empty). With `final`,
    an incomplete trailing character is emitted as U+FFFD instead of waiting for more tokens."""
    ids = req.token_ids
    skip = req.params.skip_special_tokens
    prefix = tokenizer.decode(ids[req.prefix_offset:req.read_offset], skip_special_tokens=skip)
    full = tokenizer.decode(ids[req.prefix_offset:], skip_special_tokens=skip)
    if len(full) <= len(prefix) or (full.endswith("\ufffd") and not final):
        return ""
    delta = full[len(prefix):]
    req.prefix_offset, req.read_offset = req.read_offset, len(ids)
    req.text += delta
    return delta


def find_stop_string(req: Request, delta_len: int) -> str | None:
    """If a stop string now occurs in the text, truncate the text there and return it."""
    stops = req.params.stop
    if not stops or delta_len == 0:
        return None
    longest = max(len(s) for s in stops)
    start = max(0, len(req.text) - delta_len - longest + 1)
    best: tuple[int, str] | None = None
    for s in stops:
        idx = req.text.find(s, start)
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, s)
    if best is None:
        return None
    idx, s = best
    req.text = req.text[: idx + len(s)] if req.params.include_stop_str_in_output else req.text[:idx]
    return s


def visible_text(req: Request) -> str:
    """Text safe to show while the request runs: a tail that could still become a stop string is held back."""
    if req.status.finished or not req.params.stop:
        return req.text
    hold = max(len(s) for s in req.params.stop) - 1
    return req.text[: len(req.text) - hold] if hold > 0 else req.text
