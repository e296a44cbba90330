"""What the engine returns: one RequestOutput per request that progressed in a step, with its
speculative decoding counts (SpecUsage, what the OpenAI server reports as `usage.speculative`)."""
from __future__ import annotations

from dataclasses import dataclass

from engine.core.request import RequestMetrics


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: dict[int, float] | None  # top-n alternatives (id -> logprob) when asked


@dataclass(frozen=True, slots=True)
class SpecUsage:
    """One request's speculative decoding so far, as vLLM and SGLang report it per request. Counted only for
    steps that verify drafts of a running request (the first token, sampled at the prompt's end, is in none):
    an output of n tokens that no stop cut short is 1 + accepted_tokens + verify_steps long."""

    method: str  # SpecConfig.method
    draft_tokens: int  # drafts verified, forced ones included
    accepted_tokens: int  # drafts accepted
    forced_tokens: int  # drafts the request's grammar forced (SpecConfig.forced_drafts), among draft_tokens
    verify_steps: int  # decoding steps; each emits its accepted drafts plus one token of the target's

    def __post_init__(self) -> None:
        assert 0 <= self.accepted_tokens <= self.draft_tokens and 0 <= self.forced_tokens <= self.draft_tokens
        assert self.verify_steps >= 1, "no speculation ran: RequestOutput.speculative is None"

    @property
    def acceptance_length(self) -> float:
        """Tokens per decoding step (accepted drafts + 1, averaged): 1.0 is no gain over plain decoding."""
        return (self.accepted_tokens + self.verify_steps) / self.verify_steps

    def __add__(self, other: "SpecUsage") -> "SpecUsage":
        """The counts of two requests together (the choices of one response)."""
        return SpecUsage(self.method if self.method == other.method else "mixed",
                         self.draft_tokens + other.draft_tokens, self.accepted_tokens + other.accepted_tokens,
                         self.forced_tokens + other.forced_tokens, self.verify_steps + other.verify_steps)

    def body(self) -> dict:
        """The OpenAI `usage.speculative` extension object."""
        return {"method": self.method, "draft_tokens": self.draft_tokens, "accepted_tokens": self.accepted_tokens,
                "forced_tokens": self.forced_tokens, "verify_steps": self.verify_steps,
                "acceptance_length": round(self.acceptance_length, 4)}


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
    speculative: SpecUsage | None = None  # None: the engine runs no speculation, or no decoding step of it ran yet
