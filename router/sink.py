"""What a response's writers (router/output.py, router/choices.py) are handed instead of the router: how tokens
become text for this deployment (OutputText), and where their accounting goes (ResponseSink: token, speculation
and structured-output metrics, and the end of each choice and response, which the router's in-flight count
follows). The writers never see the router's state, so they cannot change it beyond these calls."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from router.metrics import RouterMetrics
from router.token_text import TokenText


@dataclass(frozen=True, slots=True)
class OutputText:
    model: str  # the served model's name, as responses carry it
    tokenizer: object  # the model's tokenizer (a transformers tokenizer): incremental detokenizing
    token_text: TokenText  # each token's own text and bytes (logprobs)


class ResponseSink:
    def __init__(self, metrics: RouterMetrics, on_choice_end: Callable[[], None]):
        """on_choice_end: called once per choice that ended, however it ended (one engine request less in
        flight)."""
        self._metrics = metrics
        self._on_choice_end = on_choice_end

    def tokens(self, count: int, gap_s: float | None) -> None:
        """`count` tokens arrived together, `gap_s` after the previous ones (None for a choice's first)."""
        if gap_s is not None and count:
            for _ in range(count):
                self._metrics.itl.observe(gap_s / count)
        self._metrics.generation_tokens.inc(count)

    def speculation(self, usage) -> None:
        """A finished choice's speculation counts (engine.outputs.SpecUsage)."""
        self._metrics.speculation(usage)

    def violation(self) -> None:
        """A finished guided output its schema rejects (withheld from the client)."""
        self._metrics.structured_violations.inc()

    def choice_end(self, status: int, finish_reason: str | None) -> None:
        self._on_choice_end()
        if status == 200:
            self._metrics.finished(finish_reason)

    def request_end(self, endpoint: str, status: int, seconds: float) -> None:
        """A whole response ended (`seconds` since its request arrived)."""
        self._metrics.request_done(endpoint, status)
        if status == 200:
            self._metrics.e2e.observe(seconds)
