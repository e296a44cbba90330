"""ResponseWriter: turns one choice's Generation (its token events) into that choice of the HTTP response:
incremental text, stop strings, logprobs, tool calls (router/tool_parser.py), usage, and the choice's metrics
(through a ResponseSink: router/sink.py). router/choices.py puts the choices of one response together (n > 1,
batched prompts)."""
from __future__ import annotations

import asyncio
import time

from engine.detokenizer import IncrementalDetokenizer
from router import responses as R
from router.errors import APIError
from router.generation import Generation
from router.sink import OutputText, ResponseSink
from router.tool_parser import ToolCallStream, parse_tool_calls
from structured.output_check import output_violation


class ResponseWriter:
    """Turns one choice's token events into its part of the response: text deltas, stop strings, usage.
    `index`: the choice's place in `choices` (prompt index * n + sample index, as OpenAI numbers them)."""

    def __init__(self, out: OutputText, sink: ResponseSink, body, gen: Generation, rid: str, chat: bool, echo: str,
                 logprobs: int | None, prompt_ids: list[int], tools=None, index: int = 0):
        self.out, self.sink, self.body, self.gen, self.rid, self.chat, self.echo = out, sink, body, gen, rid, chat, echo
        self.index = index
        self.model = out.model
        self.created = R.now()
        self.det = IncrementalDetokenizer(out.tokenizer, prompt_ids, gen.params.get("stop"),
                                          body.include_stop_str_in_output, body.skip_special_tokens)
        self.lp = R.LogprobsBuilder(out.token_text, chat) if logprobs is not None else None
        self.usage = R.Usage(prompt_tokens=len(prompt_ids))
        self.tools = tools  # router.tools.ToolRequest constraining the output to calls, or None
        self.finish_reason: str | None = None
        # judged at the end unless the client's own stop tokens may cut it (stop strings end in piece.stop)
        self._structured = None if gen.params.get("stop_token_ids") else gen.params.get("structured_output")
        self._text: list[str] = []  # the generated text so far, judged when its grammar finishes it
        self._last_token_time: float | None = None
        self._closed = False
        self.status: int | None = None  # this choice's outcome once it ended (200, 499, an error's status)
        self.echo_lp = self._echo_logprobs(prompt_ids) if echo and self.lp is not None else None

    async def deltas(self):
        """(text, logprobs body) pieces; sets finish_reason at the end. Raises APIError."""
        async for ev in self.gen.events():
            now = time.monotonic()
            self.sink.tokens(len(ev.token_ids), None if self._last_token_time is None else now - self._last_token_time)
            self._last_token_time = now
            self.usage.completion_tokens += len(ev.token_ids)
            if self.lp is None:
                piece = self.det.push(ev.token_ids)
                text, stop, lp = piece.text, piece.stop, None
            else:
                text, stop, offsets = self._push_each(ev.token_ids)
                lp = self.lp.add(ev.logprobs, offsets)
            if stop is not None:
                self.finish_reason = "stop"
                self.gen.cancel()  # the decode side stops and frees the blocks
                yield text, lp
                return
            if ev.finish_reason is not None:
                self.finish_reason = ev.finish_reason
                if ev.speculative is not None:
                    self.usage.speculative = ev.speculative
                    self.sink.speculation(ev.speculative)
                last = text + self.det.flush().text
                if ev.finish_reason == "stop":
                    self._check("".join(self._text) + last)
                yield last, lp
                return
            if self._structured is not None:
                self._text.append(text)
            if text or lp:
                yield text, lp

    def _push_each(self, token_ids) -> tuple[str, str | None, list[int]]:
        """Detokenizes token by token: (the text safe to show, the stop string that ended it or None, where
        each token starts in the response's text: `text_offset`, after the echoed prompt)."""
        return push_each(self.det, self.out.token_text, token_ids, len(self.echo))

    def _echo_logprobs(self, prompt_ids: list[int]) -> dict | None:
        """The echoed prompt's logprobs body (completions' echo with logprobs), its entries first in the
        response's arrays; the echo becomes the text its tokens spell, so that tokens and offsets match it."""
        scored = self.gen.first.prompt_logprobs
        if len(scored) != len(prompt_ids):
            raise APIError(500, f"the prefill scored {len(scored)} of the prompt's {len(prompt_ids)} tokens",
                           "internal_error")
        det = IncrementalDetokenizer(self.out.tokenizer, [], None, False, self.body.skip_special_tokens)
        _, _, offsets = push_each(det, self.out.token_text, prompt_ids, 0)
        det.flush()
        self.echo = det.text
        items = [(t, None, None) if entry is None else entry for t, entry in zip(prompt_ids, scored)]
        return self.lp.add(items, [min(at, len(self.echo)) for at in offsets])

    def _check(self, text: str) -> None:
        """Enforce or refuse, last line (structured/output_check.py): raises a 500 for a finished guided
        output its schema rejects (for tool calls: arguments their function's parameters reject),
        before its last piece and its finish_reason are sent."""
        if self._structured is None:
            return
        if self.tools is None:
            violation, param = output_violation(self._structured, text), "response_format"
        else:
            parameters = {t.name: t.parameters for t in self.tools.tools}
            calls = parse_tool_calls(text, self.tools.names).tool_calls
            found = (output_violation({"json_schema": parameters[c.name]}, c.arguments) for c in calls)
            violation, param = next((v for v in found if v is not None), None), "tools"
        if violation is not None:
            self.sink.violation()
            raise APIError(500, f"{violation}; the grammar backend did not enforce it, so the output is "
                           "withheld (please report the schema)", "server_error", param,
                           "structured_output_violation")

    async def collect(self) -> dict:
        """This choice's entry of a whole (non-streamed) response's `choices`. Raises APIError."""
        status = 500
        try:
            text = "".join([t async for t, _ in self.deltas()])
            status = 200
        except APIError as e:
            status = e.status
            raise
        except asyncio.CancelledError:
            status = 499  # the client went away
            raise
        finally:
            self.gen.cancel()  # a no-op once the request ended; else (the client left) it aborts it
            self._done(status)
        text = self.echo + text
        lp = self.lp.body() if self.lp is not None else None
        if not self.chat:
            return R.completion_choice(self.index, text, self.finish_reason, lp)
        if self.tools is None:
            return R.chat_choice(self.index, text, self.finish_reason, lp)
        parsed = parse_tool_calls(text, self.tools.names)
        if parsed.tool_calls and self.finish_reason == "stop":
            self.finish_reason = "tool_calls"
        return R.chat_choice(self.index, parsed.content, self.finish_reason, lp, [c.body() for c in parsed.tool_calls])

    async def chunks(self):
        """This choice's stream chunks (dicts: the role or echo first, the deltas, the finish_reason last).
        Raises APIError; the caller formats the chunks and adds usage (router/choices.py)."""
        status = 499  # until the stream completes: a client that goes away cancels this generator
        try:
            if self.chat:
                yield R.chat_chunk(self.rid, self.model, self.created, {"role": "assistant", "content": ""}, None,
                                   index=self.index)
            elif self.echo:
                yield R.completion_chunk(self.rid, self.model, self.created, self.echo, None, self.echo_lp,
                                         index=self.index)
            calls = ToolCallStream(self.tools.names) if self.chat and self.tools is not None else None
            try:
                async for text, lp in self.deltas():
                    if calls is None:
                        yield self._chunk(text, None, lp)
                        continue
                    deltas = calls.push(text)
                    if lp and not deltas:
                        deltas = [{}]  # logprobs of tokens still held back
                    for i, delta in enumerate(deltas):
                        yield R.chat_chunk(self.rid, self.model, self.created, delta, None, lp if i == 0 else None,
                                           index=self.index)
                if calls is not None:
                    for delta in calls.finish():
                        yield R.chat_chunk(self.rid, self.model, self.created, delta, None, index=self.index)
                    if calls.calls and self.finish_reason == "stop":
                        self.finish_reason = "tool_calls"
            except APIError as e:
                status = e.status
                raise
            yield self._chunk("", self.finish_reason, None)
            status = 200
        finally:
            self.gen.cancel()
            self._done(status)

    def _chunk(self, text: str, finish_reason: str | None, lp: dict | None) -> dict:
        if self.chat:
            return R.chat_chunk(self.rid, self.model, self.created, {"content": text} if text or not finish_reason
                                else {}, finish_reason, lp, index=self.index)
        return R.completion_chunk(self.rid, self.model, self.created, text, finish_reason, lp, index=self.index)

    def __del__(self):
        # A streaming response whose client left before its first byte is never iterated, so its
        # generator's `finally` never runs: clean up when the writer is dropped.
        if not self._closed:
            self.gen.cancel()
            self._done(499)

    def _done(self, status: int) -> None:
        """The choice's own accounting (one engine request in flight); the response's is router/choices.py's."""
        if self._closed:
            return
        self._closed = True
        self.status = status
        self.sink.choice_end(status, self.finish_reason)


def push_each(det: IncrementalDetokenizer, token_text, token_ids, base: int) -> tuple[str, str | None, list[int]]:
    """Push `token_ids` through `det` one at a time: (the text safe to show, the stop string that ended it or
    None, where each token starts in the text, plus `base`). A token's text can arrive with a later token's
    (a piece of a character waits for the rest): a token with text of its own starts that text before the
    end of what has arrived; one without (a piece of a character, a skipped special token) starts where the
    text stood."""
    texts, stop, offsets = [], None, []
    for token_id in token_ids:
        before = len(det.text)
        piece = det.push((token_id,))
        after = len(det.text)  # shorter than before if a stop string was cut off
        own = token_text.bytes_of(token_id)
        try:
            start = max(before, after - len(own.decode()))
        except UnicodeDecodeError:
            start = before
        offsets.append(base + min(start, after))
        texts.append(piece.text)
        stop = piece.stop
    return "".join(texts), stop, offsets
