"""What the engine returns: one RequestOutput per request that progressed in a step."""
from __future__ import annotations

from dataclasses import dataclass

from engine.core.request import RequestMetrics


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: dict[int, float] | None  # top-n alternatives (id -> logprob) when asked


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # every output token so far
    new_token_ids: list[int]  # output tokens produced since the previous report
    text: str  # output text so far (a possible stop-string prefix is held back until finished)
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" | None
    stop_reason: str | int | None  # the stop string or stop token id that ended it
    logprobs: list[TokenLogprob] | None
    metrics: RequestMetrics
    error: Exception | None = None  # finish_reason "error": the request's error (InvalidRequestError: HTTP 400)
    # SamplingParams.prompt_logprobs: one per prompt token (None for the first), once the first token exists
    prompt_logprobs: list[TokenLogprob | None] | None = None
