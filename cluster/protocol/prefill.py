"""What the router asks of a prefill replica (PrefillRequest, with the DecodeTarget it chose) and what
the replica answers: the first token (PrefillResult) and, once, what the router needs to validate and
tokenize requests (ModelInfo)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class PrefillRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: dict  # engine.SamplingParams fields, already validated by the router


@dataclass(frozen=True, slots=True)
class PrefillResult:
    request_id: str
    token_ids: list[int]  # output tokens sampled by the prefill (the first one)
    finished: bool  # True: nothing to hand over (stopped at the first token, or aborted)
    finish_reason: str | None
    logprobs: list = field(default_factory=list)  # (token id, logprob, top) per token, when asked
    queue_seconds: float = 0.0  # submitted -> first scheduled
    prefill_seconds: float = 0.0  # first scheduled -> first token
    # SamplingParams.prompt_logprobs: (token id, logprob, top) per prompt token, None for the first; [] if not asked
    prompt_logprobs: list = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What the router needs to validate and tokenize requests."""
    model_dir: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
