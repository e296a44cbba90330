"""Incremental detokenization and stop strings: the one implementation, used by the engine (as a
library, `LLM.generate`) and by the router (which detokenizes for the decode ranks, so they send
token ids only and never decode text themselves).

Text grows by decoding a short window of ids and keeping what the window adds beyond its already-read
part (O(window) per token). A window that ends inside a multi-byte character (U+FFFD) waits for the
next token. While a request runs, a tail of the text that could still become a stop string is held
back, so a stream never shows text that the stop string later removes.
"""
from __future__ import annotations

from dataclasses import dataclass

# Prompt tokens decoded with the first output token, so it keeps its leading space (SentencePiece)
# and a multi-byte character split across the prompt's end is not cut.
_CONTEXT_TOKENS = 5


@dataclass(frozen=True, slots=True)
class TextDelta:
    text: str  # new visible text
    stop: str | None  # the stop string that ended the output, if one did


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int] | tuple[int, ...], stop: list[str] | None = None,
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

    def visible_text(self, finished: bool) -> str:
        """All text safe to show: while running, without the tail that could become a stop string."""
        return self.text[: self._visible_end(finished or self.stopped is not None)]

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

    def _visible_end(self, final: bool) -> int:
        end = len(self.text)
        if not final and self.stop:
            end = max(self._shown, end - (max(len(s) for s in self.stop) - 1))
        return end

    def _visible(self, final: bool) -> TextDelta:
        end = self._visible_end(final)
        delta = self.text[self._shown:end]
        self._shown = end
        return TextDelta(delta, self.stopped)
