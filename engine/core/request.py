"""A request's state inside the engine. Progress is "computed vs total tokens" (vLLM v1): the
scheduler gives each request `num_tokens - num_computed_tokens` more tokens of work, which covers a
prefill chunk, a decode token and (with speculation) a verification chain with one mechanism."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.detokenizer import IncrementalDetokenizer
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.handover import HandoverDrafts


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PARKED = "parked"  # prefilled for a hand-over; holds its blocks until released
    RESERVED = "reserved"  # blocks allocated for an incoming hand-over; KV not yet committed
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # Request.error says why (an InvalidRequestError: HTTP 400)

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED,
                        RequestStatus.FINISHED_ERROR)


@dataclass(frozen=True, slots=True)
class Continuation:
    """What a request had produced when it is started again on another engine (a worker died under it): its
    output tokens so far, its seed and, when it asks for logprobs, theirs. The new run goes on exactly where
    the old one stopped: sampling depends only on (seed, position), a grammar replays the tokens, penalties
    and `max_tokens` count them, and its first step computes their KV like a preempted request's."""
    output_token_ids: tuple[int, ...]
    seed: int
    logprobs: tuple = ()  # (token id, logprob, {top id: logprob} | None) per output token, when asked


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_preemptions: int = 0
    # speculation (filled when a draft method runs)
    num_draft_tokens: int = 0  # drafts verified
    num_accepted_tokens: int = 0  # drafts accepted
    num_forced_tokens: int = 0  # drafts verified that the grammar forced (SpecConfig.forced_drafts)
    accepted_lengths: list[int] = field(default_factory=list)  # tokens emitted per decoding step (accepted + 1)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # the user's seed or one the engine drew; sampling depends only on (seed, position)
    max_total_tokens: int  # prompt + output may not exceed this (max_model_len)
    token_ids: list[int] = field(default_factory=list)  # prompt followed by output
    num_computed_tokens: int = 0
    block_hashes: list[int] = field(default_factory=list)  # chain hashes of token_ids' full blocks (prefix caching)
    num_cached_blocks: int = 0  # leading blocks of its table registered in the prefix cache (or found there)
    spec_token_ids: list[int] = field(default_factory=list)  # drafts to verify next step (after token_ids)
    spec_forced: int = 0  # bit j set: spec_token_ids[j] is a token the grammar forced, not a guess
    handover_drafts: HandoverDrafts | None = None  # a parked request's first drafts (engine/handover.py)
    # The first position whose draft-head KV was deferred (engine/speculative/deferred_kv.py): positions from it to
    # the computed ones hold the target's KV but not yet the head's; None: the head's KV is whole.
    draft_holes_from: int | None = None
    status: RequestStatus = RequestStatus.WAITING
    prefill_only: bool = False
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list = field(default_factory=list)  # one engine.outputs.TokenLogprob per output token, when asked
    prompt_logprobs: list | None = None  # engine.outputs.TokenLogprob | None per prompt token, when asked
    num_reported: int = 0  # output tokens already returned by step()
    metrics: RequestMetrics = None  # type: ignore[assignment]
    detokenizer: IncrementalDetokenizer | None = None  # text and stop strings; None where the router does both
    # False while the request's grammar compiles: its prompt may run, but not the chunk that samples
    grammar_ready: bool = True
    error: Exception | None = None  # why it finished with finish_reason "error" (a grammar that did not compile)
    # the tokens that may not be sampled while the output is shorter than params.min_tokens: the engine's EOS
    # ids (unless ignore_eos) and the request's stop_token_ids; empty without min_tokens
    min_tokens_block: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        assert self.prompt_token_ids, "empty prompts are rejected before a Request is built"
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        if self.metrics is None:
            self.metrics = RequestMetrics(arrival_time=time.monotonic())
        self.metrics.num_prompt_tokens = len(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]
