"""Incremental detokenization and stop strings, on the router (the decode ranks send token ids only).

Text grows by decoding a short window of ids and keeping what the window adds beyond its already-read
part (O(window) per token). A window that ends inside a multi-byte character (U+FFFD) waits for the
next token. While a request runs, a tail of the text that could still become a stop string is held
back, so a stream never shows text that the stop string later removes.
"""
from __future__ import annotations

from dataclasses import dataclass

_CONTEXT_TOKENS = 5  # prompt tokens decoded with the first output token (keeps its leading space)


@dataclass(frozen=True, slots=True)
class TextDelta:
    text: str  # new visible text
    stop: str | None  # the stop string that ended the output, if one did


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: list[str] | None = None,
                 include_stop: bool = False, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.stop = [s for s in (stop or []) if s]
        self.include_stop = include_stop
        self.skip_special_tokens = skip_special_tokens
        self._ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""  # all output text decoded so far (truncated at a stop string)
        self._shown = 0  # characters of `text` already returned
        self.stopped: str | None = None

    def push(self, token_ids: list[int] | tuple[int, ...]) -> TextDelta:
        """Add output tokens; returns the text safe to show now. After a stop, further tokens are ignored."""
        if self.stopped is not None:
            return TextDelta("", self.stopped)
        for t in token_ids:
            self._ids.append(t)
            added = self._decode_step()
            if added and self._find_stop(len(added)):
                break
        return self._visible(final=self.stopped is not None)

    def flush(self) -> TextDelta:
        """The output ended: decode what is left (even a partial character) and show all of it."""
        if self.stopped is None and self._read_offset < len(self._ids):
            full = self._decode(self._prefix_offset, len(self._ids))
            prefix = self._decode(self._prefix_offset, self._read_offset)
            if len(full) > len(prefix):
                self.text += full[len(prefix):]
                self._read_offset = len(self._ids)
                self._find_stop(len(full) - len(prefix))
        return self._visible(final=True)

    # ------------------------------------------------------------------ internals
    def _decode(self, start: int, end: int) -> str:
        return self.tokenizer.decode(self._ids[start:end], skip_special_tokens=self.skip_special_tokens)

    def _decode_step(self) -> str:
        prefix = self._decode(self._prefix_offset, self._read_offset)
        full = self._decode(self._prefix_offset, len(self._ids))
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        added = full[len(prefix):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self.text += added
        return added

    def _find_stop(self, added_len: int) -> bool:
        if not self.stop:
            return False
        longest = max(len(s) for s in self.stop)
        start = max(0, len(self.text) - added_len - longest + 1)
        hits = [(i, s) for s in self.stop if (i := self.text.find(s, start)) != -1]
        if not hits:
            return False
        idx, s = min(hits)
        self.text = self.text[: idx + len(s)] if self.include_stop else self.text[:idx]
        self.stopped = s
        return True

    def _visible(self, final: bool) -> TextDelta:
        end = len(self.text)
        if not final and self.stop:
            end = max(self._shown, end - (max(len(s) for s in self.stop) - 1))
        delta = self.text[self._shown:end]
        self._shown = end
        return TextDelta(delta, self.stopped)
